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
  With ``hosts`` (several hosts of as many ranks each: torchrun's nodes) only coded bytes
  cross hosts: the bucket is summed within each host plain (an all-reduce, over NVLink or
  shared memory), each rank codes its piece (its index on its host) of the host's sum
  (error feedback on what that coding lost) and all-gathers it with the ranks of its index
  on the other hosts, and the summed pieces are all-gathered within the host: a rank sends
  (hosts - 1) payloads of 1/(ranks a host) of the bucket between hosts, every rank ends with
  the same sum (within the sum of the hosts' bounds), and one host is the plain all-reduce.

Every hook counts its seconds (launch to completion) and the bytes this rank puts on the
wire (``bytes_sent``) beside what a ring all-reduce of fp32 would (``bytes_dense``).

With ``--compress auto`` (:mod:`recsz.comm.switch`) the steps the switch sends plain take
DDP's fp32 all-reduce instead of ``fp16``, ``bf16`` or ``eb`` (whose residuals join that
step's gradient, so nothing error feedback held back is lost); PowerSGD and DCT-DP keep
their own schedules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from recsz.comm import dp_eb
from recsz.comm.dct_dp import DCTState, dct_hook
from recsz.comm.dp_eb import EBState, host_groups
from recsz.comm.route import host_of

DP_MODES = ("allreduce", "fp16", "bf16", "powersgd", "dct", "eb")
#: the modes a step the switch sends plain turns into the all-reduce
SWITCHED = ("fp16", "bf16", "eb")
EB_COLLECTIVES = ("allgather", "rsag", "hosts")


@dataclass
class DPComm:
    """The hook's state and counters for the reports and checkpoints."""

    mode: str
    world: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_dense: int = 0
    #: eb: of ``bytes_sent``, the payload bytes delivered to ranks on other hosts (each
    #: piece counted once a rank that receives it, as the embedding exchange's; None:
    #: not counted, the other modes)
    bytes_between: int | None = None
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
        out["bytes_dense"], out["bytes_between"] = self.bytes_dense, self.bytes_between
        if isinstance(self.inner, DCTState):
            keys = ("step", "residual", "threshold", "refreshed_at", "refreshes")
            out["dct"] = {k: getattr(self.inner, k) for k in (*keys, "bytes_dense", "bytes_sent")}
        elif isinstance(self.inner, EBState):
            st = self.inner
            out["eb"] = {
                "residual": st.residual,
                "reduced": st.reduced,
                "collective": st.collective,
            }
        elif isinstance(self.inner, powerSGD_hook.PowerSGDState):
            out["powersgd"] = {k: getattr(self.inner, k) for k in _POWERSGD_KEYS}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seconds, self.bytes_sent = state["seconds"], state["bytes_sent"]
        self.bytes_dense = state["bytes_dense"]
        if self.bytes_between is not None:  # (counted since 2026-12)
            self.bytes_between = state.get("bytes_between") or 0
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
    loses it, and the reduce-scatter's, cut by the world's size, starts anew; the hosts
    collective's, summed in wherever it lies, stays)."""
    own = saved[rank % len(saved)]
    out = {**own, "bytes_sent": 0, "bytes_dense": 0, "bytes_between": 0}
    for s in saved[rank::world]:
        out["bytes_sent"] += s["bytes_sent"]
        out["bytes_dense"] += s["bytes_dense"]
        out["bytes_between"] += s.get("bytes_between") or 0
    if "dct" in out:  # its hook keeps the counters (DPComm's mirror them)
        out["dct"] = {
            **out["dct"],
            "bytes_sent": out["bytes_sent"],
            "bytes_dense": out["bytes_dense"],
        }
    hosts = out.get("eb", {}).get("collective") == "hosts"  # (saved since 2026-12-07)
    dropped = _RESIDUALS if rank >= len(saved) else {} if hosts else _OF_THE_WORLD
    for mode, keys in dropped.items():
        if mode in out:
            out[mode] = {**out[mode], **{k: {} for k in keys}}
    return out


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
    (dct), ``codec``, ``eb``, ``collective``, ``hosts`` (eb: each host's ranks)."""
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
        hosts = opts.get("hosts") or [tuple(range(world))]
        if world > 1:
            dp.inner.near = frozenset(host_of(hosts, dist.get_rank()))
            dp.bytes_between = 0
        if dp.inner.collective == "hosts" and world > 1:
            dp.inner.hosts = host_groups(hosts, dist.get_rank())
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
        grad = dp_eb.flushed(dp, bucket)
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
        fut = dp_eb.exchange(dp, bucket)

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
