"""A rank's tables' saved state, table by table.

:class:`recsz.model.tables.SparseArch` keeps its dense tables' rows end to end in one
buffer (and its row optimizer's state beside them) and its TT tables as modules numbered
in order. A checkpoint written by W ranks is resumed on another number of ranks by cutting
each rank's ``state_dict`` into its tables' pieces (:func:`split`: a table's rows and
optimizer rows, or its rows' chunks in FIITED's store; a TT table's cores, cache and its
cores' optimizers) and joining the pieces of the tables a rank now holds into its own
module's layout (:func:`join`). A table moves whole: what was trained is what is resumed,
whichever rank holds it.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

#: one table's saved state: "weight" and "optimizer_state" rows (a dense table), "store"
#: (its rows in FIITED's store: chunk counts, scores, chunks and their optimizer state),
#: or "tt" (its module's state, keys below the module) and "tt_opts" (its cores' optimizers)
Piece = dict[str, Any]

_TT_OPTS = "tt._extra_state"  # TTTables' optimizers' states, table after table
_STORE = "store."  # FIITED's chunk store (the dense tables' rows then live there)


def _tt_prefix(i: int) -> str:
    return f"tt.bags.{i}."


def split(
    state: Mapping[str, Any],
    tables: Sequence[int],
    table_sizes: Sequence[int],
    tt_tables: Collection[int],
) -> dict[int, Piece]:
    """The pieces of the ``SparseArch`` state ``state`` that held ``tables`` (global,
    in order), ``tt_tables`` of the model's tables being tensor trains. ValueError where
    the state does not fit (rows or slots that are not its tables')."""
    dense = [t for t in tables if t not in tt_tables]
    tts = [t for t in tables if t in tt_tables]
    rows = [table_sizes[t] for t in dense]
    cut = _store_rows if _STORE + "pool" in state else _rows
    pieces: dict[int, Piece] = dict(zip(dense, cut(state, dense, rows), strict=True))
    opts = state[_TT_OPTS] if tts else []
    if len(opts) % max(1, len(tts)):
        raise ValueError(f"{len(opts)} TT optimizers saved for {len(tts)} TT tables")
    each = len(opts) // max(1, len(tts))
    for i, t in enumerate(tts):
        pre = _tt_prefix(i)
        module = {k[len(pre) :]: v for k, v in state.items() if k.startswith(pre)}
        pieces[t] = {"tt": module, "tt_opts": list(opts[i * each : (i + 1) * each])}
    return pieces


#: the last part of the state keys only training reads: the row optimizers' accumulators
#: (the rows', FIITED's chunks' and the TT caches' ``state``) and the TT modules' extra
#: state (their cores' optimizers; a cache's count of lookups since its last fill)
_TRAINING_ONLY = ("optimizer_state", "state", "_extra_state")


def for_scoring(state: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """A saved module state ``state`` for a module built to score, with no optimizers
    (``template``: its ``state_dict()``): what only training reads taken from the template
    (empty), the rest as saved."""
    return {
        k: template[k] if k.rsplit(".", 1)[-1] in _TRAINING_ONLY and k in template else v
        for k, v in state.items()
    }


def _rows(state: Mapping[str, Any], dense: list[int], rows: list[int]) -> list[Piece]:
    """Dense tables' rows end to end, the row optimizer's state beside them."""
    weight, opt = state["weight"], state["optimizer_state"]
    if weight.shape[0] != sum(rows):
        raise ValueError(f"{weight.shape[0]} rows saved for tables {dense} of {sum(rows)} rows")
    if not opt.numel():  # SGD: no state
        return [{"weight": w, "optimizer_state": opt} for w in weight.split(rows)]
    if opt.shape[0] != weight.shape[0]:  # Adagrad: per element or per row
        raise ValueError(f"the row optimizer's state has {opt.shape[0]} rows, not {sum(rows)}")
    return [
        {"weight": w, "optimizer_state": o}
        for w, o in zip(weight.split(rows), opt.split(rows), strict=True)
    ]


def _store_rows(state: Mapping[str, Any], dense: list[int], rows: list[int]) -> list[Piece]:
    """FIITED's store: per row its chunk count and score; its chunks (and their optimizer
    state) held in slots one row after another (``base``: each row's first), so a table's
    are one run of slots."""
    count, base, score = (state[_STORE + k] for k in ("count", "base", "score"))
    pool, slots = state[_STORE + "pool"], state[_STORE + "state"]
    if count.shape[0] != sum(rows):
        raise ValueError(f"{count.shape[0]} rows saved for tables {dense} of {sum(rows)} rows")
    first = torch.cumsum(count.long(), 0) - count.long()
    if not torch.equal(base.long(), first) or int(count.long().sum()) != pool.shape[0]:
        raise ValueError("the FIITED store's slots are not its rows' chunks in order")
    sizes = [int(c.long().sum()) for c in count.split(rows)]
    per_slot = slots.split(sizes) if slots.numel() else [slots] * len(rows)
    return [
        {"store": {"count": c, "score": r, "pool": p, "state": o}}
        for c, r, p, o in zip(
            count.split(rows), score.split(rows), pool.split(sizes), per_slot, strict=True
        )
    ]


def join(
    pieces: Mapping[int, Piece],
    tables: Sequence[int],
    tt_tables: Collection[int],
    template: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``SparseArch`` state of a module holding ``tables`` (its ``state_dict()`` is
    ``template``) made of their pieces, sharing no memory with them (they may be a file's,
    memory-mapped); KeyError naming the tables no piece holds."""
    if missing := [t for t in tables if t not in pieces]:
        raise KeyError(f"no saved state for tables {missing}")
    dense = [t for t in tables if t not in tt_tables]
    tts = [t for t in tables if t in tt_tables]
    out = dict(template)
    if dense and _STORE + "pool" in template:
        store = {
            k: [pieces[t]["store"][k] for t in dense] for k in ("count", "score", "pool", "state")
        }
        for k in ("count", "score", "pool"):
            out[_STORE + k] = torch.cat(store[k])
        if template[_STORE + "state"].numel():
            out[_STORE + "state"] = torch.cat(store["state"])
        count = out[_STORE + "count"].long()
        out[_STORE + "base"] = (torch.cumsum(count, 0) - count).to(template[_STORE + "base"].dtype)
    elif dense:
        out["weight"] = torch.cat([pieces[t]["weight"] for t in dense])
        if template["optimizer_state"].numel():
            out["optimizer_state"] = torch.cat([pieces[t]["optimizer_state"] for t in dense])
    for i, t in enumerate(tts):
        out.update({_tt_prefix(i) + k: v for k, v in copy.deepcopy(pieces[t]["tt"]).items()})
    if tts:
        out[_TT_OPTS] = copy.deepcopy([o for t in tts for o in pieces[t]["tt_opts"]])
    return out


def recolumned(
    pieces: Mapping[int, Piece],
    n_tables: int,
    k_old: int,
    k_new: int,
    wanted: Collection[int] | None = None,
) -> dict[int, Piece]:
    """The plain tables' pieces in ``k_new`` column shards each, from ``k_old`` (shard c of
    table t: piece t * k + c; ``--column-shards`` changed on resume), those in ``wanted``
    (None: all): each new shard's columns gathered from the old shards that hold them (a
    rank never joins a whole table it holds a shard of); the row optimizer's state per
    element likewise, one per row (row-wise Adagrad's: a sum of mean squares over the
    shard's columns) the mean of the old shards' (exactly the whole row's), which each new
    shard starts from. ValueError for tables that are not plain rows (FIITED's store, TT
    cores)."""
    out: dict[int, Piece] = {}
    for t in range(n_tables):
        new = [c for c in range(k_new) if wanted is None or t * k_new + c in wanted]
        if not new:
            continue
        old = [pieces[t * k_old + c] for c in range(k_old)]
        if any("weight" not in p for p in old):
            raise ValueError(f"table {t}: only plain tables change their column shards")
        w_old = old[0]["weight"].shape[1]
        width = w_old * k_old // k_new
        opts = [p["optimizer_state"] for p in old]
        per_row = opts[0].numel() and opts[0].dim() == 1
        row_state = torch.stack(opts).mean(0) if per_row else None
        for c in new:
            cols = (c * width, (c + 1) * width)
            if row_state is not None:
                state = row_state
            elif opts[0].numel():  # per element
                state = _columns(old, "optimizer_state", *cols)
            else:  # SGD: none
                state = opts[0]
            out[t * k_new + c] = {
                "weight": _columns(old, "weight", *cols),
                "optimizer_state": state,
            }
    return out


def _columns(shards: Sequence[Piece], key: str, lo: int, hi: int) -> torch.Tensor:
    """Columns [lo, hi) of a whole table's ``key``, from its column ``shards`` in order."""
    w = shards[0][key].shape[1]
    got = [p[key][:, max(lo - j * w, 0) : min(hi - j * w, w)]
           for j, p in enumerate(shards) if j * w < hi and (j + 1) * w > lo]  # fmt: skip
    return got[0] if len(got) == 1 else torch.cat(got, 1)
