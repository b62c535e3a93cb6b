"""The embedding all-to-all of hybrid-parallel DLRM, compressed in both directions.

Forward: the owner of tables T_r looked them up for the whole global batch,
pooled (B, |T_r|, D). Sample owner s needs rows [s*b, (s+1)*b) of every table. Backward:
sample owner s holds d(loss)/d(emb) (b, T, D) and sends each table's rows back to its
owner, which places them into (B, |T_r|, D).

Both directions go through one path (:meth:`EmbeddingExchange._send` and ``_receive``):
a list of (destination, table, rows) chunks, each encoded on its own under its table's
bound for the step (so every table keeps its own bound and codebook), framed into one
buffer per destination, moved by :mod:`recsz.comm.exchange`, decoded, shape-checked. Each
direction only chooses its rows and places what it receives.

Id-aware traffic: every rank reads the global batch, so both ends know every sample's
ids. Forward, ``id_dedup`` sends one row per distinct id of a destination's slice (sorted
id order), which the receiver expands with its own copy of the ids (exact for single-id
bags). Backward, ``coalesce`` sums the gradients of samples sharing an id and sends one
row per distinct id; the owner puts each sum on the id's first sample (the table's
gradient, a sum over samples per id, is unchanged).

The loss on each rank is a mean over its b samples and DDP averages dense gradients
over W ranks; the single-process loss is a mean over B = W b. So the gradient for the
tables is divided by W before it is encoded: the bound then applies to the gradient the
owner actually uses, and a lossless run equals the single-process one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.profiler import record_function

from recsz.codecs import Codec, decode_payload
from recsz.comm.exchange import PendingBytes, frame, start_all_to_all_bytes, unframe
from recsz.comm.ids import unique_first
from recsz.comm.stats import CommStats, ShardPlan
from recsz.policy import BoundPolicy

#: (peer rank, table, rows (n, D)): a chunk to send (peer = destination) or received
#: (peer = source).
Chunk = tuple[int, int, torch.Tensor]


@dataclass(frozen=True)
class Direction:
    """One direction of the exchange: "fwd" or "bwd", its codec and its bound policy."""

    name: str
    codec: Codec
    policy: BoundPolicy


class Distinct(NamedTuple):
    """The distinct ids of one (sample owner, table) slice of b ids."""

    inverse: torch.Tensor  # (b,): index of each sample's id among the distinct ids
    first: torch.Tensor  # (n,): each distinct id's first sample
    ids: torch.Tensor  # (n,): the distinct ids, sorted


class EmbeddingExchange:
    """Sends pooled embeddings to sample owners and their gradients back, compressed.

    Args:
        plan: table ownership.
        rank: this process's rank.
        fwd, bwd: codec and bound policy of each direction.
        check_bounds: decode every payload on the sender and assert its bound.
        id_dedup, coalesce: id-aware traffic (module docstring).
    """

    def __init__(
        self,
        plan: ShardPlan,
        rank: int,
        fwd: Direction,
        bwd: Direction,
        check_bounds: bool = False,
        id_dedup: bool = False,
        coalesce: bool = False,
    ) -> None:
        self.plan, self.rank, self.world = plan, rank, plan.world
        self.fwd, self.bwd = fwd, bwd
        for d in (fwd, bwd):
            d.codec.warm_up()
        self.mine = plan.tables_of(rank)
        self.stats = CommStats()
        self.check_bounds = check_bounds
        self.id_dedup, self.coalesce = id_dedup, coalesce
        # DCT-MP: gradients only for the entries the forward pass delivered (the rest
        # were dropped, so nothing upstream depends on them).
        self.mask_backward = bwd.codec.forward_mask
        #: Training steps feed the policies and the statistics; evaluation does neither.
        self.training = True
        self._batch: tuple[torch.Tensor, int] | None = None
        self._distinct_of: dict[tuple[int, int], Distinct] = {}

    @property
    def policies(self) -> dict[str, BoundPolicy]:
        return {"fwd": self.fwd.policy, "bwd": self.bwd.policy}

    def train(self, mode: bool = True) -> None:
        self.training = mode

    # ---- the one exchange path ------------------------------------------------------
    def _send(
        self,
        d: Direction,
        step: int,
        chunks: list[Chunk],
        bound_src: dict[int, torch.Tensor],
        raw_bytes: int,
    ) -> PendingBytes:
        """Encode (destination, table, rows) chunks, frame them per destination and start
        the byte all-to-all.

        A table's bound is set once per step from ``bound_src[table]`` (all the values of
        that table this rank sends), so every destination gets the same bound.
        ``raw_bytes`` is what one chunk stood for before any id-aware reduction (the full
        (b, D) fp32 slice), so ratios count those savings too.
        """
        t0 = time.perf_counter()
        ebs = {t: self._bound(d, t, step, x) for t, x in bound_src.items()}
        # One call for every chunk of the step: the same payloads as one call each, but a
        # codec that codes on the device (CUDA) shares its launches and syncs.
        xs = [x.contiguous() for _, _, x in chunks]
        payloads = d.codec.encode_batch(xs, [ebs[t] for _, t, _ in chunks])
        per_dest: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for (dest, t, _), x, p in zip(chunks, xs, payloads, strict=True):
            per_dest[dest].append(p)
            eb = ebs[t]
            if self.check_bounds and eb is not None and x.numel():
                err = float((decode_payload(p).double() - x.double()).abs().max())
                if err > eb:
                    raise AssertionError(f"table {t} {d.name}: error {err} > bound {eb}")
                self.stats.max_err[d.name] = max(self.stats.max_err[d.name], err / eb)
            if self.training:
                self.stats.count(d.name, t, raw_bytes, p.numel(), eb, dest != self.rank)
        framed = [frame(ps) for ps in per_dest]
        self._time_codec(t0)
        return start_all_to_all_bytes(framed, self.world)

    def _bound(self, d: Direction, table: int, step: int, x: torch.Tensor) -> float | None:
        if self.training:
            d.policy.observe(table, step, x)
        eb = d.policy.bound(table, step, x)
        if d.codec.error_bounded and eb is None:
            raise ValueError(
                f"{d.name} codec {d.codec.codec_id!r} needs an error bound policy (--eb-policy)"
            )
        return eb

    def _receive(
        self,
        d: Direction,
        pending: PendingBytes,
        tables_from: Callable[[int], list[int]],
        rows_of: Callable[[int, int], int],
        dim: int,
    ) -> list[Chunk]:
        """Wait for the bytes and decode them: (source, table, rows) for every table each
        source sends (``tables_from(source)``), each checked to be ``rows_of(source,
        table)`` x ``dim``."""
        with record_function(f"recsz.a2a_{d.name}.wait"):
            bufs = pending.wait()
        if self.training:
            self.stats.a2a_s[d.name] += pending.waited_s
        t0 = time.perf_counter()
        keys: list[tuple[int, int]] = []
        payloads: list[torch.Tensor] = []
        for src, buf in enumerate(bufs):
            tables = tables_from(src)
            keys += [(src, t) for t in tables]
            payloads += unframe(buf, len(tables), f"rank {src} ({d.name} all-to-all)")
        with record_function(f"recsz.a2a_{d.name}.decode"):
            decoded = self._decode_all(d, payloads, [src for src, _ in keys])
        for (src, t), y in zip(keys, decoded, strict=True):
            want = (rows_of(src, t), dim)
            if tuple(y.shape) != want:
                raise ValueError(
                    f"rank {src} sent table {t} ({d.name}) as {tuple(y.shape)}, expected "
                    f"{want} (do the ranks read the same batch?)"
                )
        self._time_codec(t0)
        return [(src, t, y) for (src, t), y in zip(keys, decoded, strict=True)]

    def _decode_all(
        self, d: Direction, payloads: list[torch.Tensor], srcs: list[int]
    ) -> list[torch.Tensor]:
        """Decode every payload in one call; on a bad one, decode them one by one so that
        the error names the rank that sent it."""
        try:
            return d.codec.decode_batch(payloads)
        except ValueError:
            for p, src in zip(payloads, srcs, strict=True):
                try:
                    d.codec.decode(p)
                except ValueError as e:
                    raise ValueError(
                        f"rank {self.rank}: payload from rank {src} ({d.name}): {e}"
                    ) from e
            raise

    def _time_codec(self, t0: float) -> None:
        if self.training:
            self.stats.codec_s += time.perf_counter() - t0

    def _distinct(self, ids: torch.Tensor, rank: int, table: int) -> Distinct:
        """The distinct ids of sample owner ``rank``'s slice of ``table``, computed once
        per batch: the forward and the backward of a step need the same slices."""
        if self._batch is None or self._batch[0] is not ids or self._batch[1] != ids._version:
            self._batch, self._distinct_of = (ids, ids._version), {}
        if (rank, table) not in self._distinct_of:
            b = ids.shape[0] // self.world
            col = ids[rank * b : (rank + 1) * b, table]
            self._distinct_of[(rank, table)] = Distinct(*unique_first(col))
        return self._distinct_of[(rank, table)]

    # ---- forward ------------------------------------------------------------------
    def start_forward(self, pooled: torch.Tensor, step: int, ids: torch.Tensor) -> Pending:
        """pooled (B, |T_r|, D), ids (B, T) of the global batch -> pending (b, T, D); the
        bytes fly while you compute."""
        data = pooled.detach()
        bsz, _, dim = data.shape
        b = bsz // self.world
        chunks: list[Chunk] = []
        for dest in range(self.world):
            for j, t in enumerate(self.mine):
                rows = data[dest * b : (dest + 1) * b, j]
                if self.id_dedup:
                    rows = rows[self._distinct(ids, dest, t).first]
                chunks.append((dest, t, rows))
        with record_function("recsz.a2a_fwd.encode"):
            bound_src = {t: data[:, j] for j, t in enumerate(self.mine)}
            pending = self._send(self.fwd, step, chunks, bound_src, b * dim * 4)
        return Pending(self, pooled, pending, step, ids)

    def finish_forward(self, pending: PendingBytes, ids: torch.Tensor, dim: int) -> torch.Tensor:
        b = ids.shape[0] // self.world

        def rows_of(src: int, t: int) -> int:
            return self._distinct(ids, self.rank, t).first.numel() if self.id_dedup else b

        received = self._receive(self.fwd, pending, self.plan.tables_of, rows_of, dim)
        # Table-major, so each table's rows land contiguously (index_select writes them in
        # place); the caller gets the (b, T, D) view.
        out = torch.empty(len(self.plan.owners), b, dim, device=ids.device)
        for _, t, y in received:
            if self.id_dedup:
                torch.index_select(y, 0, self._distinct(ids, self.rank, t).inverse, out=out[t])
            else:
                out[t] = y
        return out.transpose(0, 1)

    # ---- backward -----------------------------------------------------------------
    def backward(self, grad: torch.Tensor, step: int, ids: torch.Tensor) -> torch.Tensor:
        """grad (b, T, D) on a sample owner -> grad of pooled (B, |T_r|, D) on table owners."""
        b, n_tables, dim = grad.shape
        # Scaled and laid out table-major in one pass: every table's (b, D) slice is then
        # contiguous, which index_add_ and the codec read ~4x faster than a strided one.
        by_table = torch.empty(n_tables, b, dim, dtype=grad.dtype, device=grad.device)
        torch.div(grad.transpose(0, 1), self.world, out=by_table)
        per_sample = dict(enumerate(by_table))  # table -> (b, D)
        rows = dict(per_sample)
        if self.coalesce:
            for t, g in rows.items():
                u = self._distinct(ids, self.rank, t)
                rows[t] = g.new_zeros(u.first.numel(), dim).index_add_(0, u.inverse, g)
        chunks = [
            (dest, t, rows[t]) for dest in range(self.world) for t in self.plan.tables_of(dest)
        ]
        with record_function("recsz.a2a_bwd.encode"):
            # Bounds come from the per-sample gradients, not the coalesced sums: each sum
            # then carries one error of at most eb where, uncoalesced, its k addends would
            # carry up to k eb. (A relative bound taken on the sums' range, which popular
            # ids stretch, zeroed the small gradients of rare ids and cost 0.017 AUC in 30
            # steps of the link benchmark.)
            pending = self._send(self.bwd, step, chunks, per_sample, b * dim * 4)

        def rows_of(src: int, t: int) -> int:
            return self._distinct(ids, src, t).first.numel() if self.coalesce else b

        received = self._receive(self.bwd, pending, lambda _src: self.mine, rows_of, dim)
        out = grad.new_zeros(b * self.world, len(self.mine), dim)
        column = {t: j for j, t in enumerate(self.mine)}
        all_rows = torch.arange(b, device=grad.device)
        for src, t, y in received:
            at = self._distinct(ids, src, t).first if self.coalesce else all_rows
            out[src * b + at, column[t], :] = y
        return out


class Pending:
    """Forward all-to-all in flight; ``wait()`` gives (b, T, D) tied into autograd."""

    def __init__(
        self,
        ex: EmbeddingExchange,
        pooled: torch.Tensor,
        pending: PendingBytes,
        step: int,
        ids: torch.Tensor,
    ) -> None:
        self.ex, self.pooled, self.pending, self.step, self.ids = ex, pooled, pending, step, ids

    def wait(self) -> torch.Tensor:
        received = self.ex.finish_forward(self.pending, self.ids, self.pooled.shape[2])
        return _ExchangeGrad.apply(self.pooled, received, self.ex, self.step, self.ids)


class _ExchangeGrad(torch.autograd.Function):
    """Identity on the received embeddings forward; sends their gradient back in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        pooled: torch.Tensor,
        received: torch.Tensor,
        ex: EmbeddingExchange,
        step: int,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        ctx.ex, ctx.step, ctx.ids = ex, step, ids
        if ex.mask_backward:
            ctx.save_for_backward(received != 0)
        return received.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.ex.mask_backward:
            (kept,) = ctx.saved_tensors
            grad = grad * kept
        return ctx.ex.backward(grad, ctx.step, ctx.ids), None, None, None, None
