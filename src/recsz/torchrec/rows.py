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
holds its batch's ids before TorchRec's input dist, the table owner after it. Bags of one
id (one-hot features, the usual case) are merged by id, empty bags all together; a bag
of several ids stays a row of its own.
"""

from __future__ import annotations

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


def bag_keys(kjt: Any, rows: int, features: int) -> torch.Tensor | None:
    """(features, rows) int64 keys of a KeyedJaggedTensor's bags, equal for two bags of a
    feature exactly when they are merged: a one-id bag's id, -1 for an empty bag, and for
    a bag of several ids one of its own (-2 - its row: the same order at both ends). None
    where bags cannot be merged: weighted bags (a pooled row then depends on the weights)
    or a layout other than ``features`` x ``rows``."""
    if kjt is None or kjt.weights_or_none() is not None:
        return None
    lengths = kjt.lengths()
    if len(kjt.keys()) != features or lengths.numel() != rows * features:
        return None
    lengths = lengths.view(features, rows)
    values = kjt.values()
    at = kjt.offsets()[:-1].view(features, rows).long()
    first = values[at.clamp(max=values.numel() - 1)].long() if values.numel() else at
    own = -2 - torch.arange(rows, device=lengths.device).expand(features, rows)
    return torch.where(lengths == 1, first, torch.where(lengths == 0, -1, own))


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
