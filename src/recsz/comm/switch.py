"""Compression where it pays: whether a step's embedding exchange goes through the codecs or
plain, chosen from measured step times.

On a fast link the codecs' time can exceed the bytes' time they save (2 CPU ranks on
loopback: our sharder at 0.81x TorchRec's fp32 exchange); on a slow one they win several
times over. ``--compress auto`` tries both: a trial alternates the two ways step by step
(compressed first), times each step from its start to the next step's start, and keeps the
way whose median step is shorter until the next trial, ``every`` steps after this one's
first (links and loads change); each trial that keeps the way chosen before doubles that gap,
up to ``BACKOFF`` times ``every`` (a steady link pays for fewer trials: on a slow one a plain
step costs several compressed ones), and one that changes it brings the gap back to
``every``. The first trial opens with ``warmup`` untimed steps each way (first calls:
compilation, caches). A trial ends after ``trial`` timed steps each way,
or from the second on as soon as the ways stand clearly apart (every step of one at least
``CLEAR`` times every step of the other): on a slow link a plain step can cost several
compressed ones, so a trial there costs two of them, not ``trial``. The first trial waits
for ``lead`` compressed steps: the bound policies' first probe window, whose steps cost the
codecs' side more than later ones (on the CPU its sorts took 2x a step of 4 sequence
features), would otherwise be timed against the plain way and bias the choice (measured:
TorchRec's int8 comms chosen over our codecs at 1 Gbit/s, 0.69x the speed).

Every rank decides alike: at each point where a trial may end (fixed steps, the same on
every rank) the ranks' figures are combined by ``agree`` (their maximum: a step lasts as
long as its slowest rank). Ties go to the plain exchange, which loses nothing.

The exchange asks :meth:`CompressionSwitch.compress` at each training step, in step order;
a step asked again gets its first answer and times nothing (several exchanges of one step
share a switch: TorchRec's sharded modules of one model, a pipeline's input dist a batch
ahead of another module's). Evaluation steps read :attr:`CompressionSwitch.chosen`
(:meth:`pause` first, so that the time between two training steps around an evaluation is
not counted).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

COMPRESS_MODES = ("always", "auto")
#: ways stand clearly apart when every step of one lasts this many times every step of
#: the other's (the ranks' extremes)
CLEAR = 1.25
#: timed steps each way before a trial may end early
EARLIEST = 2
#: the longest gap between trials, in ``every``s (while trials keep choosing one way)
BACKOFF = 8
#: the latest steps whose ways a repeated ask gets
RECENT = 4


@dataclass
class CompressionSwitch:
    """Whether each training step compresses (module docstring).

    Args:
        mode: "always" (every step compresses) or "auto" (trials choose).
        trial: timed steps of each way in a trial, at most.
        every: steps from one trial's first step to the next's (0: one trial); doubled
            while trials keep the way, up to ``BACKOFF`` times.
        warmup: untimed steps of each way opening the first trial.
        lead: compressed steps before the first trial (the probe window's).
        agree: the ranks' element-wise maximum of a small float64 tensor (None: one rank).
        sync: waits for the device's queued work before each timing (a GPU, whose host
            runs ahead of it where no size is read).
        clock: seconds, monotonic.
    """

    mode: str = "always"
    trial: int = 6
    every: int = 500
    warmup: int = 2
    lead: int = 0
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None
    sync: Callable[[], None] | None = None
    clock: Callable[[], float] = time.perf_counter
    #: the way steps outside a trial go: compressed (True) or plain
    chosen: bool = True
    #: the way of the last training step asked
    current: bool = True
    #: each trial's outcome: its first step, the ranks' median step (s) each way, the
    #: timed steps each way, the choice
    trials: list[dict[str, Any]] = field(default_factory=list)
    #: training steps asked so far: compressed, plain
    steps: dict[str, int] = field(default_factory=lambda: {"compressed": 0, "plain": 0})
    _start: int | None = None  # the current (or last) trial's first step
    _untimed: int = 0  # the current trial's untimed steps each way
    _trying: bool = False
    _last: tuple[int, bool, float] | None = None  # the last step asked: step, way, its start
    _gap: int = 0  # steps from the current (or last) trial's first to the next's
    _times: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    _ways: dict[int, bool] = field(default_factory=dict)  # the latest steps' ways
    _lead_left: int = 0  # the lead's steps still to go (compressed, untimed)

    def __post_init__(self) -> None:
        if self.mode not in COMPRESS_MODES:
            raise ValueError(f"compress mode {self.mode!r}: one of {', '.join(COMPRESS_MODES)}")
        if self.trial < 1 or self.warmup < 0 or self.lead < 0:
            raise ValueError(
                f"a trial needs trial >= 1, warmup >= 0, lead >= 0 (got {self.trial}, "
                f"{self.warmup}, {self.lead})"
            )
        self._gap, self._lead_left = self.every, self.lead
        if self.mode == "auto" and self.every and self.every < self.length:  # (always: idle)
            raise ValueError(
                f"trials every {self.every} steps (--compress-every) cannot hold a trial of "
                f"{self.length} steps ({self.warmup} untimed and {self.trial} timed "
                f"(--compress-trial) each way): every {self.length} or more, or a shorter trial"
            )

    @property
    def length(self) -> int:
        """Steps of the longest trial (the first), both ways."""
        return 2 * (self.warmup + self.trial)

    def compress(self, step: int) -> bool:
        """Whether training step ``step`` compresses; asked at each step, in order (a step
        asked again, among the ``RECENT`` latest, gets its first answer)."""
        way = self._ways.get(step)
        if way is not None:
            return way
        way = True if self.mode == "always" else self._ask(step)
        self._ways[step], self.current = way, way
        if len(self._ways) > RECENT:
            del self._ways[min(self._ways)]
        self.steps["compressed" if way else "plain"] += 1
        return way

    def _ask(self, step: int) -> bool:
        """The trials' way for a step asked the first time (times the step before)."""
        if self._lead_left:  # compressed, until the lead is over
            self._lead_left -= 1
            return True
        if self._start is None or step < self._start:  # the first step seen, or a rewind
            self._begin(step, self.warmup if self._start is None else 0)
        assert self._start is not None
        last = self._last
        if self._trying and last is not None and last[0] + 1 == step and self._timed(last[0]):
            self._wait()
            self._times[last[1]].append(self.clock() - last[2])
            if not last[1]:  # a pair of timed steps is complete: the trial may end here
                self._weigh()
        if not self._trying and self.every and step - self._start >= self._gap:
            self._begin(step, 0)
        way = (step - self._start) % 2 == 0 if self._trying else self.chosen
        if self._trying:
            self._wait()  # a trial's step starts on an idle device
        self._last = (step, way, self.clock())
        return way

    def pause(self) -> None:
        """The next training step does not time the one before (an evaluation between)."""
        self._last = None

    def _wait(self) -> None:
        if self.sync is not None:
            self.sync()

    def _begin(self, step: int, untimed: int) -> None:
        self._start, self._untimed, self._trying = step, untimed, True
        self._times = {True: [], False: []}

    def _timed(self, step: int) -> bool:
        """Whether ``step`` is one of the current trial's timed steps."""
        assert self._start is not None
        return step - self._start >= 2 * self._untimed

    def _weigh(self) -> None:
        """After a pair of timed steps (each rank at the same step): the ranks' figures,
        and the trial's end where it has timed ``trial`` pairs or the ways stand apart."""
        pairs = len(self._times[False])
        if pairs < min(EARLIEST, self.trial):
            return
        c, p = self._times[True], self._times[False]
        mine = [statistics.median(c), statistics.median(p), max(c), max(p), -min(c), -min(p)]
        got = torch.tensor(mine, dtype=torch.float64)
        med_c, med_p, max_c, max_p, neg_min_c, neg_min_p = (
            self.agree(got) if self.agree is not None else got
        ).tolist()
        apart = -neg_min_p >= CLEAR * max_c or -neg_min_c >= CLEAR * max_p
        if pairs < self.trial and not apart:
            return
        compress = med_c < med_p
        kept = bool(self.trials) and compress == self.chosen  # the last trial's choice
        self._gap = min(2 * self._gap, BACKOFF * self.every) if kept else self.every
        self.chosen, self._trying = compress, False
        self.trials.append(
            {
                "step": self._start,
                "compressed_s": med_c,
                "plain_s": med_p,
                "timed": pairs,
                "compress": self.chosen,
            }
        )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the way chosen, the trials, the steps each way and the
        schedule (the next trial's step, the backoff's gap)."""
        return {
            "chosen": self.chosen,
            "trials": list(self.trials),
            "steps": dict(self.steps),
            "start": self._start,
            "gap": self._gap,
            "trying": self._trying,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s state: the next trial where the saved run's
        would have come; a trial under way at the save starts again (warm-up included) at the
        first step asked, its timings gone with the process that took them."""
        self.chosen = self.current = bool(saved["chosen"])
        self.trials, self.steps = list(saved["trials"]), dict(saved["steps"])
        self._gap, self._trying, self._last = int(saved["gap"]), False, None
        self._start = None if saved["trying"] else saved["start"]
        self._lead_left = self.lead if saved["start"] is None else 0  # (no trial yet)
        self._ways.clear()

    def state(self) -> dict[str, Any]:
        """What a report shows: the mode, the way chosen, the trials so far, the steps each
        way."""
        return {
            "mode": self.mode,
            "compress": self.chosen,
            "trials": list(self.trials),
            "steps": dict(self.steps),
        }


def max_over(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The ranks' element-wise maximum over ``group`` (None: the default group), on the
    device its backend takes (NCCL: this process's GPU); None with one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    nccl = dist.get_backend(group) == "nccl"

    def agree(x: torch.Tensor) -> torch.Tensor:
        y = x.to(f"cuda:{torch.cuda.current_device()}") if nccl else x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
        return y.cpu()

    return agree


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """What waits for ``device``'s queued work (None: a CPU, which runs in order)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)
