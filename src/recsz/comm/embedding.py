"""The embedding all-to-all of hybrid-parallel DLRM, compressed in both directions.

Forward: the owner of tables T_r looked them up for the global batch, pooled (B, |T_r|, D);
sample owner s gets rows [s*b, (s+1)*b) of each. Backward: s sends d(loss)/d(emb) (b, T, D)
back to the tables' owners. Both go through one path (:class:`~recsz.comm.path.BlockPath`):
one block per peer (its tables' rows, table after table, each table under its own bound
for the step), one payload per block, coded by the peer's direction
(:mod:`recsz.comm.route`); a direction only chooses its rows and places what it receives
(docs/ARCHITECTURE.md).
Each direction starts (codes and sends) and finishes (waits, decodes, places) apart, so
its bytes fly while the model computes: forward while the bottom MLP runs, backward while
the rest of the backward pass does (:mod:`recsz.comm.overlap`).

Id-aware traffic (every rank reads its own samples' ids and its own tables' ids of all
samples, so both ends of a slice know its ids: ``data.source.Part``): forward,
``id_dedup`` sends one row per distinct id of a destination's slice, which the receiver
expands (not a rank's own rows skipping an identity codec with no backward to follow);
backward, ``coalesce`` sends one summed gradient per distinct id, which the owner puts on
the id's first sample (the table's gradient is unchanged).

Each rank's loss is a mean over its b samples, the single-process loss one over B = W b:
the tables' gradient is divided by W before it is coded, so the bound applies to what the
owner uses and a lossless run equals the single-process one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recsz.comm.direction import Direction
from recsz.comm.ids import Slices
from recsz.comm.overlap import tie_backward
from recsz.comm.path import Block, BlockPath, Sent
from recsz.comm.route import Route
from recsz.comm.stats import ShardPlan
from recsz.comm.switch import CompressionSwitch
from recsz.policy import BoundPolicy
from recsz.profiling import stage


class EmbeddingExchange(BlockPath):
    """Sends pooled embeddings to sample owners and their gradients back, compressed.

    Args:
        plan: table ownership.
        rank: this process's rank.
        fwd, bwd: codec and bound policy of each direction.
        check_bounds, host: :class:`~recsz.comm.path.BlockPath`'s.
        id_dedup, coalesce: id-aware traffic (module docstring).
        sparse_grad: with ``coalesce``, backward hands the sums back as a sparse COO
            gradient of pooled (one row per distinct id, on its first sample), for a
            table module that takes one (:attr:`SparseArch.takes_sparse_grad`): no dense
            zeros of (B, |T_r|, D), no second sum of the same ids.
        plain, switch: the lossless directions of the steps the switch does not
            compress (``--compress auto``, :mod:`recsz.comm.switch`) and of the blocks for
            ``near`` peers.
        near: the peers whose blocks go plain on every step (``--compress-scope
            between-hosts``: this rank's host's ranks, :mod:`recsz.comm.route`).
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
        sparse_grad: bool = False,
        plain: tuple[Direction, Direction] | None = None,
        switch: CompressionSwitch | None = None,
        near: frozenset[int] = frozenset(),
        host: frozenset[int] | None = None,
    ) -> None:
        super().__init__(rank, plan.world, check_bounds, host)
        self.plan = plan
        self.fwd, self.bwd = fwd, bwd
        if near and plain is None:
            raise ValueError("plain blocks for near peers need plain directions")
        fp, bp = plain or (fwd, bwd)
        w = plan.world
        #: each step's routes, compressed (True) or plain, as the switch says
        self.routes = {
            True: (Route.of(w, fwd, fp, near), Route.of(w, bwd, bp, near)),
            False: (Route.of(w, fp, fp, near), Route.of(w, bp, bp, near)),
        }
        self.switch = switch or CompressionSwitch()
        for d in (fwd, bwd, *(plain or ())):
            d.codec.warm_up()
        self.mine = plan.tables_of(rank)
        #: Every table, each destination's side by side (then those no rank owns).
        self._order = tuple(t for r in range(plan.world) for t in plan.tables_of(r)) + tuple(
            t for t, r in enumerate(plan.owners) if r < 0
        )
        self.id_dedup, self.coalesce = id_dedup, coalesce
        self.sparse_grad = sparse_grad and coalesce
        #: (grad (b, T, D), this rank's samples' ids (b, T)) -> the gradient to send
        #: (FIITED's ``HeldMask``: zeros for the chunks the rows' owners pruned).
        self.grad_filter: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._slices = Slices(plan, rank)

    @property
    def policies(self) -> dict[str, BoundPolicy]:
        return {"fwd": self.fwd.policy, "bwd": self.bwd.policy}

    def train(self, mode: bool = True) -> None:
        if not mode:
            self.settle()
            self.switch.pause()
        self.training = mode

    # ---- forward ------------------------------------------------------------------
    def start_forward(self, pooled: torch.Tensor, step: int, ids: torch.Tensor) -> Pending:
        """pooled (B, |T_r|, D), ids (B, T) of the global batch -> pending (b, T, D); the
        bytes fly while you compute."""
        self._fwd_checks.read()  # a forward's whose backward never ran
        if self.training and torch.is_grad_enabled() and not pooled.shape[1]:
            # A rank of no tables (more ranks than tables) still takes its part in the
            # backward exchange its peers start: without it they waited for its bytes.
            pooled = pooled.detach().requires_grad_()
        way = self.switch.compress(step) if self.training else self.switch.chosen
        fwd, bwd = self.routes[way]
        data = pooled.detach().contiguous()
        bsz, n_mine, dim = data.shape
        b = bsz // self.world
        # The own rows skip an identity codec: where no backward needs their distinct ids,
        # they go whole (sorting them saved nothing: a lone rank evaluates 1.09-1.66x faster).
        whole = fwd[self.rank].codec.identity and not pooled.requires_grad
        dedup = [self.id_dedup and not (whole and r == self.rank) for r in range(self.world)]
        blocks = []
        for dest in range(self.world):
            if dedup[dest]:  # rows of the distinct ids, table by table
                first = self._slices.distinct(ids, dest, self.rank, own=not whole).first
                at = (dest * b + first % b) * n_mine + first // b  # first: table * b + sample
                rows = data.view(-1, dim).index_select(0, at)
            elif dest == self.rank and fwd[dest].codec.identity:  # no codec: sample-major, a view
                rows = data[dest * b : (dest + 1) * b].view(-1, dim)
            else:
                rows = data[dest * b : (dest + 1) * b].transpose(0, 1).reshape(n_mine * b, dim)
            sizes = self._slices.sizes(dedup[dest], ids, dest, self.rank)
            blocks.append(Block(dest, self.mine, rows, sizes))
        expect = [sum(self._slices.sizes(dedup[s], ids, self.rank, s)) for s in range(self.world)]
        with stage("recsz.a2a_fwd.encode"):
            bound_src = (self.mine, data.transpose(0, 1))
            sent = self._send(fwd, step, blocks, bound_src, b * dim * 4, expect)
        return Pending(self, pooled, sent, step, ids, bwd)

    def finish_forward(self, sent: Sent, ids: torch.Tensor, dim: int, hold: bool) -> torch.Tensor:
        """The forward's (b, T, D); ``hold``: a backward follows, which reads the checks'
        verdicts before any byte made from these values leaves (:meth:`_send`)."""
        b = ids.shape[0] // self.world
        whole = sent.own is not None and not hold  # the own rows came whole (start_forward)
        dedup = [self.id_dedup and not (whole and r == self.rank) for r in range(self.world)]
        received = self._receive(
            sent, self.plan.tables_of, lambda s: self._slices.sizes(dedup[s], ids, self.rank, s),
            dim, self._fwd_checks,
        )  # fmt: skip
        if not hold:
            self._fwd_checks.read()
        # One gather of all blocks' rows into the (b, T, D) layout the model reads: each
        # (sample, table) names its row; tables no rank sends read a zero row at the end.
        n_tables, sent_by = len(self.plan.owners), [blk for blk in received if blk.tables]
        if whole and self.mine == list(range(n_tables)):  # a lone rank's rows, as they were
            return received[self.rank].rows.view(b, n_tables, dim).float()
        parts = [blk.rows for blk in sent_by]
        index = torch.full((n_tables, b), sum(len(r) for r in parts), device=ids.device)
        at = 0
        for blk in sent_by:
            n = len(blk.tables)
            if dedup[blk.peer]:  # every sample gets its id's row
                of = self._slices.distinct(ids, self.rank, blk.peer).inverse.view(n, b)
            elif sent.own is not None and blk.peer == self.rank:  # sample-major (start_forward)
                of = torch.arange(n * b, device=ids.device).view(b, n).t()
            else:
                of = torch.arange(n * b, device=ids.device).view(n, b)
            index.index_copy_(0, self._index_of(blk.tables, ids.device), of + at)
            at += len(blk.rows)
        if min(self.plan.owners) < 0:
            parts.append(received[0].rows.new_zeros(1, dim))
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        return rows.index_select(0, index.t().reshape(-1)).view(b, n_tables, dim).float()

    # ---- backward -----------------------------------------------------------------
    def start_backward(
        self, grad: torch.Tensor, step: int, ids: torch.Tensor, bwd: Route | None = None
    ) -> Sent:
        """grad (b, T, D) on a sample owner: code it (``bwd``: the step's route, default the
        compressed one) and start sending it to the tables' owners
        (:meth:`finish_backward` receives)."""
        b, _, dim = grad.shape
        if self.grad_filter is not None:
            grad = self.grad_filter(grad, ids[self.rank * b : (self.rank + 1) * b])
        # Table-major in one gather, each destination's tables side by side: contiguous
        # (b, D) slices (read ~4x faster), each destination's rows a view (2.1 -> 0.7 ms).
        order = self._order
        by_table = grad.transpose(0, 1).index_select(0, self._index_of(order, grad.device))
        if self.world > 1:
            by_table.div_(self.world)

        blocks, at = [], 0
        for dest in range(self.world):
            tables = self.plan.tables_of(dest)
            rows = by_table[at : at + len(tables)].view(-1, dim)
            at += len(tables)
            if self.coalesce:  # one summed row per distinct id, table by table
                u = self._slices.distinct(ids, self.rank, dest)
                rows = rows.new_zeros(u.first.numel(), dim).index_add_(0, u.inverse, rows)
            sizes = self._slices.sizes(self.coalesce, ids, self.rank, dest)
            blocks.append(Block(dest, tables, rows, sizes))
        with stage("recsz.a2a_bwd.encode"):
            # Bounds from the per-sample gradients, not the coalesced sums: each sum carries
            # one error of at most eb, as each addend would uncoalesced. (A relative bound on
            # the sums' range, which popular ids stretch, zeroed rare ids' small gradients:
            # -0.017 AUC in 30 steps of the link benchmark.)
            per_sample = (list(order), by_table)  # table-major (T, b, D)
            expect = [
                sum(self._slices.sizes(self.coalesce, ids, s, self.rank)) for s in range(self.world)
            ]
            return self._send(
                bwd or self.routes[True][1], step, blocks, per_sample, b * dim * 4, expect
            )

    def finish_backward(self, sent: Sent, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The gradients :meth:`start_backward` sent, received on the tables' owner -> grad
        of pooled (B, |T_r|, D), in ``like``'s dtype (pooled's)."""
        b, dim = ids.shape[0] // self.world, like.shape[-1]

        def sizes_from(src: int) -> list[int]:  # src: a sample owner
            return self._slices.sizes(self.coalesce, ids, src, self.rank)

        checks = self._bwd_checks  # read later: until then a damaged payload updates nothing
        received = self._receive(sent, lambda _: self.mine, sizes_from, dim, checks)
        ok = checks.all_ok()
        if ok is not None:
            received = [blk._replace(rows=torch.where(ok, blk.rows, 0)) for blk in received]
        n_mine, bsz = len(self.mine), b * self.world
        if self.sparse_grad:  # each sum at (its id's first sample, table)
            where, sums = [], []
            for blk in received:
                first = self._slices.distinct(ids, blk.peer, self.rank).first
                where.append(torch.stack([blk.peer * b + first % b, first // b]))
                sums.append(blk.rows.to(like.dtype))
            # opted out by the context, not the argument: torch 2.11 warns despite the latter
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                return torch.sparse_coo_tensor(
                    torch.cat(where, 1), torch.cat(sums), (bsz, n_mine, dim)
                )
        out = like.new_zeros(n_mine, bsz, dim)  # table-major; the caller gets (B, |T_r|, D)
        for blk in received:
            s = blk.peer
            if self.coalesce:  # each sum on its id's first sample
                first = self._slices.distinct(ids, s, self.rank).first
                at = (first // b) * bsz + s * b + first % b
                out.view(-1, dim).index_copy_(0, at, blk.rows.to(out.dtype))
            else:
                out[:, s * b : (s + 1) * b] = blk.rows.view(n_mine, b, dim)
        return out.transpose(0, 1)


@dataclass
class Pending:
    """Forward all-to-all in flight; ``wait()`` gives (b, T, D), whose gradient is sent
    back while the rest of the backward pass runs (:func:`tie_backward`)."""

    ex: EmbeddingExchange
    pooled: torch.Tensor
    sent: Sent
    step: int
    ids: torch.Tensor
    bwd: Route  # the step's backward route

    def wait(self) -> torch.Tensor:
        ex, pooled, step, ids, bwd = self.ex, self.pooled, self.step, self.ids, self.bwd
        received = ex.finish_forward(self.sent, ids, pooled.shape[2], hold=pooled.requires_grad)
        # DCT-MP: gradients only for the entries the forward pass delivered (the rest
        # were dropped, so nothing upstream depends on them).
        kept = received != 0 if bwd.forward_mask and pooled.requires_grad else None

        def start(grad: torch.Tensor) -> Sent:
            return ex.start_backward(grad if kept is None else grad * kept, step, ids, bwd)

        return tie_backward(received, pooled, start, lambda s: ex.finish_backward(s, ids, pooled))
