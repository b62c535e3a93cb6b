"""Which rows of a block travel, and how the receiver puts them back.

A block holds a slice of the batch's bags (rows) for some features (columns side by side).
A selection gives, per feature, the rows that go on the wire (:meth:`taken`), how many
(``counts``, on the host: the codec's sizes) and how the receiver writes them into its
block (:meth:`place`). Two kinds:

- :class:`Pick`: some of the rows travel, the others are zero (row-wise tables: the bags a
  rank filled; a table owner's end of merged bags: each content's first bag).
- :class:`Merge`: the bags of one content travel as one row. The pooled row of a bag is a
  function of its ids, so the forward sends a content's row once and the receiver copies
  it to each of its bags; a table's update reads only the sum of the gradients of a
  content's bags, so the backward sends that sum once and the table owner puts it on the
  content's first bag (:class:`Pick`), zero on the others: the same update.

A content is known to both ends without a byte sent (:func:`bag_keys`): the sample owner
holds its batch's ids before TorchRec's input dist, the table owner after it. A content is
a bag's ids in order: one-hot features merge by id, empty bags all together, and bags of
several ids wherever they repeat (MLPerf's multi-hot bags, a function of the one-hot id).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch

#: A group's rows (table after table) and each table's row count.
Group = tuple[torch.Tensor, list[int]]


class Pick(NamedTuple):
    """The rows of a block that carry each of its features (the others are zero and travel
    as nothing): per feature, the rows in order with the carried ones first, and how many."""

    order: torch.Tensor  # (rows, features)
    counts: list[int]  # (features,), on the host

    @staticmethod
    def of(masks: list[torch.Tensor], also: torch.Tensor | None = None) -> tuple[list[Pick], list]:
        """Picks of boolean masks (rows, features), their counts read in one host read,
        with ``also`` (integers) along."""
        order = [torch.argsort((~m).to(torch.uint8), dim=0, stable=True) for m in masks]
        if not masks:
            return [], []
        counts = torch.stack([m.sum(0) for m in masks])
        extra = torch.empty(0, dtype=torch.int64, device=counts.device) if also is None else also
        read = torch.cat([counts.reshape(-1), extra.reshape(-1).to(counts.device)]).tolist()
        n = counts.shape[1]
        picks = [Pick(o, read[i * n : (i + 1) * n]) for i, o in enumerate(order)]
        return picks, read[counts.numel() :]

    def taken(self, x: torch.Tensor, fs: list[int], cols: list[int], width: int) -> Group:
        """The carried rows of features ``fs`` (columns ``cols`` of x), one after another."""
        n = [self.counts[f] for f in fs]
        rows = [x[self.order[:k, f], c : c + width] for f, c, k in zip(fs, cols, n, strict=True)]
        return torch.cat(rows) if rows else x.new_empty(0, width), n

    def place(
        self, out: torch.Tensor, y: torch.Tensor, fs: list[int], cols: list[int], width: int
    ) -> None:
        """Write :meth:`taken`'s rows ``y`` back into their places in ``out`` (zero)."""
        at = 0
        for f, c in zip(fs, cols, strict=True):
            k = self.counts[f]
            out[self.order[:k, f], c : c + width] = y[at : at + k]
            at += k


class Merge(NamedTuple):
    """Each row's content among a feature's contents (numbered as :func:`merged` orders
    them), and how many contents each feature has."""

    inverse: torch.Tensor  # (rows, features)
    counts: list[int]  # (features,), on the host

    def taken(self, x: torch.Tensor, fs: list[int], cols: list[int], width: int) -> Group:
        """Per content, the sum of its rows of ``x`` (the gradients of its bags)."""
        n = [self.counts[f] for f in fs]
        sums = [
            x.new_zeros(k, width).index_add_(0, self.inverse[:, f], x[:, c : c + width])
            for f, c, k in zip(fs, cols, n, strict=True)
        ]
        return torch.cat(sums) if sums else x.new_empty(0, width), n

    def place(
        self, out: torch.Tensor, y: torch.Tensor, fs: list[int], cols: list[int], width: int
    ) -> None:
        """Each content's row of ``y`` copied to every row of that content."""
        at = 0
        for f, c in zip(fs, cols, strict=True):
            out[:, c : c + width] = y[at + self.inverse[:, f]]
            at += self.counts[f]


#: A selection of rows, either kind.
Rows = Pick | Merge


_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # a 32-bit integer hash's multiplier: products stay below 2^59 in int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def bag_keys(kjt: Any, at: list[int], features: int) -> list[torch.Tensor] | None:
    """Keys of a KeyedJaggedTensor's bags (``features`` x ``at[-1]``), per slice of the
    batch (columns ``at[i]:at[i + 1]``, (features, rows) each), equal for two bags of a
    feature and slice exactly when they hold the same ids in the same order (their pooled
    rows are then equal, bit for bit). A hash of the ids, checked: where two bags of one key
    differ, the later gets a key of its own (-1 - its row in the slice), so the keys are the
    same at both ends, which see the same bags. None where bags cannot be merged: weighted
    bags (a pooled row then depends on the weights) or a layout other than the one given."""
    if kjt is None or kjt.weights_or_none() is not None:
        return None
    rows, lengths = at[-1], kjt.lengths().long()
    if len(kjt.keys()) != features or lengths.numel() != rows * features:
        return None
    values, device = kjt.values().long(), lengths.device
    offsets = kjt.offsets()[:-1].long()
    bag = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=values.numel()
    )
    pos = torch.arange(values.numel(), device=device) - offsets[bag]
    # one mix an id (its position in the bag in it: order counts); a weak hash only
    # merges fewer bags, the check below keeps different ones apart
    hashed = _mix((values ^ (values >> 32) ^ (pos * 0x9E3779B1)) & _M32)
    whole = torch.zeros_like(lengths).index_add_(0, bag, hashed)
    key = ((whole & (2**52 - 1)) << 10 | (lengths & 1023)).view(features, rows)
    # Each bag against its key's first bag in its slice: length, then id by id.
    ref = torch.empty_like(key)
    for a, b in itertools.pairwise(at):
        k, idx = torch.sort(key[:, a:b], dim=1, stable=True)
        start = torch.ones_like(k, dtype=torch.bool)
        start[:, 1:] = k[:, 1:] != k[:, :-1]
        where = torch.arange(b - a, device=device).expand_as(k)
        first = torch.cummax(torch.where(start, where, 0), dim=1).values
        ref[:, a:b].scatter_(1, idx, torch.gather(idx, 1, first) + a)
    ref = (ref + torch.arange(features, device=device).unsqueeze(1) * rows).view(-1)
    bad = lengths != lengths[ref]
    if values.numel():
        theirs = (offsets[ref[bag]] + pos).clamp(max=values.numel() - 1)
        differ = (values[theirs] != values).long()
        bad |= torch.zeros_like(lengths).index_add_(0, bag, differ) > 0
    slices = itertools.pairwise(at)
    own = -1 - torch.cat([torch.arange(b - a, device=device) for a, b in slices])
    key = torch.where(bad.view(features, rows), own, key)
    return [key[:, a:b] for a, b in itertools.pairwise(at)]


def _runs(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contents of (features, rows) keys, numbered by key: (rows, features) each content's
    first row (carried first, as :class:`Pick` wants), (rows, features) each row's
    content, and (features,) how many contents."""
    key, idx = torch.sort(keys, dim=1, stable=True)
    start = torch.ones_like(key, dtype=torch.bool)
    start[:, 1:] = key[:, 1:] != key[:, :-1]
    run = start.cumsum(1) - 1
    inverse = torch.empty_like(run).scatter_(1, idx, run)
    firsts = torch.gather(idx, 1, torch.argsort((~start).to(torch.uint8), dim=1, stable=True))
    return firsts.t(), inverse.t(), start.sum(1)


def merged(owned: list[torch.Tensor], local: list[torch.Tensor]) -> tuple[list[Pick], list[Merge]]:
    """The table owner's picks of each destination's bags (``owned[r]``: the keys of rank
    r's slice of the batch for my features) and the sample owner's merges of each source's
    features (``local[s]``: my bags' keys for rank s's features); their counts in one host
    read."""
    a = [_runs(k) for k in owned]
    b = [_runs(k) for k in local]
    counts = [c for *_, c in a + b]
    if not counts:
        return [], []
    read = torch.cat(counts).tolist()
    at = [0]
    for c in counts:
        at.append(at[-1] + c.numel())
    picks = [Pick(f, read[at[i] : at[i + 1]]) for i, (f, _, _) in enumerate(a)]
    merges = [Merge(v, read[at[len(a) + i] : at[len(a) + i + 1]]) for i, (_, v, _) in enumerate(b)]
    return picks, merges
