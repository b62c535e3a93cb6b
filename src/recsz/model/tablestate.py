"""A rank's tables' saved state, table by table.

:class:`recsz.model.tables.SparseArch` keeps its dense tables' rows end to end in one
buffer (and its row optimizer's state beside them) and its TT tables as modules numbered
in order. A checkpoint written by W ranks is resumed on another number of ranks by cutting
each rank's ``state_dict`` into its tables' pieces (:func:`split`: a table's rows and
optimizer rows; a TT table's cores, cache and its cores' optimizers) and joining the pieces
of the tables a rank now holds into its own module's layout (:func:`join`). A table moves
whole: what was trained is what is resumed, whichever rank holds it.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

#: one table's saved state: "weight" and "optimizer_state" rows (a dense table), or
#: "tt" (its module's state, keys below the module) and "tt_opts" (its cores' optimizers)
Piece = dict[str, Any]

_TT_OPTS = "tt._extra_state"  # TTTables' optimizers' states, table after table


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
    the state does not fit (a FIITED store, rows that are not its tables')."""
    if any(k.startswith("store.") for k in state):
        raise ValueError(
            "a FIITED store lays its rank's tables out together (pruned chunks, slots): "
            "it cannot move between ranks"
        )
    dense = [t for t in tables if t not in tt_tables]
    tts = [t for t in tables if t in tt_tables]
    rows = [table_sizes[t] for t in dense]
    weight, opt = state["weight"], state["optimizer_state"]
    if weight.shape[0] != sum(rows):
        raise ValueError(f"{weight.shape[0]} rows saved for tables {dense} of {sum(rows)} rows")
    per_row = opt.numel() > 0  # Adagrad: per element or per row; SGD: none
    if per_row and opt.shape[0] != weight.shape[0]:
        raise ValueError(f"the row optimizer's state has {opt.shape[0]} rows, not {sum(rows)}")
    opts = state[_TT_OPTS] if tts else []
    if len(opts) % max(1, len(tts)):
        raise ValueError(f"{len(opts)} TT optimizers saved for {len(tts)} TT tables")
    pieces: dict[int, Piece] = {}
    for t, w, s in zip(
        dense, weight.split(rows), opt.split(rows) if per_row else [opt] * len(rows), strict=True
    ):
        pieces[t] = {"weight": w, "optimizer_state": s}
    each = len(opts) // max(1, len(tts))
    for i, t in enumerate(tts):
        pre = _tt_prefix(i)
        module = {k[len(pre) :]: v for k, v in state.items() if k.startswith(pre)}
        pieces[t] = {"tt": module, "tt_opts": list(opts[i * each : (i + 1) * each])}
    return pieces


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
    if dense:
        out["weight"] = torch.cat([pieces[t]["weight"] for t in dense])
        if template["optimizer_state"].numel():
            out["optimizer_state"] = torch.cat([pieces[t]["optimizer_state"] for t in dense])
    for i, t in enumerate(tts):
        out.update({_tt_prefix(i) + k: v for k, v in copy.deepcopy(pieces[t]["tt"]).items()})
    if tts:
        out[_TT_OPTS] = copy.deepcopy([o for t in tts for o in pieces[t]["tt_opts"]])
    return out
