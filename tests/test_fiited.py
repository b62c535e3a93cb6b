"""FIITED's chunk store against a plain dense table with the same chunks masked to zero."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.model.fiited import FiitedLookup, FiitedSpec, FiitedStore, top_mask
from recsz.model.rowopt import RowOptimizer


def store_of(sizes: list[int], dim: int = 16, chunk: int = 4, budget: float = 0.5,
             kind: str = "sgd", seed: int = 0) -> tuple[FiitedStore, torch.Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(sizes), dim, generator=g)
    return FiitedStore(w, sizes, FiitedSpec(budget, chunk), RowOptimizer(kind, 0.1)), w


def masked(store: FiitedStore, w: torch.Tensor) -> torch.Tensor:
    m = store.allocated().repeat_interleave(store.c, 1)
    return w * m


def check_invariants(store: FiitedStore) -> None:
    alloc = store.allocated()
    slots = store.ptr[alloc].long()
    assert slots.numel() == store.pool.shape[0]  # pool = unpruned chunks, no more
    assert torch.equal(slots.sort().values, torch.arange(slots.numel()))  # unique, dense
    # each row keeps a prefix of its chunks (the last ones go first)
    assert bool((alloc[:, 1:] <= alloc[:, :-1]).all())


def test_lookup_and_update_equal_a_masked_dense_table() -> None:
    store, w = store_of([30, 20])
    store.score.copy_(torch.rand(50, generator=torch.Generator().manual_seed(1)))
    store.prune()
    check_invariants(store)
    ref = masked(store, w)
    rows = torch.tensor([0, 3, 3, 49, 17, 30, 3])
    torch.testing.assert_close(store.lookup(rows), ref[rows], rtol=0, atol=0)
    # one SGD step through autograd: allocated chunks move by -lr * summed grad, others stay 0
    g = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
    y = FiitedLookup.apply(store.pool, rows, store)
    (y * g).sum().backward()
    step = torch.zeros_like(w).index_add_(0, rows, g)
    want = ref - 0.1 * step * store.allocated().repeat_interleave(4, 1)
    torch.testing.assert_close(store.lookup(torch.arange(50)), want, rtol=0, atol=1e-6)
    assert store.pool.grad is None  # updated in place, no gradient kept


def test_pruned_chunks_stay_zero_and_never_update() -> None:
    store, _ = store_of([40], kind="adagrad")
    store.score[:10] = 5.0  # rows 0-9 matter
    store.prune()
    pruned = ~store.allocated()
    assert bool(pruned[10:].any()) and not bool(pruned[:10].any())
    for _ in range(3):
        rows = torch.arange(40)
        FiitedLookup.apply(store.pool, rows, store).sum().backward()
        full = store.lookup(rows).view(40, store.k, store.c)
        assert bool((full[pruned] == 0).all())
    check_invariants(store)


def test_freed_slots_are_reused_and_revived_rows_start_at_zero() -> None:
    store, w = store_of([64], budget=0.25)
    store.score[:16] = 1.0
    store.prune()
    before = store.pool.shape[0]
    assert before == 64 * 4 // 4
    kept = store.lookup(torch.arange(16))
    torch.testing.assert_close(kept, masked(store, w)[:16], rtol=0, atol=0)  # moved intact
    store.score.zero_()
    store.score[48:] = 100.0  # other rows become the important ones
    info = store.prune()
    assert info["revived"] > 0 and info["freed"] > 0
    assert store.pool.shape[0] == before  # the revived took the freed slots
    check_invariants(store)
    assert bool((store.lookup(torch.arange(48, 64)) == 0).all())  # revived: zeros


def test_baseline_rules_keep_leading_chunks_or_whole_frequent_rows() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 16, generator=g)
    uniform = FiitedStore(w, [40], FiitedSpec(0.5, 4, rule="uniform"), RowOptimizer("sgd", 0.1))
    assert bool(uniform.allocated()[:, :2].all()) and not bool(uniform.allocated()[:, 2:].any())
    freq = FiitedStore(w, [40], FiitedSpec(0.25, 4, rule="frequency"), RowOptimizer("sgd", 0.1))
    for _ in range(3):  # rows 30-39 looked up every step, others once
        rows = torch.cat([torch.arange(30, 40), torch.arange(30, 40), torch.tensor([0, 5])])
        FiitedLookup.apply(freq.pool, rows, freq).sum().backward()
    freq.prune()
    kept = freq.allocated()
    assert bool(kept[30:].all()) and not bool(kept[:30].any())  # whole rows, the frequent


def test_checkpoint_round_trip_is_exact() -> None:
    store, _ = store_of([25, 15], kind="rowwise_adagrad")
    store.score.copy_(torch.rand(40, generator=torch.Generator().manual_seed(3)))
    FiitedLookup.apply(store.pool, torch.arange(40), store).pow(2).sum().backward()
    store.prune()
    fresh, _ = store_of([25, 15], kind="rowwise_adagrad", seed=9)
    fresh.load_state_dict(store.state_dict())
    for name, t in store.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    assert torch.equal(fresh.lookup(torch.arange(40)), store.lookup(torch.arange(40)))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        FiitedSpec(0.0)
    with pytest.raises(ValueError, match="does not divide the tables' dim 16"):
        FiitedStore(torch.zeros(4, 16), [4], FiitedSpec(0.5, chunk=5), None)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    budget=st.floats(0.05, 1.0),
    chunk=st.sampled_from([1, 2, 4, 8]),
    rounds=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_pruning_keeps_the_budget_and_the_invariants(
    sizes: list[int], budget: float, chunk: int, rounds: int, seed: int
) -> None:
    store, _ = store_of(sizes, dim=8, chunk=chunk, budget=budget, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        rows = torch.randint(0, sum(sizes), (20,), generator=g)
        FiitedLookup.apply(store.pool, rows, store).pow(2).sum().backward()
        store.prune()
        check_invariants(store)
        kept, start = store.allocated().sum(1), 0
        for n in sizes:
            assert int(kept[start : start + n].sum()) == round(budget * n * store.k)
            start += n
    n = sum(sizes)  # pool + first slot (int32), count (uint8), score (float32) per row
    assert store.bytes_held == 4 * store.pool.numel() + 9 * n


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.25]), min_size=1, max_size=40),
    q=st.integers(-1, 45),
)
def test_top_mask_picks_what_a_stable_descending_sort_picks(values: list[float], q: int) -> None:
    x = torch.tensor(values, dtype=torch.float64)
    want = torch.zeros(len(values), dtype=torch.bool)
    want[torch.sort(x, descending=True, stable=True).indices[: max(q, 0)]] = True
    assert torch.equal(top_mask(x, q), want)
