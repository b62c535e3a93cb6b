"""TT-Rec tables: the lookup is EmbeddingBag over the rebuilt table, gradients are
autograd's through it, the factor shapes cover any N, the init has DLRM's spread."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recsz.model import TTSpec, get_preset
from recsz.model.ttrec import TTEmbeddingBag, factorize, split_dim


@given(st.integers(1, 10**7), st.integers(2, 4))
def test_row_factors_cover_every_row(n: int, parts: int) -> None:
    p = factorize(n, parts)
    assert len(p) == parts and math.prod(p) >= n
    assert math.prod(p) < 2 * n + 2**parts  # not wastefully large


@given(st.integers(1, 512), st.integers(2, 4))
def test_dim_factors_multiply_to_the_dim(d: int, parts: int) -> None:
    q = split_dim(d, parts)
    assert len(q) == parts and math.prod(q) == d


def table(n: int = 37, d: int = 12, rank: int = 3, cores: int = 3) -> TTEmbeddingBag:
    g = torch.Generator().manual_seed(0)
    return TTEmbeddingBag(n, d, rank=rank, cores=cores, generator=g).double()


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 200),
    st.integers(1, 3),
    st.integers(2, 4),
    st.lists(st.integers(0, 5), min_size=1, max_size=6),
    st.booleans(),
)
def test_lookup_equals_embedding_bag_over_the_full_table(
    n: int, rank: int, cores: int, bag_sizes: list[int], weighted: bool
) -> None:
    t = table(n, 8, rank, cores)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, n, (sum(bag_sizes),), generator=g)
    offsets = torch.tensor([0, *bag_sizes[:-1]]).cumsum(0)
    w = torch.rand(ids.numel(), generator=g, dtype=torch.float64) if weighted else None
    ref = nn.functional.embedding_bag(ids, t.full_weight(), offsets, mode="sum",
                                      per_sample_weights=w)  # fmt: skip
    torch.testing.assert_close(t(ids, offsets, w), ref)


def test_single_ids_with_repeats_are_the_rows() -> None:
    t = table()
    ids = torch.tensor([[5], [5], [36], [0], [5]])
    torch.testing.assert_close(t(ids), t.full_weight()[ids[:, 0]])


def test_core_gradients_equal_autograd_through_the_full_table() -> None:
    t = table()
    ids = torch.tensor([3, 3, 7, 30, 36, 0])
    offsets = torch.tensor([0, 2, 4])
    g = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (t(ids, offsets) * g).sum().backward()
    fast = [c.grad.clone() for c in t.cores]
    t.zero_grad()
    (nn.functional.embedding_bag(ids, t.full_weight(), offsets, mode="sum") * g).sum().backward()
    for a, c in zip(fast, t.cores, strict=True):
        torch.testing.assert_close(a, c.grad)


@pytest.mark.parametrize("shape", ["bags", "2-d"])
def test_the_gpu_path_makes_every_ids_row_and_gives_the_distinct_ids_lookup(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU's path (no host read: no torch.unique, no range check of checked ids) the
    lookup and the cores' gradients equal the CPU's, which makes each distinct row once."""
    from recsz.devicepath import DEVICE_PATH_ON_CPU

    ids = torch.tensor([3, 3, 7, 30, 36, 0, 3, 7])
    args = (ids, torch.tensor([0, 2, 4])) if shape == "bags" else (ids.view(4, 2),)
    g = torch.randn(3 if shape == "bags" else 4, 12, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    got = {}
    for path in ("cpu", "gpu"):
        if path == "gpu":
            monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
            monkeypatch.setattr(torch, "unique", None)  # (a host read on a GPU)
        t = table()
        out = t(*args, checked=path == "gpu")
        (out * g).sum().backward()
        got[path] = (out.detach(), [c.grad for c in t.cores])
    torch.testing.assert_close(got["gpu"][0], got["cpu"][0])
    for a, b in zip(got["gpu"][1], got["cpu"][1], strict=True):
        torch.testing.assert_close(a, b)


def test_tt_tables_check_unchecked_ids_at_once_and_name_the_table() -> None:
    """Ids a caller has not checked are held to their TT tables' rows in one check (one
    host read on a GPU), the table named; checked ones are not read."""
    from recsz.model.ttrec import TTTables

    m = get_preset("tiny").model
    tt = TTTables(m, [2, 5], 0, None, TTSpec(frozenset({2, 5}), rank=2, cores=2))
    ids = torch.zeros(4, m.n_tables, dtype=torch.int64)
    assert tt(ids).shape == (4, 2, m.emb_dim)
    ids[3, 5] = m.table_sizes[5]
    with pytest.raises(IndexError, match=rf"table 5 \(TT\): id {m.table_sizes[5]} outside \[0, "):
        tt(ids)
    ids[3, 5] = 0
    ids[1, 2] = -1
    with pytest.raises(IndexError, match=r"table 2 \(TT\): id -1 outside \[0, \d+\)"):
        tt(ids)


def test_gradcheck_on_tiny_shapes() -> None:
    t = table(n=10, d=4, rank=2, cores=2)
    ids, offsets = torch.tensor([1, 9, 9, 4]), torch.tensor([0, 1])

    inputs = tuple(c.detach().clone().requires_grad_() for c in t.cores)
    assert torch.autograd.gradcheck(lambda *c: torch.func.functional_call(
        t, {f"cores.{k}": v for k, v in enumerate(c)}, (ids, offsets)), inputs)  # fmt: skip


def test_sgd_and_adagrad_steps_match_the_reference_update() -> None:
    for make in (lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)):
        t = table()
        before = [c.detach().clone() for c in t.cores]
        opt = make(t.parameters())
        ids, offsets = torch.tensor([1, 2, 2, 30]), torch.tensor([0, 2])
        t(ids, offsets).pow(2).sum().backward()
        grads = [c.grad.clone() for c in t.cores]
        opt.step()
        for b, g, c in zip(before, grads, t.cores, strict=True):
            if isinstance(opt, torch.optim.SGD):
                want = b - 0.1 * g
            else:  # Adagrad, first step: state = g^2
                want = b - 0.1 * g / (g.abs() + 1e-10)
            torch.testing.assert_close(c.detach(), want)


def test_sampled_init_has_the_spread_of_dlrm_uniform_init() -> None:
    n = 50_000
    t = TTEmbeddingBag(n, 64, rank=16, cores=3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rows = t.rows(torch.randint(0, n, (4000,)))
    want = 1.0 / (3 * n)
    assert 0.7 < float(rows.var()) / want < 1.3
    cores = [1 * 37 * 4 * 16, 16 * 37 * 4 * 16, 16 * 37 * 4 * 1]  # p = 37^3 >= n, q = 4^3
    assert t.bytes_held == 4 * sum(cores) and t.bytes_held * 70 < 4 * n * 64


def test_bad_arguments_and_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="2 to 4 cores"):
        TTEmbeddingBag(10, 4, cores=5)
    with pytest.raises(ValueError, match="init"):
        TTEmbeddingBag(10, 4, init="zeros")
    with pytest.raises(ValueError, match="out of range"):
        table(n=10, d=4)(torch.tensor([[10]]))


def test_tt_tables_in_the_sparse_arch_train_with_their_own_rate() -> None:
    """TT tables beside dense ones: pooled columns in table order, the cores stepped in the
    backward (SGD at the TT rate), the dense rows by the fused row optimizer."""
    from recsz.model import RowOptimizer, SparseArch, TTSpec, get_preset

    m = get_preset("tiny").model
    spec = TTSpec(frozenset({2, 3}), rank=3, lr=0.5)
    sa = SparseArch(m, range(m.n_tables), 0, RowOptimizer("sgd", 0.1), spec)
    ids = torch.randint(0, 3, (16, m.n_tables), generator=torch.Generator().manual_seed(2))
    out = sa(ids)
    torch.testing.assert_close(out[:, 2], sa.tt.bags[0](ids[:, 2:3]))
    before = [c.detach().clone() for c in sa.tt.parameters()]
    g = torch.randn_like(out)
    (out * g).sum().backward()
    c0 = sa.tt.bags[0].cores[0]
    assert c0.grad is None  # stepped and cleared in the backward
    # SGD at rate 0.5: before - 0.5 grad, the grad being autograd's through the lookup.
    probe = TTEmbeddingBag(m.table_sizes[2], m.emb_dim, rank=3)
    with torch.no_grad():
        for p, b in zip(probe.cores, before[:3], strict=True):
            p.copy_(b)
    (probe(ids[:, 2:3]) * g[:, 2]).sum().backward()
    torch.testing.assert_close(c0.detach(), before[0] - 0.5 * probe.cores[0].grad)


def test_adagrad_state_moves_with_the_tt_tables() -> None:
    """``.to()`` of the tables takes the cores' Adagrad sums along (they are made with the
    optimizer, on the cores' first device: on a GPU the step failed on a CPU sum). A cast
    stands in for the device move here: every sum follows its core, and a step runs."""
    from recsz.model import RowOptimizer
    from recsz.model.ttrec import TTTables

    m = get_preset("tiny").model
    tt = TTTables(m, [2], 0, RowOptimizer("rowwise_adagrad", 0.1), TTSpec(frozenset({2}), 3))
    tt = tt.double()
    ids = torch.randint(0, 3, (16, m.n_tables), generator=torch.Generator().manual_seed(2))
    for opt in tt._opts:
        (p,) = opt.param_groups[0]["params"]
        assert opt.state[p]["sum"].dtype == p.dtype == torch.float64
    before = [c.detach().clone() for c in tt.parameters()]
    (tt(ids) ** 2).sum().backward()
    tt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, tt.parameters(), strict=True))


# ---- the cache of hot rows --------------------------------------------------------------
def cached_table(capacity: int = 3, interval: int = 2, kind: str = "sgd") -> TTEmbeddingBag:
    from recsz.model import RowOptimizer
    from recsz.model.ttcache import HotRows

    t = table()
    t.cache = HotRows(capacity, t.embedding_dim, interval, RowOptimizer(kind, 0.5))
    t.cache.double()
    return t


def test_cache_takes_the_most_looked_up_ids_and_starts_them_from_the_tt() -> None:
    t = cached_table(capacity=3, interval=2)
    a = torch.tensor([[5], [5], [5], [9], [9], [2], [7], [7], [30]])
    b = torch.tensor([[30], [30], [7], [1]])
    for ids in (a, b):  # counts since the fill: 5:3, 7:3, 30:3, 9:2, 2:1, 1:1
        t(ids).sum().backward()
    full = t.full_weight().detach()
    probe = torch.arange(37).view(-1, 1)
    with torch.no_grad():
        before = t(probe)
    out = t(torch.tensor([[5]]))  # the fill, then the lookup
    assert t.cache.ids.tolist() == [5, 7, 30]  # ties of counts: the smaller ids
    torch.testing.assert_close(t.cache.weight.detach(), full[[5, 7, 30]])
    torch.testing.assert_close(out.detach(), before[5:6])  # entering changes no value
    with torch.no_grad():
        torch.testing.assert_close(t(probe), before)


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_cached_rows_follow_the_row_optimizer_and_the_cores_the_rest(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On either path (a GPU's splits no hits from misses: every id's TT row, the cached
    one where it hits, no host read) the same rows, steps and gradients."""
    if path == "gpu":
        from recsz.devicepath import DEVICE_PATH_ON_CPU

        monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
        monkeypatch.setattr(torch.Tensor, "nonzero", None)  # (a host read on a GPU)
    t = cached_table(capacity=2, interval=2)
    t(torch.tensor([[4], [4], [8]])).sum().backward()
    t(torch.tensor([[8], [1]])).sum().backward()  # window: 4 and 8 twice, 1 once
    w = t.full_weight().detach()[[4, 8]]  # what the fill will take from the TT
    ref = table()  # the same cores, no cache: the reference for the misses
    with torch.no_grad():
        for p, c in zip(ref.cores, t.cores, strict=True):
            p.copy_(c)
    for c in t.cores:
        c.grad = None
    ids = torch.tensor([[4], [3], [4], [6]])
    g = torch.randn(4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (t(ids) * g).sum().backward()  # fills {4, 8} first
    assert t.cache.ids.tolist() == [4, 8]
    # Row 4: two lookups, one SGD step on their summed gradient; row 8 untouched.
    torch.testing.assert_close(t.cache.weight.detach()[0], w[0] - 0.5 * (g[0] + g[2]))
    torch.testing.assert_close(t.cache.weight.detach()[1], w[1])
    # The cores get the gradient of the misses only.
    miss = torch.tensor([False, True, False, True])
    (ref(ids[miss]) * g[miss]).sum().backward()
    for c, r in zip(t.cores, ref.cores, strict=True):
        torch.testing.assert_close(c.grad, r.grad)
    assert t.cache.hits == 2 and t.cache.lookups == 3 + 2 + 4


def test_cache_state_round_trip() -> None:
    t = cached_table(capacity=2, interval=3, kind="adagrad")
    ids = torch.tensor([[4], [4], [8], [1]])
    for _ in range(4):
        t(ids).sum().backward()
    again = cached_table(capacity=2, interval=3, kind="adagrad")
    again.load_state_dict(t.state_dict())
    for m in (t, again):
        for _ in range(3):
            m(ids).sum().backward()
    torch.testing.assert_close(again.cache.weight, t.cache.weight)
    assert torch.equal(again.cache.state, t.cache.state) and again.cache.hits == t.cache.hits


def test_a_cache_larger_than_the_ids_seen_keeps_the_rest_empty() -> None:
    t = cached_table(capacity=5, interval=1)
    t(torch.tensor([[9], [2], [9]])).sum().backward()
    with torch.no_grad():
        before = t(torch.arange(37).view(-1, 1))
    t(torch.tensor([[2]])).sum().backward()  # fills {2, 9}, then steps row 2
    assert t.cache.ids.tolist()[:2] == [2, 9] and int(t.cache.ids[2:].min()) > 36
    with torch.no_grad():
        after = t(torch.arange(37).view(-1, 1))
    changed = (after - before).abs().amax(1) > 0
    assert changed.nonzero().view(-1).tolist() == [2]  # only the stepped cached row moved
