"""The MLP gradients' all-reduce: DDP communication hooks, torch's own beside ours.

``--dp-comm`` picks one:

- ``allreduce``: DDP's averaging all-reduce (asynchronous, as DDP's default);
- ``fp16``, ``bf16``: torch's ``fp16_compress_hook`` / ``bf16_compress_hook``
  (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): cast, all-reduce, cast back;
- ``powersgd``: torch's ``powerSGD_hook`` (rank ``--powersgd-rank`` approximations with error
  feedback, plain all-reduce for the first ``--powersgd-warmup`` steps);
- ``dct``: DCT-DP (:mod:`recsz.comm.dct_dp`);
- ``eb``: each rank adds its residual to its gradient, encodes the sum with an error-bounded
  codec (``--dp-codec``, bound ``--dp-eb`` relative to the bucket's range), keeps what the
  codec lost as the next residual (error feedback: the error does not accumulate), and all
  ranks all-gather the variable-size payloads, decode them and average. Every rank's
  contribution is within its bound of what it meant to send, so the mean is within the
  mean of the bounds; a lossless codec gives the plain all-reduce. With
  ``--dp-eb-collective rsag`` the bucket is cut into W chunks instead: chunk j of every
  rank goes to rank j (a variable-size all-to-all), which averages them, codes the mean
  (its own bound and residual) and all-gathers it. Each rank then sends about
  2 (W-1)/W payloads' worth where the all-gather sends W-1, at the price of a second
  coding (the mean is within the mean of the first bounds plus the second bound) and a
  second round. Measured (bench preset, CPU ranks): on 2 ranks, where both send about the
  same bytes, the all-gather is faster; on 4, rsag sends half the bytes and is faster at
  200 Mbit/s (1.06-1.10x), slower at 1 Gbit/s (0.91x), so the all-gather stays the default.

Every hook counts its seconds (launch to completion) and the bytes this rank puts on the
wire (``bytes_sent``) beside what a ring all-reduce of fp32 would (``bytes_dense``).

With ``--compress auto`` (:mod:`recsz.comm.switch`) the steps the switch sends plain take
DDP's fp32 all-reduce instead of ``fp16``, ``bf16`` or ``eb`` (whose residuals join that
step's gradient, so nothing error feedback held back is lost); PowerSGD and DCT-DP keep
their own schedules.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from recsz.codecs import Codec
from recsz.codecs.checks import HeldChecks, riding
from recsz.comm.dct_dp import (
    DCTState,
    add_residual,
    all_gather_ragged,
    bucket_params,
    dct_hook,
    keep_residual,
)
from recsz.comm.exchange import start_all_to_all_bytes
from recsz.policy.base import absolute_bounds

DP_MODES = ("allreduce", "fp16", "bf16", "powersgd", "dct", "eb")
#: the modes a step the switch sends plain turns into the all-reduce
SWITCHED = ("fp16", "bf16", "eb")
EB_COLLECTIVES = ("allgather", "rsag")


@dataclass
class DPComm:
    """The hook's state and counters for the reports and checkpoints."""

    mode: str
    world: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_dense: int = 0
    inner: Any = None  # DCTState, PowerSGDState or EBState
    powersgd_min_rate: float = 2.0
    #: A process group of its own: PowerSGD launches its second all-reduce from a callback,
    #: at a moment that differs between ranks, and on the embedding exchange's group that
    #: could interleave with its all-to-alls in another order on each rank (gloo then hangs).
    group: Any = None
    #: ``--compress auto``: whether the step goes plain (module docstring)
    plain: Callable[[], bool] | None = None

    def ring_bytes(self, n: int, itemsize: int) -> int:
        """What one rank sends in a ring all-reduce of n elements."""
        return int(2 * (self.world - 1) / self.world * n * itemsize)

    def state_dict(self) -> dict[str, Any]:
        """Counters, and the state error feedback needs: residuals (dct, eb), PowerSGD's
        errors, warm-start memories, step and random generator."""
        out: dict[str, Any] = {"seconds": self.seconds, "bytes_sent": self.bytes_sent}
        out["bytes_dense"] = self.bytes_dense
        if isinstance(self.inner, DCTState):
            keys = ("step", "residual", "threshold", "refreshed_at", "refreshes")
            out["dct"] = {k: getattr(self.inner, k) for k in (*keys, "bytes_dense", "bytes_sent")}
        elif isinstance(self.inner, EBState):
            out["eb"] = {"residual": self.inner.residual, "reduced": self.inner.reduced}
        elif isinstance(self.inner, powerSGD_hook.PowerSGDState):
            out["powersgd"] = {k: getattr(self.inner, k) for k in _POWERSGD_KEYS}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seconds, self.bytes_sent = state["seconds"], state["bytes_sent"]
        self.bytes_dense = state["bytes_dense"]
        if self.inner is None:  # one rank: no hook (a state saved by several, resumed on one)
            return
        for k, v in state.get("dct", {}).items():
            setattr(self.inner, k, v)
        if "eb" in state:
            self.inner.residual = state["eb"]["residual"]
            self.inner.reduced = state["eb"].get("reduced", {})
        for k, v in state.get("powersgd", {}).items():
            setattr(self.inner, k, v)


_POWERSGD_KEYS = ("iter", "error_dict", "p_memory_dict", "q_memory_dict", "rng")
#: per hook, the state that is each rank's own error (what it has not sent yet), and
#: what is also the world's (rsag's reduced chunks: each rank owns 1/W of them)
_RESIDUALS = {"dct": ("residual",), "eb": ("residual", "reduced"), "powersgd": ("error_dict",)}
_OF_THE_WORLD = {"eb": ("reduced",)}


def resumed_state(saved: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank`` of ``world``'s :meth:`DPComm.state_dict`, resumed from a checkpoint
    that another number of ranks wrote (``saved``, by rank): the bytes of saved ranks
    ``rank``, ``rank + world``, ... (the ranks' sums stay the run's), the seconds and the
    hook's state of saved rank ``rank % len(saved)`` (its schedule: steps, thresholds,
    PowerSGD's memories and generator, the same on every rank), whose error feedback, each
    rank's own, it keeps only as that rank (a new rank starts without, a rank dropped
    loses it, and the reduce-scatter's, cut by the world's size, starts anew)."""
    own = saved[rank % len(saved)]
    out = {**own, "bytes_sent": 0, "bytes_dense": 0}
    for s in saved[rank::world]:
        out["bytes_sent"] += s["bytes_sent"]
        out["bytes_dense"] += s["bytes_dense"]
    if "dct" in out:  # its hook keeps the counters (DPComm's mirror them)
        out["dct"] = {
            **out["dct"],
            "bytes_sent": out["bytes_sent"],
            "bytes_dense": out["bytes_dense"],
        }
    dropped = _RESIDUALS if rank >= len(saved) else _OF_THE_WORLD
    for mode, keys in dropped.items():
        if mode in out:
            out[mode] = {**out[mode], **{k: {} for k in keys}}
    return out


@dataclass
class EBState:
    codec: Codec
    eb: float  # relative to each bucket's range
    collective: str = "allgather"  # or "rsag" (module docstring)
    residual: dict[int, torch.Tensor] = field(default_factory=dict)  # per parameter
    #: rsag: what coding the mean of this rank's chunks lost, per parameter (zeros where
    #: another rank owns the chunk)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    param_index: dict[int, int] = field(default_factory=dict)  # id(param) -> position
    #: rsag: each bucket layout's positions per owner (:func:`_owned_positions`), made once
    owned: dict[tuple[int, ...], list[torch.Tensor]] = field(default_factory=dict)


def register(
    ddp: Any,
    mode: str,
    world: int,
    group: Any = None,
    plain: Callable[[], bool] | None = None,
    **opts: Any,
) -> DPComm:
    """Install ``mode``'s hook on a DistributedDataParallel module whose process group is
    ``group`` (see :attr:`DPComm.group`); return its state. ``plain``: whether a step goes
    plain (``--compress auto``).

    opts: ``powersgd_rank``, ``powersgd_warmup`` (powersgd), ``dct_keep``, ``dct_refresh``
    (dct), ``codec``, ``eb``, ``collective`` (eb)."""
    if mode not in DP_MODES:
        raise ValueError(f"--dp-comm {mode!r} is not one of: {', '.join(DP_MODES)}")
    dp = DPComm(mode, world, group=group, plain=plain)
    if mode == "dct":
        dp.inner = DCTState(world, opts["dct_keep"], opts["dct_refresh"], group=group)
        ddp.register_comm_hook(dp, _dct)
        return dp
    if mode == "powersgd":
        dp.inner = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=opts["powersgd_rank"],
            start_powerSGD_iter=opts["powersgd_warmup"],
            min_compression_rate=dp.powersgd_min_rate,
        )
    if mode == "eb":
        dp.inner = EBState(opts["codec"], opts["eb"], opts.get("collective", "allgather"))
    ddp.register_comm_hook(dp, _hook)
    return dp


def _dct(dp: DPComm, bucket):
    """DCT-DP, with its counters mirrored into ``dp``. (No annotations: DDP checks them.)"""
    fut = dct_hook(dp.inner, bucket)
    dp.seconds, dp.bytes_sent, dp.bytes_dense = (
        dp.inner.seconds,
        dp.inner.bytes_sent,
        dp.inner.bytes_dense,
    )
    return fut


def _hook(dp: DPComm, bucket):
    """Every mode but dct: start the exchange, count it, time it to completion.
    (No annotations: DDP checks them by identity, which string annotations fail.)"""
    t = time.perf_counter()
    grad = bucket.buffer()
    dp.bytes_dense += dp.ring_bytes(grad.numel(), 4)
    plain = dp.mode in SWITCHED and dp.plain is not None and dp.plain()
    if plain and dp.mode == "eb":
        grad = _flushed(dp, bucket)
    if dp.mode == "allreduce" or plain:
        dp.bytes_sent += dp.ring_bytes(grad.numel(), grad.element_size())
        fut = dist.all_reduce(grad, group=dp.group, async_op=True).get_future()
        fut = fut.then(lambda f: f.value()[0].div_(dp.world))
    elif dp.mode in ("fp16", "bf16"):
        dp.bytes_sent += dp.ring_bytes(grad.numel(), 2)
        cast = (
            default_hooks.fp16_compress_hook
            if dp.mode == "fp16"
            else default_hooks.bf16_compress_hook
        )
        fut = cast(dp.group, bucket)
    elif dp.mode == "powersgd":
        dp.bytes_sent += _powersgd_bytes(dp, bucket)
        fut = powerSGD_hook.powerSGD_hook(dp.inner, bucket)
    else:
        fut = _eb_exchange(dp, bucket)

    def done(f: torch.futures.Future) -> torch.Tensor:
        dp.seconds += time.perf_counter() - t
        return f.value()

    return fut.then(done)


def _powersgd_bytes(dp: DPComm, bucket: Any) -> int:
    """What powerSGD_hook sends for this bucket: the whole bucket before its start
    iteration; after, P and Q (n + m) r for each matrix it compresses, the rest as is."""
    st = dp.inner
    if st.iter < st.start_powerSGD_iter:
        return dp.ring_bytes(bucket.buffer().numel(), 4)
    r, n = st.matrix_approximation_rank, 0
    for g in bucket.gradients():
        rows, cols = (g.shape[0], g.numel() // g.shape[0]) if g.dim() > 1 else (1, g.numel())
        compressed = g.dim() > 1 and rows * cols >= dp.powersgd_min_rate * (rows + cols) * r
        n += (rows + cols) * min(r, rows, cols) if compressed else g.numel()
    return dp.ring_bytes(n, 4)


def _eb_exchange(dp: DPComm, bucket: Any) -> torch.futures.Future:
    st: EBState = dp.inner
    grad = bucket.buffer()
    keys, sizes = bucket_params(st.param_index, bucket, "eb hook")
    acc = add_residual(grad, st.residual, keys, sizes)
    # Every payload's checks are read once, when the bucket is done (or with a sizes read
    # that comes first): on a GPU two host reads a bucket, its payload's size and the checks.
    checks = HeldChecks()
    with checks.holding("eb hook"), riding(checks):
        if st.collective == "rsag" and dp.world > 1:
            out = _reduce_scatter_gather(dp, acc, keys, sizes)
        else:
            payload, mine = _code(st, acc)
            keep_residual(st.residual, keys, sizes, acc - mine)  # what was lost, sent later
            if dp.world == 1:
                out = mine.clone()
            else:
                out = torch.zeros_like(grad)
                me = dist.get_rank(dp.group)
                got, sent = all_gather_ragged([payload], dp.world, dp.group)
                dp.bytes_sent += sent
                for r, (p,) in enumerate(got):
                    out += mine if r == me else _decoded(st, p, grad)
    checks.read()
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out.div_(dp.world))
    return fut


def _flushed(dp: DPComm, bucket: Any) -> torch.Tensor:
    """The bucket's gradient with everything error feedback holds for it (the residual of
    this rank's payload, and rsag's of the sums of chunks it coded), which is then
    cleared."""
    st: EBState = dp.inner
    grad = bucket.buffer()
    keys, sizes = bucket_params(st.param_index, bucket, "eb hook")
    acc = add_residual(add_residual(grad, st.residual, keys, sizes), st.reduced, keys, sizes)
    for held in (st.residual, st.reduced):
        for k in keys:
            held.pop(k, None)
    return acc


#: The eb hook codes a bucket as rows of this many values (a GPU's coder takes the row
#: width as a kernel constant: a bucket is never one row of a million values), padded with
#: copies of its first value, which leave the range the relative bound is taken from as it is.
EB_ROW = 64


def _code(st: EBState, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat) coded under the relative bound (computed where x is), and what the
    payload decodes to."""
    flat = x.detach().reshape(-1)
    rows = torch.cat([flat, flat[:1].expand(-flat.numel() % EB_ROW)]).view(-1, EB_ROW)
    ebs = absolute_bounds([st.eb], "rel", rows.unsqueeze(0)) if st.codec.error_bounded else None
    (payload,), _ = st.codec.encode_segments([(rows, [len(rows)])], ebs)
    return payload, _decoded(st, payload, x)


def _decoded(st: EBState, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A payload of :func:`_code` back as ``like``'s flat values (the padding dropped);
    its layout follows from ``like``'s size, so nothing of it is read on the host first."""
    rows = -(-like.numel() // EB_ROW)
    (y,) = st.codec.decode_segments([payload], [[rows]], EB_ROW)
    return y.reshape(-1)[: like.numel()].to(like.device, like.dtype)


def _reduce_scatter_gather(
    dp: DPComm, acc: torch.Tensor, keys: list[int], sizes: list[int]
) -> torch.Tensor:
    """The sum over ranks of ``acc`` by rsag (module docstring), the same on every rank.

    Rank j owns the j-th of W near-equal pieces of every parameter, so who owns an
    element does not depend on DDP's bucket layout (which it rebuilds after the first
    step, and a resumed run starts from the first one), and neither do the owners'
    residuals or the set of values each chunk's bound is taken from.
    """
    st: EBState = dp.inner
    me = dist.get_rank(dp.group)
    if tuple(sizes) not in st.owned:
        st.owned[tuple(sizes)] = _owned_positions(sizes, dp.world, acc.device)
    at = st.owned[tuple(sizes)]
    coded = [_code(st, acc[idx]) for idx in at]
    sent = torch.empty_like(acc)
    for idx, (_, y) in zip(at, coded, strict=True):
        sent[idx] = y
    keep_residual(st.residual, keys, sizes, acc - sent)
    bufs = start_all_to_all_bytes([[p] for p, _ in coded], dp.world, dp.group).wait()
    dp.bytes_sent += sum(p.numel() + 8 for r, (p, _) in enumerate(coded) if r != me)
    # Chunk ``me`` of every rank, summed in rank order, and what was lost coding it before.
    total = torch.zeros_like(coded[me][1])
    for r, b in enumerate(bufs):
        total += coded[me][1] if r == me else _decoded(st, b, coded[me][1])
    total += add_residual(torch.zeros_like(acc), st.reduced, keys, sizes)[at[me]]
    payload, back = _code(st, total)
    lost = torch.zeros_like(acc)
    lost[at[me]] = total - back
    keep_residual(st.reduced, keys, sizes, lost)
    got, nbytes = all_gather_ragged([payload], dp.world, dp.group)
    dp.bytes_sent += nbytes
    out = torch.empty_like(acc)
    for r, (p,) in enumerate(got):
        out[at[r]] = back if r == me else _decoded(st, p, acc[at[r]])
    return out


def _owned_positions(sizes: list[int], world: int, device: torch.device) -> list[torch.Tensor]:
    """Per rank, its positions in a bucket of parameters ``sizes`` long: the rank-th of
    ``world`` near-equal pieces of each parameter."""
    starts = [0, *itertools.accumulate(sizes)][:-1]
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for start, n in zip(starts, sizes, strict=True):
        for r, piece in enumerate(
            torch.arange(start, start + n, device=device).tensor_split(world)
        ):
            per_rank[r].append(piece)
    return [torch.cat(p) for p in per_rank]
