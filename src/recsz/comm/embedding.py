"""The embedding all-to-all of hybrid-parallel DLRM, compressed in both directions.

Forward: the owner of tables T_r looked them up for the whole global batch,
pooled (B, |T_r|, D). Sample owner s needs rows [s*b, (s+1)*b) of every table. Each
(table, destination) chunk (b, D) is encoded on its own, so every table keeps its own
bound and codebook; the chunks for one destination are framed into one byte buffer.

Backward: sample owner s holds d(loss)/d(emb) (b, T, D) and sends each table's chunk back
to its owner, which stacks the chunks of all sample owners into (B, |T_r|, D).

The loss on each rank is a mean over its b samples and DDP averages dense gradients
over W ranks; the single-process loss is a mean over B = W b. So the gradient for the
tables is divided by W before it is encoded: the bound then applies to the gradient the
owner actually uses, and a lossless run equals the single-process one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from recsz.codecs import Codec, decode_payload
from recsz.comm.exchange import PendingBytes, frame, start_all_to_all_bytes, unframe
from recsz.comm.ids import unique_first
from recsz.comm.refcache import RefCache, decode_with_refs, encode_with_refs
from recsz.comm.stats import CommStats, ShardPlan
from recsz.policy import BoundPolicy


class EmbeddingExchange:
    """Sends pooled embeddings to sample owners and their gradients back, compressed.

    Args:
        plan: table ownership.
        rank: this process's rank.
        fwd_codec, bwd_codec: codecs for each direction.
        fwd_policy, bwd_policy: bound per (table, step) for each direction.
    """

    def __init__(
        self,
        plan: ShardPlan,
        rank: int,
        fwd_codec: Codec,
        bwd_codec: Codec,
        fwd_policy: BoundPolicy,
        bwd_policy: BoundPolicy,
        check_bounds: bool = False,
        mask_backward: bool = False,
        id_dedup: bool = False,
        coalesce: bool = False,
        fwd_refs: bool = False,
        ref_cache_rows: int = 8192,
        dim: int = 0,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.world = plan.world
        self.codecs = {"fwd": fwd_codec, "bwd": bwd_codec}
        for codec in self.codecs.values():
            codec.warm_up()
        self.policies = {"fwd": fwd_policy, "bwd": bwd_policy}
        self.mine = plan.tables_of(rank)
        self.stats = CommStats()
        self.check_bounds = check_bounds  # decode own payloads to verify (tests, debugging)
        # DCT-MP: gradients only for the entries the forward pass delivered (the rest
        # were dropped, so nothing upstream depends on them).
        self.mask_backward = mask_backward
        # Id-aware traffic: both ends know every sample's ids (see start_forward, backward).
        self.id_dedup = id_dedup or fwd_refs  # references are per distinct id
        self.coalesce = coalesce
        self.fwd_refs = fwd_refs
        self._ids_seen: torch.Tensor | None = None
        self._ids_version = -1
        self._distinct_of: dict[
            tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        # Table owner: a mirror of what each receiver holds; sample owner: what it holds.
        self.mirrors: dict[tuple[int, int], RefCache] = {}
        self.caches: dict[int, RefCache] = {}
        if fwd_refs:
            if dim < 1:
                raise ValueError("fwd_refs needs the embedding dim")
            self.mirrors = {
                (t, d): RefCache(ref_cache_rows, dim) for t in self.mine for d in range(self.world)
            }
            self.caches = {t: RefCache(ref_cache_rows, dim) for t in range(len(plan.owners))}

    def state_dict(self) -> dict[str, Any]:
        """What must survive a checkpoint: the reference caches of both ends."""
        return {
            "mirrors": {k: c.state_dict() for k, c in self.mirrors.items()},
            "caches": {k: c.state_dict() for k, c in self.caches.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("mirrors", "caches"):
            mine = getattr(self, name)
            saved = state.get(name, {})
            if set(saved) != set(mine):
                raise ValueError(
                    f"checkpoint holds {name} for {sorted(saved)}, this run "
                    f"expects {sorted(mine)} (--fwd-refs differs?)"
                )
            for k, c in mine.items():
                c.load_state_dict(saved[k])

    def cache_digests(self) -> dict[str, dict[str, str]]:
        """Hashes of every cache, keyed "table/receiver": a mirror equals its cache."""
        return {
            "mirrors": {f"{t}/{d}": c.digest() for (t, d), c in self.mirrors.items()},
            "caches": {f"{t}/{self.rank}": c.digest() for t, c in self.caches.items()},
        }

    def cache_rows(self) -> int:
        """Vectors held in all reference caches and mirrors of this rank."""
        return sum(c.rows for c in (*self.mirrors.values(), *self.caches.values()))

    # ---- encoding and decoding of one direction ------------------------------------
    def _encode_for(
        self,
        direction: str,
        step: int,
        plan: list[list[tuple[int, torch.Tensor, int]]],
        bound_src: dict[int, torch.Tensor],
        record: bool,
        encode_item: Callable[[int, int, torch.Tensor, float | None], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Encode plan[dest] = [(table, chunk, raw bytes)] per destination; one buffer each.

        ``raw bytes`` is what the chunk stood for before any id-aware reduction (the full
        (b, D) fp32 slice), so ratios count those savings too.

        The bound of a table is set once per step from ``bound_src[table]`` (all the
        values of that table this rank sends), so every destination gets the same bound.
        """
        codec, policy = self.codecs[direction], self.policies[direction]
        t0 = time.perf_counter()
        ebs: dict[int, float | None] = {}
        for t, x in bound_src.items():
            policy.observe(t, step, x)
            ebs[t] = policy.bound(t, step, x)
            if codec.error_bounded and ebs[t] is None:
                raise ValueError(
                    f"{direction} codec {codec.codec_id!r} needs an error bound "
                    "policy (--eb-policy)"
                )
        items = [
            (dest, t, c.contiguous(), n_raw)
            for dest, chunks in enumerate(plan)
            for t, c, n_raw in chunks
        ]
        if encode_item is None:
            # One call for every chunk of the step: the same payloads as one call each, but
            # a codec that codes on the device (CUDA) shares its launches and syncs.
            payloads = codec.encode_batch(
                [c for _, _, c, _ in items], [ebs[t] for _, t, _, _ in items]
            )
        else:
            payloads = [encode_item(t, dest, c, ebs[t]) for dest, t, c, _ in items]
        parts: list[list[torch.Tensor]] = [[] for _ in plan]
        for (dest, t, c, n_raw), p in zip(items, payloads, strict=True):
            eb = ebs[t]
            parts[dest].append(p)
            if record:
                st = self.stats
                st.raw[direction] += n_raw
                st.sent[direction] += p.numel()
                st.table_raw[direction][t] += n_raw
                st.table_sent[direction][t] += p.numel()
                if dest != self.rank:
                    st.wire[direction] += p.numel()
                if eb is not None:
                    st.last_eb[direction][t] = eb
            if self.check_bounds and eb is not None and c.numel() and encode_item is None:
                err = float((decode_payload(p).double() - c.double()).abs().max())
                if err > eb:
                    raise AssertionError(f"table {t} {direction}: error {err} > bound {eb}")
                self.stats.max_err[direction] = max(self.stats.max_err[direction], err / eb)
        framed = [frame(ps) for ps in parts]
        if record:
            self.stats.codec_s += time.perf_counter() - t0
        return framed

    def _decode_one(self, direction: str, p: torch.Tensor, src: int) -> torch.Tensor:
        # Every rank runs the same codecs (checked at start-up); the codec still checks
        # the payload's header names it, and reusing it skips building one per payload.
        try:
            return self.codecs[direction].decode(p)
        except ValueError as e:
            raise ValueError(f"rank {self.rank}: payload from rank {src} ({direction}): {e}") from e

    def _decode_all(
        self, direction: str, parts: list[torch.Tensor], srcs: list[int]
    ) -> list[torch.Tensor]:
        """Decode the payloads of every source in one call; on a bad payload, decode them
        one by one so that the error names the rank that sent it."""
        try:
            return self.codecs[direction].decode_batch(parts)
        except ValueError:
            for p, src in zip(parts, srcs, strict=True):
                self._decode_one(direction, p, src)
            raise

    # ---- forward ------------------------------------------------------------------
    def _slice_ids(self, ids: torch.Tensor, rank: int, table: int) -> torch.Tensor:
        b = ids.shape[0] // self.world
        return ids[rank * b : (rank + 1) * b, table]

    def _distinct(
        self, ids: torch.Tensor, rank: int, table: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """unique_first of one (sample owner, table) slice, computed once per batch: the
        forward and the backward of a step need the same slices."""
        if ids is not self._ids_seen or ids._version != self._ids_version:  # a new batch
            self._ids_seen, self._ids_version, self._distinct_of = ids, ids._version, {}
        key = (rank, table)
        if key not in self._distinct_of:
            self._distinct_of[key] = unique_first(self._slice_ids(ids, rank, table))
        return self._distinct_of[key]

    def start_forward(
        self, pooled: torch.Tensor, step: int, ids: torch.Tensor, record: bool = True
    ) -> PendingEmbeddings:
        """pooled (B, |T_r|, D) -> pending (b, T, D); the bytes fly while you compute.

        ids (B, T): the global batch's ids, known on both ends. With ``id_dedup`` each
        destination gets one vector per distinct id of its slice (in sorted id order),
        which it expands with its own copy of the ids: exact for single-id bags. With
        ``fwd_refs`` (training steps only) an id whose current vector is within the bound
        of what the receiver holds travels as one bit instead.
        """
        use_refs = self.fwd_refs and record
        with record_function("recsz.a2a_fwd.encode"):
            data = pooled.detach()
            bsz, _, d = data.shape
            b = bsz // self.world
            plan: list[list[tuple[int, torch.Tensor, int]]] = []
            for dest in range(self.world):
                items = []
                for j, t in enumerate(self.mine):
                    rows = data[dest * b : (dest + 1) * b, j]
                    if self.id_dedup:
                        _, first, _ = self._distinct(ids, dest, t)
                        rows = rows[first]
                    items.append((t, rows, b * d * 4))
                plan.append(items)
            bound_src = {t: data[:, j] for j, t in enumerate(self.mine)}

            def with_refs(t: int, dest: int, rows: torch.Tensor, eb: float | None) -> torch.Tensor:
                uniq = self._distinct(ids, dest, t)[2]
                sent, hit, held = encode_with_refs(
                    self.mirrors[(t, dest)], uniq, rows, eb, self.codecs["fwd"]
                )
                if self.check_bounds and eb is not None and rows.numel():
                    err = float((held.double() - rows.double()).abs().max())
                    if err > eb:
                        raise AssertionError(f"table {t} fwd with references: {err} > {eb}")
                    self.stats.max_err["fwd"] = max(self.stats.max_err["fwd"], err / eb)
                self.stats.ref_hits[t] += int(hit.sum())
                self.stats.ref_total[t] += int(hit.numel())
                return sent

            send = self._encode_for(
                "fwd", step, plan, bound_src, record, with_refs if use_refs else None
            )
        pending = start_all_to_all_bytes(send, self.world)
        return PendingEmbeddings(self, pooled, pending, step, ids, record)

    def finish_forward(
        self, pending: PendingBytes, ids: torch.Tensor, dim: int, record: bool
    ) -> torch.Tensor:
        with record_function("recsz.a2a_fwd.wait"):
            bufs = pending.wait()
        if record:
            self.stats.a2a_s["fwd"] += pending.waited_s
        use_refs = self.fwd_refs and record
        b = ids.shape[0] // self.world
        # Table-major, so each table's rows land contiguously (index_select writes them in
        # place); the caller gets the (b, T, D) view.
        out_t = torch.empty(len(self.plan.owners), b, dim, device=ids.device)
        t0 = time.perf_counter()
        with record_function("recsz.a2a_fwd.decode"):
            items: list[tuple[int, int, torch.Tensor]] = []  # (source, table, payload)
            for src, buf in enumerate(bufs):
                tables = self.plan.tables_of(src)
                parts = unframe(buf, len(tables), f"rank {src} (fwd all-to-all)")
                items += [(src, t, part) for t, part in zip(tables, parts, strict=True)]
            decoded: list[torch.Tensor] = []
            if not use_refs:
                decoded = self._decode_all("fwd", [p for *_, p in items], [s for s, *_ in items])
            for k, (src, t, part) in enumerate(items):
                inv = uniq = None
                rows = b
                if self.id_dedup:
                    inv, first, uniq = self._distinct(ids, self.rank, t)
                    rows = first.numel()
                if use_refs:
                    assert uniq is not None
                    y = decode_with_refs(
                        self.caches[t],
                        uniq,
                        part,
                        functools.partial(self._decode_one, "fwd", src=src),
                        f"rank {src} (fwd references of table {t})",
                    )
                else:
                    y = decoded[k]
                if tuple(y.shape) != (rows, dim):
                    raise ValueError(
                        f"rank {src} sent table {t} as {tuple(y.shape)}, expected "
                        f"{(rows, dim)} (do the ranks read the same batch?)"
                    )
                if inv is None:
                    out_t[t] = y
                else:
                    torch.index_select(y, 0, inv, out=out_t[t])
        if record:
            self.stats.codec_s += time.perf_counter() - t0
        return out_t.transpose(0, 1)

    # ---- backward -----------------------------------------------------------------
    def backward(self, grad: torch.Tensor, step: int, ids: torch.Tensor) -> torch.Tensor:
        """grad (b, T, D) on a sample owner -> grad of pooled (B, |T_r|, D) on table owners.

        With ``coalesce`` the gradients of samples sharing an id are summed first and one
        row per distinct id travels (sorted id order, derivable on both ends). The owner
        puts each sum on the first sample with that id and zeros on the others: the
        table's gradient (a sum over samples per id, for single-id bags) is unchanged.
        """
        b, n_tables, d = grad.shape
        # Scaled and laid out table-major in one pass: every table's (b, D) slice is then
        # contiguous, which index_add_ and the codec read ~4x faster than a strided one.
        by_table = torch.empty(n_tables, b, d, dtype=grad.dtype, device=grad.device)
        torch.div(grad.transpose(0, 1), self.world, out=by_table)
        with record_function("recsz.a2a_bwd.encode"):
            cols: dict[int, torch.Tensor] = {}
            for t in range(n_tables):
                g = by_table[t]
                if self.coalesce:
                    inv, first, _ = self._distinct(ids, self.rank, t)
                    g = g.new_zeros(first.numel(), d).index_add_(0, inv, g)
                cols[t] = g
            plan = [
                [(t, cols[t], b * d * 4) for t in self.plan.tables_of(dest)]
                for dest in range(self.world)
            ]
            # Bounds come from the per-sample gradients, not the coalesced sums: each sum
            # then carries one error of at most eb where, uncoalesced, its k addends would
            # carry up to k eb. (A relative bound taken on the sums' range, which popular
            # ids stretch, zeroed the small gradients of rare ids and cost 0.017 AUC in 30
            # steps of the link benchmark.)
            per_sample = {t: by_table[t] for t in range(n_tables)}
            send_parts = self._encode_for("bwd", step, plan, per_sample, True)
        pending = start_all_to_all_bytes(send_parts, self.world)
        with record_function("recsz.a2a_bwd.wait"):
            bufs = pending.wait()
        self.stats.a2a_s["bwd"] += pending.waited_s
        out = grad.new_zeros(b * self.world, len(self.mine), d)
        with record_function("recsz.a2a_bwd.decode"):
            t0 = time.perf_counter()
            parts = [
                unframe(buf, len(self.mine), f"rank {src} (bwd all-to-all)")
                for src, buf in enumerate(bufs)
            ]
            srcs = [src for src, ps in enumerate(parts) for _ in ps]
            flat = self._decode_all("bwd", [p for ps in parts for p in ps], srcs)
            self.stats.codec_s += time.perf_counter() - t0
            for src in range(len(bufs)):
                decoded = flat[src * len(self.mine) : (src + 1) * len(self.mine)]
                for j, (t, y) in enumerate(zip(self.mine, decoded, strict=True)):
                    rows = torch.arange(b, device=grad.device)
                    if self.coalesce:
                        _, rows, _ = self._distinct(ids, src, t)
                    if tuple(y.shape) != (rows.numel(), d):
                        raise ValueError(
                            f"rank {src} sent a gradient of shape {tuple(y.shape)} for table "
                            f"{t}, expected {(rows.numel(), d)}"
                        )
                    out[src * b + rows, j, :] = y
        return out


class PendingEmbeddings:
    """Forward all-to-all in flight; ``wait()`` gives (b, T, D) tied into autograd."""

    def __init__(
        self,
        ex: EmbeddingExchange,
        pooled: torch.Tensor,
        pending: PendingBytes,
        step: int,
        ids: torch.Tensor,
        record: bool,
    ) -> None:
        self.ex, self.pooled, self.pending, self.step, self.ids, self.record = (
            ex,
            pooled,
            pending,
            step,
            ids,
            record,
        )

    def wait(self) -> torch.Tensor:
        received = self.ex.finish_forward(self.pending, self.ids, self.pooled.shape[2], self.record)
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
