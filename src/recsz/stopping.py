"""Stopping a run that is asked to stop (SIGTERM: a scheduler preempting the job, torchrun's
agent passing on its own SIGTERM), at a step every rank agrees on, so that the run can save a
checkpoint there and be resumed instead of losing the steps since the last one.

A signal reaches the ranks at slightly different moments, perhaps in different steps. Each
rank notes it in its handler; after every step the ranks combine their notes in an
all-reduce (MAX) started then and read after the next step, so it runs while that step does
(on a GPU it is a gloo collective of a CPU tensor: no host sync). All ranks read the same
result after the same step, and stop there. A rank blocked by a peer that died does not wait
for this: the collective fails as the peer's connection closes, and the rank with it.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

#: What the asked-to-stop process exits with: a shell's status of a process SIGTERM ended.
EXIT_STATUS = 128 + signal.SIGTERM


class Stopping:
    """SIGTERM noted in this process from its making until :meth:`close` (which restores
    the handler before it), and the step at which every rank has seen it (:meth:`agreed`)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.asked = False
        self._sum = torch.zeros(1, dtype=torch.int32)
        self._pending: Any = None  # the all-reduce started after the last step
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, _sig: int, _frame: FrameType | None) -> None:
        self.asked = True

    def agreed(self) -> bool:
        """Called by every rank after every step: whether the run stops here. With several
        ranks, whether any rank had been asked by the step before this one."""
        if self.world == 1:
            return self.asked
        seen = False
        if self._pending is not None:
            self._pending.wait()
            seen = bool(self._sum.item())
        self._sum = torch.tensor([int(self.asked)], dtype=torch.int32)
        self._pending = dist.all_reduce(self._sum, op=dist.ReduceOp.MAX, async_op=True)
        return seen

    def close(self, ok: bool) -> None:
        """Restore the handler; after a run that ended well, complete the last all-reduce
        (every rank started it: the group's collectives stay matched)."""
        signal.signal(signal.SIGTERM, self._previous)
        pending, self._pending = self._pending, None
        if ok and pending is not None:
            pending.wait()
