"""TT-Rec's cache of hot rows: a tensor-train table's most looked-up rows kept dense.

A TT row is a product of small cores shared by many rows, so it cannot follow its own
gradient as a dense row does; in click logs a few ids carry most lookups, and TT-Rec keeps
those rows uncompressed and trainable. Here each TT table may hold up to ``capacity`` such
rows: every ``interval`` training lookups the ids seen most often since the last fill
(occurrences counted per lookup, ties to the smaller id) become the cache; a row that stays
keeps its values and optimizer state, a row that enters starts from its TT value, a row
that leaves goes back to its TT value. Cached rows are updated by the table's row
optimizer in the backward (only the rows the batch read, as the dense tables are); the
cores learn from the other rows' lookups only. Capacity is fixed (unused slots hold an id
no table has), so checkpoints keep one shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from recsz.devicepath import device_path
from recsz.model.rowopt import RowOptimizer

_EMPTY = torch.iinfo(torch.int64).max  # the id of an unused slot (sorts last)


class HotRows(nn.Module):
    """Dense rows for a TT table's hot ids.

    Args:
        capacity: rows kept.
        dim: their width.
        interval: training lookups between fills.
        optimizer: the row optimizer of the cached rows (None: frozen).
    """

    ids: torch.Tensor  # (capacity,) sorted; _EMPTY where unused
    state: torch.Tensor  # the row optimizer's accumulator
    tally: torch.Tensor  # lookups served, and all training lookups (kept where the rows are)

    def __init__(
        self, capacity: int, dim: int, interval: int, optimizer: RowOptimizer | None
    ) -> None:
        super().__init__()
        self.interval, self.optimizer = interval, optimizer
        self.register_buffer("ids", torch.full((capacity,), _EMPTY, dtype=torch.int64))
        self.weight = nn.Parameter(torch.zeros(capacity, dim), requires_grad=optimizer is not None)
        state = optimizer.new_state(self.weight.data) if optimizer else torch.zeros(0)
        self.register_buffer("state", state)
        self.register_buffer("tally", torch.zeros(2, dtype=torch.int64))
        self.calls = 0
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, counts) since a fill

    @property
    def hits(self) -> int:
        return int(self.tally[0])

    @property
    def lookups(self) -> int:
        return int(self.tally[1])

    @property
    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.weight, self.state))

    def rows(
        self, uniq: torch.Tensor, counts: torch.Tensor, tt_rows: Callable[[torch.Tensor], Any]
    ) -> torch.Tensor:
        """The rows of the ids ``uniq`` (looked up ``counts`` times each; on a GPU's path
        every id of the batch, repeats among them, a count of one each): cached ones from
        the cache, the rest from ``tt_rows``."""
        train = self.optimizer is not None and torch.is_grad_enabled()
        if train:
            if self.calls and self.calls % self.interval == 0:
                self._fill(tt_rows)
            self.calls += 1
            self._seen.append((uniq, counts))
        slot = torch.searchsorted(self.ids, uniq).clamp_(max=len(self.ids) - 1)
        hit = self.ids[slot] == uniq
        if train:  # counted on the rows' device (read when reported)
            self.tally += torch.stack([(counts * hit).sum(), counts.sum()])
        if device_path(uniq.device):  # no host read to split them: every id's TT row
            # (a miss's slot, some other row's, takes a zero gradient through the where)
            cached = _Cached.apply(self.weight, slot, self, False) if train else self.weight[slot]
            return torch.where(hit.unsqueeze(1), cached, tt_rows(uniq))
        at_hit, at_miss = hit.nonzero().view(-1), (~hit).nonzero().view(-1)
        slots = slot[at_hit]
        cached = _Cached.apply(self.weight, slots, self) if train else self.weight[slots]
        values = torch.cat([cached, tt_rows(uniq[at_miss])])
        out = values.new_empty(len(uniq), values.shape[1])
        return out.index_copy(0, torch.cat([at_hit, at_miss]), values)

    @torch.no_grad()
    def _fill(self, tt_rows: Callable[[torch.Tensor], Any]) -> None:
        """The window's most looked-up ids become the cache, in tensors of fixed shapes (no
        host read: a GPU's path fills without waiting, and a step may be replayed)."""
        cap = len(self.ids)
        ids = torch.cat([i for i, _ in self._seen] + [self.ids.new_full((cap,), _EMPTY)])
        counts = torch.cat([c for _, c in self._seen] + [self.ids.new_zeros(cap)])
        self._seen.clear()  # (padded with cap lookups of no id, counted zero times)
        ids, order = torch.sort(ids)
        head = torch.ones_like(ids, dtype=torch.bool)
        head[1:] = ids[1:] != ids[:-1]
        run = torch.cumsum(head, 0) - 1  # each lookup's distinct id, by rank among them
        total = torch.zeros_like(counts).index_add_(0, run, counts[order])
        first = torch.full_like(ids, _EMPTY).scatter_(0, run, ids)  # the runs' ids, ascending
        top = torch.sort(total, descending=True, stable=True).indices[:cap]  # ties: smaller id
        new = torch.where(total[top] > 0, first[top], _EMPTY).sort().values
        slot = torch.searchsorted(self.ids, new).clamp_(max=cap - 1)
        used = new != _EMPTY
        stay = (self.ids[slot] == new) & used
        enter = (used & ~stay).unsqueeze(1)
        tt = tt_rows(torch.where(enter[:, 0], new, 0)).detach().to(self.weight.dtype)
        kept = torch.where(stay.unsqueeze(1), self.weight.data[slot], 0)
        weight = torch.where(enter, tt, kept)
        if self.state.numel():
            shape = (cap, *[1] * (self.state.dim() - 1))
            self.state = torch.where(stay.view(shape), self.state[slot], 0)
        self.ids, self.weight.data = new, weight

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "seen": self._seen}

    def set_extra_state(self, state: Any) -> None:
        self.calls, self._seen = state["calls"], list(state["seen"])


class _Cached(torch.autograd.Function):
    """Cached rows forward; backward steps the row optimizer on them (no weight gradient).
    ``distinct``: no slot repeats (else their gradients are summed by row first)."""

    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, slots: torch.Tensor, cache: HotRows, distinct: bool = True
    ) -> torch.Tensor:
        ctx.slots, ctx.cache, ctx.distinct = slots, cache, distinct
        return weight.detach().index_select(0, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        c = ctx.cache
        c.optimizer.step(
            c.weight.data, c.state, ctx.slots, grad.contiguous(), distinct=ctx.distinct
        )
        return None, None, None, None
