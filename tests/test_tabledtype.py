"""Half-precision tables (``--table-dtype fp16 | bf16``): the stochastic rounding of their
updates against a plain reference (each value one of its two neighbours, unbiased, the
same draw for the same values), and the tables looked up and updated as a float32 table
holding the same values is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.model import ModelConfig, RowOptimizer, SparseArch
from recsz.model.rowopt import round_stochastic

HALF = [torch.float16, torch.bfloat16]
CFG = ModelConfig(table_sizes=(30, 7, 50), emb_dim=8, bottom_mlp=(8,), top_mlp=(1,))


def neighbours(x: float, dtype: torch.dtype) -> tuple[float, float]:
    """The largest value of ``dtype`` at most x and the smallest at least x (plain
    Python over the dtype's values near x)."""
    t = torch.tensor(x, dtype=torch.float32)
    c = t.to(dtype)
    up = torch.nextafter(c, torch.tensor(float("inf"), dtype=dtype))
    down = torch.nextafter(c, torch.tensor(float("-inf"), dtype=dtype))
    values = sorted({float(v) for v in (down, c, up)})
    below = max(v for v in values if v <= x)
    above = min(v for v in values if v >= x)
    return below, above


@settings(max_examples=300, deadline=None)
@given(
    x=st.floats(-60000, 60000, width=32) | st.floats(-(2.0**-10), 2.0**-10, width=32),
    salt=st.integers(-(2**15), 2**15 - 1),
    dtype=st.sampled_from(HALF),
)
def test_each_value_rounds_to_one_of_its_neighbours(x: float, salt: int, dtype) -> None:
    got = round_stochastic(
        torch.tensor([x]), dtype, torch.tensor([salt], dtype=torch.int16).view(dtype)
    )
    assert got.dtype == dtype
    below, above = neighbours(x, dtype)
    assert float(got) in (below, above), (x, float(got), below, above)
    again = round_stochastic(
        torch.tensor([x]), dtype, torch.tensor([salt], dtype=torch.int16).view(dtype)
    )
    assert torch.equal(got, again)  # a hash, not a generator: the same draw


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_is_unbiased_and_keeps_what_it_can(dtype: torch.dtype) -> None:
    """20,000 draws of a value 0.3 of the way between two neighbours average it (within
    a hundredth of the gap); representable values, inf and NaN stay as they are."""
    lo = torch.tensor(0.7, dtype=dtype)
    hi = torch.nextafter(lo, torch.tensor(1.0, dtype=dtype))
    x = lo.float() + 0.3 * (hi.float() - lo.float())
    n = 20_000
    salts = torch.arange(n, dtype=torch.int32).to(torch.int16).view(dtype)
    got = round_stochastic(x.repeat(n), dtype, salts).float()
    assert set(got.unique().tolist()) == {float(lo), float(hi)}
    share = float((got == float(hi)).float().mean())
    assert abs(share - 0.3) < 0.01, share
    edge = torch.tensor([0.0, -2.0, 0.5, float("inf"), float("-inf"), float("nan")])
    kept = round_stochastic(edge, dtype, salts[: len(edge)])
    np.testing.assert_array_equal(kept.float().numpy(), edge.numpy())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
def test_half_tables_train_as_float32_tables_of_their_values(kind: str, dtype) -> None:
    """Each step from the same stored values: the half table looks up what a float32 table
    of its values does, and its update lands on a neighbour of the float32 update, with
    the float32 optimizer state (the first step from equal states; later ones follow the
    half table's own values)."""
    tables = [0, 2]
    half = SparseArch(CFG, tables, 0, RowOptimizer(kind, 0.3), dtype=dtype)
    assert half.weight.dtype == dtype and half.optimizer_state.dtype == torch.float32
    assert half.bytes_held == SparseArch(CFG, tables, 0).bytes_held // 2
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        ref = SparseArch(CFG, tables, 0, RowOptimizer(kind, 0.3))
        with torch.no_grad():
            ref.weight.copy_(half.weight.float())
            ref.optimizer_state.copy_(half.optimizer_state)
        ids = torch.stack([torch.randint(0, n, (16,), generator=g) for n in CFG.table_sizes], 1)
        up = torch.randn(16, len(tables), CFG.emb_dim, generator=g)
        out = half(ids)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref(ids), rtol=0, atol=0)
        (out * up).sum().backward()
        (ref(ids) * up).sum().backward()
        torch.testing.assert_close(half.optimizer_state, ref.optimizer_state, rtol=1e-6, atol=0)
        new, want = half.weight.detach().float(), ref.weight.detach()
        gap = (torch.nextafter(half.weight.detach(), torch.full_like(half.weight, 1e4)).float()
               - new).abs() * 2  # a neighbour lies within a gap either side  # fmt: skip
        assert bool(((new - want).abs() <= gap).all()), step
    bags = half.bags(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([[2, 3]]))
    w = half.weight.detach().float()
    want = torch.stack([w[0] + w[1], w[30 + 2] + w[30 + 3] + w[30 + 4]])[None]
    torch.testing.assert_close(bags, want, rtol=0, atol=0)  # summed in float32


@pytest.mark.parametrize("dtype", HALF)
def test_the_neighbour_found_on_the_bits_is_nextafters(dtype: torch.dtype) -> None:
    """Every finite 16-bit value, both ways: the bit arithmetic (any device) gives what
    torch.nextafter does (not every device's torch has it for 16-bit floats)."""
    from recsz.model.rowopt import _next

    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(h)
    for up in (True, False):
        got = _next(h, torch.full(h.shape, up))
        want = torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf")))
        assert torch.equal(got.float()[finite], want.float()[finite]), up


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", HALF)
def test_the_rounding_on_a_gpu_equals_the_hosts(dtype: torch.dtype) -> None:
    """The same values and salts round alike on the GPU and the host: a run moved between
    them (or ranks on both) keeps its tables."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.logspace(-6, 4, 100_000)
    salt = torch.randn(100_000, generator=g).to(dtype)
    host = round_stochastic(x, dtype, salt)
    gpu = round_stochastic(x.cuda(), dtype, salt.cuda()).cpu()
    assert torch.equal(host.view(torch.int16), gpu.view(torch.int16))
