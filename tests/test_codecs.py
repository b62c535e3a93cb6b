"""Every registered codec through the shared battery, with hypothesis for hard inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from recsz.codecs import PayloadError, available_codecs, decode_payload, get_codec
from recsz.codecs.payload import assemble
from tests.common import (
    FIXTURES,
    STORED_HEADER_BYTES,
    bound_violation,
    check_config_roundtrip,
    check_corruption,
    check_roundtrip,
    extreme_case,
    golden_input,
)

CODECS = available_codecs()
BOUNDED = [c for c in CODECS if get_codec(c).error_bounded]


def test_registry_names_the_required_codecs() -> None:
    need = {
        "none",
        "fp16",
        "bf16",
        "fp8",
        "int8",
        "lz4",
        "zstd",
        "sz3",
        "zfp",
        "hybrid",
        "quant",
    }
    assert need <= set(available_codecs())


@pytest.mark.parametrize("name", CODECS)
def test_config_roundtrip(name: str) -> None:
    check_config_roundtrip(get_codec(name))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_roundtrip_dtypes(name: str, dtype: torch.dtype) -> None:
    x = (torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    check_roundtrip(get_codec(name), x, 1e-3)


@pytest.mark.parametrize("name", CODECS)
def test_empty_and_single_row(name: str) -> None:
    c = get_codec(name)
    for shape in [(0, 16), (3, 0), (1, 16)]:
        x = torch.randn(*shape) * 0.1
        check_roundtrip(c, x, 1e-2)


@pytest.mark.parametrize("name", CODECS)
def test_nonfinite_values_come_back_exactly(name: str) -> None:
    x = torch.randn(10, 8) * 0.1
    x[0, 0], x[3, 5], x[9, 7] = float("nan"), float("inf"), float("-inf")
    check_roundtrip(get_codec(name), x, 1e-3)


@pytest.mark.parametrize("name", CODECS)
def test_corruption_is_detected(name: str) -> None:
    check_corruption(get_codec(name), golden_input(), 1e-2)


@pytest.mark.parametrize("name", CODECS)
def test_bad_arguments(name: str) -> None:
    c = get_codec(name)
    with pytest.raises(ValueError, match="2-D"):
        c.encode(torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="float"):
        c.encode(torch.zeros(4, 4, dtype=torch.int32), 0.1)
    if c.error_bounded:
        for eb in (0.0, -1.0, float("nan"), None):
            with pytest.raises(ValueError, match="error bound"):
                c.encode(torch.zeros(4, 4), eb)


def test_foreign_codec_payload_rejected() -> None:
    p = get_codec("zstd").encode(golden_input())
    with pytest.raises(PayloadError, match="made by codec 'zstd'"):
        get_codec("hybrid").decode(p)


def test_unknown_codec_name() -> None:
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        get_codec("nope")


@pytest.mark.parametrize("name", CODECS)
def test_golden_payloads_still_decode(name: str) -> None:
    """Payloads of the current layout, written once, decode to what they decoded to then."""
    path = FIXTURES / f"golden_{name.replace('+', '_')}.pt"
    if not path.exists():
        pytest.fail(f"missing golden fixture {path.name}: run tests/make_golden.py once")
    saved = torch.load(path, weights_only=True)
    y = decode_payload(saved["payload"])
    torch.testing.assert_close(y, saved["decoded"], rtol=0, atol=0, equal_nan=True)


# ---- hypothesis: shapes, bounds and hard cases for the bounded codecs ---------------------
finite32 = st.floats(-1e6, 1e6, allow_nan=False, width=32)
special32 = st.one_of(
    finite32,
    st.sampled_from(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1e-38,
            3.4e38,
            -3.4e38,
            float("nan"),
            float("inf"),
            float("-inf"),
        ]
    ),
)
shapes = st.tuples(st.integers(0, 40), st.integers(1, 40))
bounds = st.one_of(
    st.sampled_from([1.2e-38, 1e-30, 1e-7, 1e-4, 1e-3, 0.0125, 0.5, 3.0]),
    st.floats(1e-9, 10.0, allow_nan=False),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("name", BOUNDED)
@given(data=st.data())
def test_bound_holds_property(name: str, data: st.DataObject) -> None:
    shape = data.draw(shapes)
    a = data.draw(arrays("float32", shape, elements=special32))
    eb = data.draw(bounds)
    x = torch.from_numpy(a.copy())
    if data.draw(st.booleans()) and shape[0] > 1:
        x[1:] = x[0]  # all rows identical
    check_roundtrip(get_codec(name), x, eb)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(-1000, 1000), eb=st.sampled_from([1e-3, 0.1, 1.0 / 3.0, 0.03]))
def test_values_on_rounding_boundaries(k: int, eb: float) -> None:
    """x exactly at (k + 1/2) * 2 eb: the rounding tie must still land within eb."""
    x = torch.full((4, 4), (k + 0.5) * 2 * eb, dtype=torch.float32)
    x += torch.arange(16, dtype=torch.float32).view(4, 4) * 1e-7
    check_roundtrip(get_codec("hybrid"), x, eb)


def test_hybrid_exploits_repeated_rows() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(16, 32, generator=g) * 0.05
    x = rows[torch.randint(0, 16, (2048,), generator=g)]
    c = get_codec("hybrid")
    p_h = c.encode(x, 1e-3)
    p_q = get_codec("quant").encode(x, 1e-3)
    assert p_h.numel() <= p_q.numel()
    assert x.numel() * 4 / p_h.numel() > 50  # 16 distinct rows of 2048
    assert math.isfinite(float((c.decode(p_h) - x).abs().max()))


@pytest.mark.parametrize("name", [c for c in BOUNDED if not get_codec(c).threshold])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_bound_too_tight_for_the_codes_sends_the_values_stored(
    name: str, dtype: torch.dtype
) -> None:
    """Codes beyond the quantizer's range would all be outliers (12 bytes each, 3x the
    values before the fallback): the payload holds the values themselves, exactly."""
    x = (torch.randn(300, 16, generator=torch.Generator().manual_seed(3)) * 1e3).to(dtype)
    x[7, 3] = float("nan")
    codec = get_codec(name)
    p = check_roundtrip(codec, x, 1e-30)
    assert p.numel() <= x.numel() * x.element_size() + STORED_HEADER_BYTES
    torch.testing.assert_close(codec.decode(p), x, rtol=0, atol=0, equal_nan=True)
    check_corruption(codec, x, 1e-30)


def test_stored_values_that_do_not_fit_the_shape_are_rejected() -> None:
    """A well-formed, checksummed payload whose stored section is one value short."""
    codec = get_codec("hybrid")
    x = torch.randn(4, 8)
    raw = x.view(-1).view(torch.uint8).numpy()

    def fields(body_len: int) -> bytes:
        return codec._header_fields(x.shape, x.dtype, 1e-30, body_len)

    assert torch.equal(codec.decode(assemble(fields, [raw])), x)
    with pytest.raises(PayloadError, match=r"124 bytes do not hold 32 x torch.float32"):
        codec.decode(assemble(fields, [raw[:-4]]))


def test_casting_codecs_are_not_called_bounded() -> None:
    for name in ("fp16", "bf16", "fp8", "int8"):
        c = get_codec(name)
        assert not c.error_bounded and not c.lossless


# ---- the edges: extreme bounds and values, every dtype (benchmarks/bench_bounds.py runs
# the same cases by the million) -----------------------------------------------------------
@pytest.mark.parametrize("name", CODECS)
def test_extreme_bounds_and_values_keep_the_contract(name: str) -> None:
    codec = get_codec(name)
    rng = np.random.default_rng([7, len(name)])
    for _ in range(150):
        x, eb = extreme_case(rng)
        v = bound_violation(codec, x, eb)
        assert v is None, f"{name} on {x.dtype} {tuple(x.shape)} eb={eb!r}: {v}\n{x}"


@pytest.mark.parametrize("name", BOUNDED)
@pytest.mark.parametrize("eb", [1e-39, 1.7e38, 0.0, float("inf"), float("nan")])
def test_bounds_outside_the_accepted_range_are_refused(name: str, eb: float) -> None:
    with pytest.raises(ValueError, match=r"outside the accepted range \[1\.175494e-38, 1e\+38\]"):
        get_codec(name).encode(torch.ones(2, 3), eb)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "int8", "tr-fp16", "tr-bf16"])
def test_casts_saturate_instead_of_overflowing(name: str) -> None:
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, -big, 1.0, 0.0]])
    y = get_codec(name).decode(get_codec(name).encode(x))
    assert bool(torch.isfinite(y).all()), y
