"""A rank's tables' state cut table by table and joined into another plan's modules
(a checkpoint resumed on another number of ranks): every table's rows, row optimizer
state, TT cores, caches and core optimizers arrive as they left, and the modules look up
what the one module holding every table looks up."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.model import ModelConfig, RowOptimizer, SparseArch, tablestate
from recsz.model.fiited import FiitedSpec
from recsz.model.ttrec import TTSpec

CFG = ModelConfig(table_sizes=(40, 7, 60, 13, 25), emb_dim=4, bottom_mlp=(4,), top_mlp=(1,))
ALL = list(range(len(CFG.table_sizes)))


def ids(b: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (b,), generator=g) for n in CFG.table_sizes], 1)


FIITED = FiitedSpec(0.5, chunk=2)


def arch(tables: list[int], kind: str, tt: TTSpec | None, fiited: bool = False) -> SparseArch:
    opt = RowOptimizer(kind, 0.1)
    return SparseArch(CFG, tables, 3, opt, tt=tt, fiited=FIITED if fiited else None)


def trained(kind: str, tt: TTSpec | None, fiited: bool = False) -> SparseArch:
    """Every table in one module, after a few steps (optimizer state, caches filled, a
    FIITED store pruned between them)."""
    whole = arch(ALL, kind, tt, fiited)
    for k in range(6):
        x = ids(16, k)
        (whole(x) ** 2).sum().backward()
        if k == 3:
            whole.prune()
    return whole


def moved(
    src: list[SparseArch], plan: list[list[int]], kind: str, tt: TTSpec | None, fiited: bool
) -> list[SparseArch]:
    """Modules holding ``plan``'s tables, each restored from ``src``'s pieces."""
    pieces: dict[int, tablestate.Piece] = {}
    tts = tt.tables if tt else frozenset()
    for m in src:
        pieces.update(tablestate.split(m.state_dict(), m.tables, CFG.table_sizes, tts))
    out = []
    for tables in plan:
        m = arch(tables, kind, tt, fiited)
        m.load_state_dict(tablestate.join(pieces, tables, tts, m.state_dict()))
        out.append(m)
    return out


def assert_same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):  # type: ignore[call-overload]
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def held(m: SparseArch, t: int) -> dict[str, object]:
    """What module ``m`` holds of table ``t``, read from its tensors and optimizers."""
    if t in m.dense_tables and m.store is not None:
        j = m.dense_tables.index(t)
        r = torch.arange(sum(m.sizes[:j]), sum(m.sizes[: j + 1]))
        st, ptr = m.store.state, m.store.ptr[r].long()
        return {
            "rows": m.store.lookup(r),
            "count": m.store.count[r],
            "score": m.store.score[r],
            "state": st[ptr[ptr >= 0]] if st.numel() else st,
        }
    if t in m.dense_tables:
        j, rows = m.dense_tables.index(t), m.sizes
        opt = m.optimizer_state
        return {
            "rows": m.weight.detach().split(rows)[j],
            "opt": opt.split(rows)[j] if opt.numel() else opt,
        }
    i = m.tt.tables.index(t)
    cores = len(m.tt.optimizers) // len(m.tt.tables)
    bag = m.tt.bags[i]
    return {
        "module": bag.state_dict(),
        "opts": [o.state_dict()["state"] for o in m.tt.optimizers[i * cores : (i + 1) * cores]],
    }


def plans(draw_owner: list[int], world: int) -> list[list[int]]:
    return [[t for t in ALL if draw_owner[t] == r] for r in range(world)]


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]),
    tt_tables=st.sets(st.sampled_from([0, 2, 4]), max_size=2),
    old=st.lists(st.integers(0, 2), min_size=5, max_size=5),
    new=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    fiited=st.booleans(),
)
def test_tables_move_whole_between_plans(
    kind: str, tt_tables: set[int], old: list[int], new: list[int], fiited: bool
) -> None:
    tt = TTSpec(frozenset(tt_tables), rank=2, cache_rows=3, cache_interval=2) if tt_tables else None
    whole = trained(kind, tt, fiited)
    first = moved([whole], plans(old, 3), kind, tt, fiited)  # by 3 ranks (some hold none)
    then = moved(first, plans(new, 4), kind, tt, fiited)  # resumed on 4
    for m in then:
        for t in m.tables:
            assert_same(held(m, t), held(whole, t), f"table {t}")
    x = ids(32, 99)
    with torch.no_grad():
        ref = whole(x)
        for m in then:
            if m.tables:
                torch.testing.assert_close(m(x), ref[:, m.tables], rtol=0, atol=0)


def test_joined_state_shares_no_memory_with_the_pieces() -> None:
    """Pieces may be a memory-mapped file's: the joined state is the module's own."""
    tt = TTSpec(frozenset({2}), rank=2, cache_rows=3, cache_interval=2)
    whole = trained("adagrad", tt)
    pieces = tablestate.split(whole.state_dict(), ALL, CFG.table_sizes, tt.tables)
    target = arch([2, 4], "adagrad", tt)
    joined = tablestate.join(pieces, [2, 4], tt.tables, target.state_dict())
    before = {k: v.clone() for k, v in joined.items() if isinstance(v, torch.Tensor)}
    for p in pieces.values():
        for v in [*p.get("tt", {}).values(), p.get("weight"), p.get("optimizer_state")]:
            if isinstance(v, torch.Tensor) and v.numel():
                v.add_(1)
    for k, v in before.items():
        assert torch.equal(joined[k], v), k


def test_what_does_not_fit_is_named() -> None:
    whole = trained("rowwise_adagrad", None)
    state = whole.state_dict()
    with pytest.raises(ValueError, match=r"200 rows saved for tables \[0, 1, 2, 3, 4\] of 145"):
        tablestate.split({**state, "weight": torch.zeros(200, 4)}, ALL, CFG.table_sizes, ())
    with pytest.raises(ValueError, match="optimizer's state has 3 rows, not 145"):
        tablestate.split({**state, "optimizer_state": torch.ones(3)}, ALL, CFG.table_sizes, ())
    part = arch([0, 1], "rowwise_adagrad", None)
    pieces = tablestate.split(part.state_dict(), [0, 1], CFG.table_sizes, ())
    with pytest.raises(KeyError, match=r"no saved state for tables \[2, 4\]"):
        tablestate.join(
            pieces, [1, 2, 4], (), arch([1, 2, 4], "rowwise_adagrad", None).state_dict()
        )
    store = trained("adagrad", None, fiited=True).state_dict()
    store["store.base"] = store["store.base"].flip(0)
    with pytest.raises(ValueError, match="FIITED store's slots are not its rows' chunks"):
        tablestate.split(store, ALL, CFG.table_sizes, ())
