"""TorchRec's sequence-embedding all-to-all (an ``EmbeddingCollection``'s) through our codecs.

A sequence feature keeps one embedding per id (no pooling): the table owner looks up every
id of the global batch and sends each sample owner the rows of its samples' ids; the
gradients of those rows come back. TorchRec's ``SequenceEmbeddingsAllToAll`` does it with
``all_to_all_single`` split by the ids each rank sent (table-wise and column-wise tables:
``TwSequenceEmbeddingDist``; row-wise ones, each id to its shard's rank, the receiver
putting the rows back in its ids' order: ``RwSequenceEmbeddingDist``).

:class:`CompressedSequenceEmbeddingDist` sends the same rows through our codecs, under a
bound a feature and step from the rows of it that the rank sends (as the pooled dist's,
:mod:`recsz.torchrec.dist`, whose exchange it is). Layout: the lookup's rows are feature
after feature, each feature's ids by source rank (``lengths_after_input_dist``: a row of
lengths a feature, the sources' samples side by side); each destination's block goes
feature after feature (:class:`Segments`), its features' row counts framed ahead of its
payload, and the receiver's block is what TorchRec's all-to-all gives. The rows repeat
where ids repeat (a user's history): the codecs' whole-row deduplication sends each once.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import torch
from torchrec.distributed.types import Awaitable

from recsz.codecs.payload import upload
from recsz.comm.direction import Direction
from recsz.comm.exchange import PendingBytes
from recsz.config import TrainConfig
from recsz.policy.base import MIN_ABS_BOUND, padded_tables
from recsz.torchrec.dist import CompressedPooledEmbeddingDist, Context
from recsz.torchrec.handover import Received, theirs
from recsz.torchrec.rows import Group


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)]


class Segments(NamedTuple):
    """A block's rows feature after feature: how many each feature has (on the host)."""

    counts: list[int]

    def taken(self, x: torch.Tensor, fs: list[int], cols: list[int], width: int) -> Group:
        """Features ``fs``' rows of x, one after another (``cols``: unused, the features
        are one above another)."""
        at, sizes = _offsets(self.counts), [self.counts[f] for f in fs]
        if _consecutive(fs):  # (every feature of a block, the usual case): a view
            return x[at[fs[0]] : at[fs[-1] + 1]], sizes
        rows = [x[at[f] : at[f + 1]] for f in fs]
        return torch.cat(rows) if rows else x.new_empty(0, width), sizes

    def place(
        self, out: torch.Tensor, y: torch.Tensor, fs: list[int], cols: list[int], width: int
    ) -> None:
        """Write :meth:`taken`'s rows ``y`` back into their places in ``out``."""
        at, k = _offsets(self.counts), 0
        if _consecutive(fs):
            out[at[fs[0]] : at[fs[-1] + 1]] = y
            return
        for f in fs:
            n = self.counts[f]
            out[at[f] : at[f] + n] = y[k : k + n]
            k += n


def _consecutive(fs: list[int]) -> bool:
    return bool(fs) and fs == list(range(fs[0], fs[-1] + 1))


def _joined(xs: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """``xs`` one above another (one of them: itself, not a copy)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs) if xs else empty


def counts_part(counts: list[int], device: torch.device) -> torch.Tensor:
    """A block's features' row counts as bytes (int64, little-endian), framed ahead."""
    return upload(bytearray(torch.tensor(counts, dtype=torch.int64).numpy()), torch.uint8, device)


def read_counts(parts: list[torch.Tensor], features: list[int], rows: list[int]) -> list[Segments]:
    """:func:`counts_part`'s bytes of each source s back (``features[s]`` counts, which add
    up to ``rows[s]``, the rows it sent), in one host read (none where they are on the
    host: read with the tables of lengths); a ValueError naming the source where they do
    not add up."""
    raw = torch.cat([p.reshape(-1) for p in parts]).cpu().numpy() if parts else b""
    got, at = [], 0
    for s, (f, n, p) in enumerate(zip(features, rows, parts, strict=True)):
        if p.numel() != 8 * f:
            raise ValueError(f"rank {s}: {p.numel()} bytes of row counts, expected {8 * f}")
        counts = np.frombuffer(bytes(raw[at : at + 8 * f]), "<i8").tolist()
        at += 8 * f
        if min(counts, default=0) < 0 or sum(counts) != n:
            raise ValueError(f"rank {s}: row counts {counts} do not add up to its {n} rows")
        got.append(Segments(counts))
    return got


class CompressedSequenceEmbeddingDist(CompressedPooledEmbeddingDist):
    """Drop-in for TorchRec's ``TwSequenceEmbeddingDist`` / ``RwSequenceEmbeddingDist``:
    ``forward(local_embs, ctx)`` gives an awaitable of this rank's ids' rows, in the order
    TorchRec's all-to-all gives them, compressed both ways.

    Args:
        inner: the dist TorchRec built for this sharding (a batch that varies per feature,
            or that the switch sends plain, goes through it).
        config: codecs and bound policies.
        features: each rank's features (table shards) in this sharding.
        row_wise: the sharding is row-wise (every rank holds a shard of every feature).
    """

    def __init__(
        self, inner: Any, config: TrainConfig, features: list[int], row_wise: bool
    ) -> None:
        self.features, self.row_wise = list(features), row_wise
        super().__init__(inner, config)
        #: the rows' width (every feature of an EmbeddingCollection has one), from the
        #: first forward
        self.width = 0

    @staticmethod
    def _group(inner: Any) -> Any:
        return inner._dist._pg  # TorchRec's SequenceEmbeddingsAllToAll's

    def _layout(self, inner: Any) -> tuple[list[tuple[int, ...]], list[list[int]]]:
        """Each rank's features (0 wide until the first forward sets the width); their keys
        counted on (row-wise: every rank's features are the same ones)."""
        dims = [(0,) * f for f in self.features]
        if self.row_wise:
            return dims, [list(range(f)) for f in self.features]
        starts = _offsets(self.features)
        return dims, [list(range(starts[r], starts[r + 1])) for r in range(len(self.features))]

    def _framed_ahead(self) -> list[int]:
        return [8 * f for f in self.features]  # the forward's row counts (counts_part)

    def _columns(self, dims: tuple[int, ...]) -> int:
        return self.width  # the features one above another

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Any = None) -> Awaitable:
        if sharding_ctx is None or self.world == 1:
            return self.inner(local_embs, sharding_ctx)
        if (stock := theirs(self, local_embs, sharding_ctx)) is not None:
            return stock
        if local_embs.shape[1] != self.width:
            self.width = local_embs.shape[1]
            self.dims = [(self.width,) * f for f in self.features]
        train = local_embs.requires_grad and torch.is_grad_enabled()
        self._fwd_checks.read()  # a forward's whose backward never ran
        step = self.step
        self.step += int(train)
        mine, dims = self.keys[self.rank], self.dims[self.rank]
        counts = self._counts(sharding_ctx, local_embs)  # [feature][destination]
        sums = [sum(c) for c in counts]
        by_feature = torch.split(local_embs, sums)
        spans = [[(a, n)] for a, n in zip(_offsets(sums)[:-1], sums, strict=True)]
        ebs = self._feature_bounds(self.fwd, step, local_embs, spans, mine, train)
        # each destination's rows, feature after feature, in one copy (autograd maps the
        # gradient back); each destination's block a view of it
        parts = [x.split(c) for x, c in zip(by_feature, counts, strict=True)]
        picks = [Segments([c[r] for c in counts]) for r in range(self.world)]
        order = [p[r] for r in range(self.world) for p in parts]
        source = _joined(order, local_embs[:0])
        blocks = [(b, dims, mine) for b in source.split([sum(p.counts) for p in picks])]
        ahead = [[counts_part(p.counts, local_embs.device)] for p in picks]
        data = [(b.detach(), d, k) for b, d, k in blocks]
        pending = self._send(self.fwd, step, data, ebs, train, picks, ahead)
        rows = [int(n) for n in sharding_ctx.input_splits]  # what I sent each, it sends back
        ctx: Context = {"mine": picks, "rows": rows, "sent": [p.shape[0] for p, *_ in blocks]}
        unbucketize = sharding_ctx.unbucketize_permute_tensor if self.row_wise else None
        awaitable = Received(source, self, pending, step, rows, ctx, defer=True)
        if unbucketize is not None:  # row-wise: back in my ids' order
            awaitable.callbacks.append(lambda got: got.index_select(0, unbucketize))
        return awaitable

    def _counts(self, ctx: Any, local_embs: torch.Tensor) -> list[list[int]]:
        """Rows of each (my feature, destination): the lengths of the ids each source sent
        me, a feature a row, summed over its samples (one host read)."""
        lengths = ctx.lengths_after_input_dist
        n_f = len(self.dims[self.rank])
        if lengths is None or n_f == 0:
            got = [[0] * self.world for _ in range(n_f)]
        else:
            view = lengths.reshape(n_f, -1)
            per_rank = list(ctx.batch_size_per_rank or [view.shape[1] // self.world] * self.world)
            at = _offsets(per_rank)
            sums = [view[:, at[r] : at[r + 1]].sum(1) for r in range(self.world)]
            got = torch.stack(sums, 1).tolist()
        if sum(map(sum, got)) != local_embs.shape[0]:
            raise ValueError(
                f"{self.who}: the lookup gave {local_embs.shape[0]} rows for "
                f"{sum(map(sum, got))} ids ({n_f} features x {self.world} ranks)"
            )
        return got

    def _feature_bounds(
        self,
        d: Direction,
        step: int,
        x: torch.Tensor,
        spans: list[list[tuple[int, int]]],
        keys: list[int],
        train: bool,
    ) -> torch.Tensor | None:
        """Each feature's bound from its rows sent (``spans[j]``: the (first row, rows)
        runs of x holding all of feature ``keys[j]``, every destination's), by key; None
        for a codec that takes none. Features of about one length go through the policy
        together (:func:`padded_tables`): a few calls a step, not one a feature. A feature
        without rows this step (no ids in any bag) sends empty chunks under the smallest
        bound."""
        if not keys:
            return None
        ebs = torch.full((self.n_keys,), MIN_ABS_BOUND, dtype=torch.float64, device=x.device)
        for at, padded in padded_tables(x.detach(), spans):
            ks = [keys[j] for j in at]  # (which, changes with the lengths: uploaded)
            got = d.bounds(step, ks, padded, observe=train)
            if got is None:
                return None
            ebs[upload(ks, torch.int64, x.device)] = got.to(x.device)
        return ebs

    def finish_forward(
        self, pending: PendingBytes, per_rank: list[int], hold: bool, ctx: Context
    ) -> torch.Tensor:
        """Every source's rows of my ids, source after source; each one's row counts are
        kept (``theirs``) for the backward."""

        def theirs(ahead: list[torch.Tensor]) -> list[Segments]:
            try:
                ctx["theirs"] = read_counts(ahead, self.features, ctx["rows"])
            except ValueError as e:
                raise ValueError(f"{self.who}: fwd payloads: {e}") from e
            return ctx["theirs"]

        return torch.cat(self._receive(self.fwd, pending, ctx["rows"], self.dims, hold, theirs))

    def start_backward(self, grad: torch.Tensor, step: int, ctx: Context) -> PendingBytes:
        """My ids' rows' gradient, source after source: each source's back to it."""
        grad = self._divided(grad)
        blocks_of = torch.split(grad, ctx["rows"])
        theirs: list[Segments] = ctx["theirs"]
        spans: dict[int, list[tuple[int, int]]] = {}  # each key's rows, every source's
        for s, (start, seg) in enumerate(zip(_offsets(ctx["rows"])[:-1], theirs, strict=True)):
            at = _offsets(seg.counts)[:-1]
            for key, a, n in zip(self.keys[s], at, seg.counts, strict=True):
                spans.setdefault(key, []).append((start + a, n))
        keys = sorted(spans)
        ebs = self._feature_bounds(self.bwd, step, grad, [spans[k] for k in keys], keys, True)
        blocks = [(b, self.dims[s], self.keys[s]) for s, b in enumerate(blocks_of)]
        return self._send(self.bwd, step, blocks, ebs, True, theirs)

    def finish_backward(
        self, pending: PendingBytes, per_rank: list[int], ctx: Context
    ) -> torch.Tensor:
        """What :meth:`start_backward` sent -> the gradient of the rows I sent, by destination."""
        dims = [self.dims[self.rank]] * self.world
        return torch.cat(self._receive(self.bwd, pending, ctx["sent"], dims, picks=ctx["mine"]))
