"""Stopping a run that is asked to stop (SIGTERM: a scheduler preempting the job, torchrun's
agent passing on its own SIGTERM; SIGINT: Ctrl-C, passed on by the launcher), at a step every
rank agrees on, so that the run can save a checkpoint there and be resumed instead of losing
the steps since the last one. SIGINT again, later than :data:`ECHO_S` after the first (an
impatient second Ctrl-C, not the first passed on once more by torchrun's agent), raises
KeyboardInterrupt at once: no checkpoint.

A signal reaches the ranks at slightly different moments, perhaps in different steps. Each
rank notes it in its handler; after every step the ranks combine their notes in an
all-reduce (MAX) started then and read after the next step, so it runs while that step does
(on a GPU it is a gloo collective of a CPU tensor: no host sync). All ranks read the same
result after the same step, and stop there. An evaluation asks the same after each of its
batches (:meth:`heard`): asked during one, the run ends it there and saves the step it
evaluated, which the same command line again evaluates first.

A rank whose peer died may never reach its next step: a gloo collective fails as the peer's
connection closes, but one over NCCL, or with a host gone from the network, waits until
``--dist-timeout``, and a Python handler runs only between the main thread's calls. So a
thread watches for the signal (Python's wakeup fd) and, if the main thread then sits in one
call for :data:`STUCK_S` without reaching the agreement, names the call and exits at once
without a checkpoint (the job goes on from the last one), as SIGTERM's default would have,
instead of ignoring the signal until the launcher's SIGKILL (torchrun's: 30 s later). It
also ends at once an evaluation of a step whose checkpoint is complete (:meth:`busy`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

#: The signals that ask a run to stop; the process then exits with a shell's status of a
#: process the signal ended (128 + its number; SIGTERM's wins where ranks saw both).
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def heeded() -> list[signal.Signals]:
    """Those of :data:`SIGNALS` this process takes: one ignored as it started stays so (a
    shell's background job's SIGINT, which its terminal's Ctrl-C is not meant for)."""
    return [sig for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]


#: Seconds within which a second SIGINT is the first one again (a terminal's Ctrl-C reaches
#: every process of a plain torchrun's job, and its agent passes it on too).
ECHO_S = 1.0
#: Seconds a rank asked to stop may sit in one call (the same frame at the same instruction,
#: no step ended) before it is taken to wait on a peer that is gone; or 3 times its longest
#: step yet, if longer (a wait for a slow peer's step). The job's own long calls are exempt
#: (:meth:`Stopping.busy`: a checkpoint's write, an evaluation).
STUCK_S = 10.0
STEPS_LONG = 3
_POLL_S = 0.25


class Stopping:
    """SIGTERM or SIGINT noted in this process from its making until :meth:`close` (which
    restores the handlers before it), and the step at which every rank has seen one
    (:meth:`agreed`; :attr:`by`: the signal they stop by)."""

    def __init__(self, world: int, rank: int = 0) -> None:
        self.world, self.rank = world, rank
        self.asked = 0  # the signal noted (SIGTERM's number where both were), 0: none
        self.by = 0  # the signal the ranks agreed to stop by
        self._first_int: float | None = None  # when the first SIGINT came
        self._steps = 0  # agreements reached, the main thread's sign of life
        self._last: float | None = None  # when the last was
        self._longest = 0.0  # the longest time between two
        self._stopping = False  # the main thread has seen the stop: it saves, let it be
        self._busy = 0  # inside busy(): a long call of the job's own, let it be
        self._saved: int | None = None  # busy() on what this checkpoint step holds
        self._sum = torch.zeros(1, dtype=torch.int32)
        self._pending: Any = None  # the all-reduce started after the last step
        self._previous = {sig: signal.signal(sig, self._note) for sig in heeded()}
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = os.pipe()
        os.set_blocking(self._wakeup[1], False)  # (the signal's write never blocks)
        previous_fd = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
        if previous_fd != -1:  # another's (an event loop's): leave it, watch nothing
            signal.set_wakeup_fd(previous_fd)
            self._close_wakeup()
            return
        self._watcher = threading.Thread(
            target=self._watch, args=(threading.get_ident(),), name="recsz-sigterm", daemon=True
        )
        self._watcher.start()

    @contextlib.contextmanager
    def busy(self, saved: int | None = None) -> Iterator[None]:
        """Work of the job's own whose single calls may be long: a checkpoint's write (or
        the wait for one), an evaluation (rank 0's metrics of a large held-out set, its
        peers waiting for them); no sign of a peer gone, so the watcher leaves it be.
        ``saved``: the step of a complete checkpoint that holds the state this work reads
        (an evaluation of that step): SIGTERM ends it at once, since the run's command line
        again does it from there."""
        self._busy += 1
        outer, self._saved = self._saved, saved if saved is not None else self._saved
        try:
            yield
        finally:
            self._busy -= 1
            self._saved = outer

    def _note(self, sig: int, _frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            now = time.monotonic()
            if self._first_int is None:
                self._first_int = now
            elif now - self._first_int > ECHO_S:  # Ctrl-C again: now, no checkpoint
                raise KeyboardInterrupt
        self.asked = max(self.asked, sig)

    def _watch(self, main: int) -> None:
        """Wait for a signal's byte (SIGTERM's, SIGINT's) on the wakeup fd; then, while the
        main thread has not seen the stop, exit if it stays in one call for :data:`STUCK_S`
        (or :data:`STEPS_LONG` times its longest step)."""
        assert self._wakeup is not None
        while True:
            got = os.read(self._wakeup[0], 64)
            if not got:  # closed: the run ended
                return
            if any(sig in got for sig in SIGNALS):
                break
        place, since, steps = None, time.monotonic(), self._steps
        sig = max(s for s in SIGNALS if s in got)  # (the handler has not run: no ``asked``)
        name = signal.Signals(sig).name
        while not self._closed.wait(_POLL_S) and not self._stopping:
            if (saved := self._saved) is not None:
                print(f"recsz: rank {self.rank}: asked to stop ({name}) while it evaluates "
                      f"step {saved}, whose checkpoint is complete: exiting now (the same "
                      "command line again evaluates it)", file=sys.stderr, flush=True)  # fmt: skip
                os._exit(128 + sig)
            frame = sys._current_frames().get(main)
            if frame is None:
                return
            if (frame, frame.f_lasti) != place or self._steps != steps or self._busy:
                place, since, steps = (frame, frame.f_lasti), time.monotonic(), self._steps
            elif time.monotonic() - since >= (held := max(STUCK_S, STEPS_LONG * self._longest)):
                code = frame.f_code
                print(f"recsz: rank {self.rank}: asked to stop ({name}), but held "
                      f"{held:.0f} s in one call, {code.co_filename}:{frame.f_lineno} "
                      f"({code.co_name}): a collective whose peer is gone? Exiting without a "
                      "checkpoint (the job goes on from its last one)", file=sys.stderr,
                      flush=True)  # fmt: skip
                os._exit(128 + sig)

    def _close_wakeup(self) -> None:
        if self._wakeup is not None:
            os.close(self._wakeup[1])  # the watcher's read ends (or its wait: _closed)
            if self._watcher is not None:
                self._watcher.join()
            os.close(self._wakeup[0])
            self._wakeup = None

    def agreed(self, began: float | None = None) -> bool:
        """Called by every rank after every step: whether the run stops here. With several
        ranks, whether any rank had been asked by the step before this one. ``began``: when
        the step began (``time.monotonic()``; else the last call's time), so that an
        evaluation or a checkpoint between steps does not count as one."""
        self._steps += 1
        now = time.monotonic()
        began = began if began is not None else self._last
        if began is not None:
            self._longest = max(self._longest, now - began)
        self._last = now
        return self._combined()

    def heard(self) -> bool:
        """Called by every rank after every batch of an evaluation: whether it ends there,
        as :meth:`agreed` says after a step (no step counted), so that a run asked to stop
        during a long evaluation saves its checkpoint at once instead of after it (or
        never: torchrun's SIGKILL comes 30 s after its SIGTERM)."""
        return self._combined()

    def _combined(self) -> bool:
        """Whether any rank had been asked by the last call before this one (one rank: by
        this one); the ranks' notes of this call combined in the background."""
        if self.world == 1:
            self.by = self.asked
            self._stopping = bool(self.by)
            return self._stopping
        seen = False
        if self._pending is not None:
            self._pending.wait()
            self.by = int(self._sum.item())
            seen = self._stopping = bool(self.by)
        self._sum = torch.tensor([self.asked], dtype=torch.int32)
        self._pending = dist.all_reduce(self._sum, op=dist.ReduceOp.MAX, async_op=True)
        return seen

    def close(self, ok: bool) -> None:
        """Restore the handler; after a run that ended well, complete the last all-reduce
        (every rank started it: the group's collectives stay matched)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
        self._closed.set()
        self._close_wakeup()
        pending, self._pending = self._pending, None
        if ok and pending is not None:
            pending.wait()
