"""Which rows of a block travel, and how the receiver puts them back.

A block holds a slice of the batch's bags (rows) for some features (columns side by side).
A selection gives, per feature, the rows that go on the wire (:meth:`taken`), how many
(``counts``, on the host: the codec's sizes) and how the receiver writes them into its
block (:meth:`place`). Two kinds:

- :class:`Pick`: some of the rows travel, the others are zero (row-wise tables: the bags a
  rank filled; table-wise ones: the first bag of each content).
- :class:`Merge`: the bags of one content travel as one row. The pooled row of a bag is a
  function of its ids, so the forward sends a content's row once and the receiver copies
  it to each of its bags; a table's update reads only the sum of the gradients of a
  content's bags, so the backward sends that sum once and the table owner puts it on the
  content's first bag (:class:`Pick`), zero on the others: the same update.

A content is a bag's ids in order (:func:`first_bags`): one-hot features merge by id, bags
of several ids wherever they repeat (MLPerf's multi-hot bags, a function of the one-hot
id); an empty bag carries nothing. The sample owner finds the contents of its batch and
empties every bag but the first of each before TorchRec's input dist (the sharder), so the
ids of a repeat never travel and the table owner's filled bags are the first ones
(:func:`merged`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from recsz.model.multihot import mix32

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
    """Each row's content among a feature's contents (numbered in the order of their first
    rows; -1: an empty bag, which carries nothing), and how many contents each feature has."""

    inverse: torch.Tensor  # (rows, features)
    counts: list[int]  # (features,), on the host

    def _index(self, f: int) -> torch.Tensor:
        """Feature f's contents, an empty bag's pointing one past the last."""
        inv = self.inverse[:, f]
        return torch.where(inv < 0, self.counts[f], inv)

    def taken(self, x: torch.Tensor, fs: list[int], cols: list[int], width: int) -> Group:
        """Per content, the sum of its rows of ``x`` (the gradients of its bags)."""
        n = [self.counts[f] for f in fs]
        sums = [
            x.new_zeros(k + 1, width).index_add_(0, self._index(f), x[:, c : c + width])[:k]
            for f, c, k in zip(fs, cols, n, strict=True)
        ]
        return torch.cat(sums) if sums else x.new_empty(0, width), n

    def place(
        self, out: torch.Tensor, y: torch.Tensor, fs: list[int], cols: list[int], width: int
    ) -> None:
        """Each content's row of ``y`` copied to every row of that content (zero: empty)."""
        at, zero = 0, y.new_zeros(1, width)
        for f, c in zip(fs, cols, strict=True):
            k = self.counts[f]
            out[:, c : c + width] = torch.cat([y[at : at + k], zero])[self._index(f)]
            at += k


class Rows(Protocol):
    """A selection of rows: :class:`Pick`, :class:`Merge`, or a sequence dist's segments
    (:class:`recsz.torchrec.sequence.Segments`)."""

    @property
    def counts(self) -> list[int]: ...

    def taken(self, x: torch.Tensor, fs: list[int], cols: list[int], width: int) -> Group: ...

    def place(
        self, out: torch.Tensor, y: torch.Tensor, fs: list[int], cols: list[int], width: int
    ) -> None: ...


_M32 = 0xFFFFFFFF


def first_bags(
    lengths: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bags (features, rows) of ``lengths`` ids from ``values`` at ``offsets`` (as a
    KeyedJaggedTensor lays them out): whether each is the first nonempty bag of its content
    (the same ids in the same order: their pooled rows are equal, bit for bit), each bag's
    content among its feature's, numbered in the order of those first bags (-1: empty), and
    the row of each bag's content's first bag (an empty bag's: its own; row-wise tables
    gather their summed rows from it forward and add the gradients into it backward). A
    hash of the ids sorts the bags, and each is checked id by id against the first of its
    hash: where they differ it counts as a content of its own."""
    features, rows = lengths.shape
    lengths, offsets, values = lengths.reshape(-1).long(), offsets.reshape(-1).long(), values.long()
    device = lengths.device
    bag = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=values.numel()
    )
    pos = torch.arange(values.numel(), device=device) - offsets[bag]
    # one mix an id (its position in the bag in it: order counts); a weak hash only
    # merges fewer bags, the check below keeps different ones apart
    hashed = mix32((values ^ (values >> 32) ^ (pos * 0x9E3779B1)) & _M32)
    whole = torch.zeros_like(lengths).index_add_(0, bag, hashed)
    key = ((whole & (2**52 - 1)) << 10 | (lengths & 1023)).view(features, rows)
    # Each bag's reference: the first bag of its key.
    k, idx = torch.sort(key, dim=1, stable=True)
    start = torch.ones_like(k, dtype=torch.bool)
    start[:, 1:] = k[:, 1:] != k[:, :-1]
    at = torch.arange(rows, device=device).expand_as(k)
    run_first = torch.gather(idx, 1, torch.cummax(torch.where(start, at, 0), dim=1).values)
    ref = torch.empty_like(key).scatter_(1, idx, run_first)
    flat_ref = (ref + torch.arange(features, device=device).unsqueeze(1) * rows).view(-1)
    bad = lengths != lengths[flat_ref]
    if values.numel():
        theirs = (offsets[flat_ref[bag]] + pos).clamp(max=values.numel() - 1)
        differ = (values[theirs] != values).long()
        bad |= torch.zeros_like(lengths).index_add_(0, bag, differ) > 0
    ref = torch.where(bad.view(features, rows), at, ref)
    filled = lengths.view(features, rows) > 0
    first = (ref == at) & filled
    number = first.long().cumsum(1) - 1
    inverse = torch.where(filled, torch.gather(number, 1, ref), -1)
    return first, inverse, torch.where(filled, ref, at)


#: Per sharding that merges: (each bag's content (rows, features), contents a feature
#: (features,), each bag's content's first bag (rows, features)).
Merges = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def merged(
    shardings: list[Any], layouts: dict[tuple[str, ...], Any], features: Any
) -> tuple[Merges, Any]:
    """A batch's merges for each of ``shardings`` whose dist takes merged bags (its
    ``recsz_merged``), and ``features`` with the repeating bags of their tables emptied;
    nothing for weighted bags (a pooled row then depends on the weights) or a variable
    batch. ``layouts``: the caller's cache of :func:`merge_layout` by feature order."""
    from torchrec import KeyedJaggedTensor

    if (
        not isinstance(features, KeyedJaggedTensor)
        or features.weights_or_none() is not None
        or features.variable_stride_per_key()
    ):
        return {}, features
    keys, rows, lengths = tuple(features.keys()), features.stride(), features.lengths()
    if keys not in layouts:
        layouts[keys] = merge_layout(shardings, keys, lengths.device)
    layout = layouts[keys]
    if layout is None:
        return {}, features
    lengths = lengths.view(len(keys), rows)
    values = features.values()
    # every feature's bags, the kept ones' too: their ids' count is known on the host
    first, inverse, source = first_bags(lengths, features.offsets()[:-1], values)
    keep = first | layout["kept"].unsqueeze(1)
    each = torch.repeat_interleave(keep.view(-1), lengths.view(-1), output_size=values.numel())
    stripped = KeyedJaggedTensor(
        keys=list(keys), values=values[each], lengths=(lengths * keep).view(-1), stride=rows
    )
    counts = first.sum(1)
    merges = {i: (inverse[at].t(), counts[at], source[at].t()) for i, at in layout["rows"].items()}
    return merges, stripped


def merge_layout(
    shardings: list[Any], keys: tuple[str, ...], device: torch.device
) -> dict[str, Any] | None:
    """For a feature order: which features keep every bag (the other shardings':
    data-parallel), and each merging sharding's features' positions (on the device); None
    where none merges, or a feature also feeds a table of another sharding (it needs every
    bag)."""
    where = {k: i for i, k in enumerate(keys)}
    names = [s.feature_names() for s in shardings]
    rows = {
        i: [where[n] for n in names[i]]
        for i, s in enumerate(shardings)
        if getattr(s, "recsz_merged", False)
    }
    taken = {r for rs in rows.values() for r in rs}
    others = {where[n] for i, ns in enumerate(names) if i not in rows for n in ns}
    if not rows or taken & others:
        return None
    kept = [i not in taken for i in range(len(keys))]
    return {
        "kept": torch.tensor(kept, device=device),
        "rows": {i: torch.tensor(r, dtype=torch.long, device=device) for i, r in rows.items()},
    }
