"""The learning rates' schedule: the reference DLRM's (facebookresearch/dlrm's
``LRPolicyScheduler``, MLPerf's DLRM recipes): a linear warm-up, a constant stretch, and a
polynomial decay, the same factor for every optimizer of the model at once (the MLPs', the
tables' row optimizer, TT-Rec's cores).

With ``warmup`` W, ``decay_start`` S, ``decay_steps`` D and ``power`` P, step k (from 0)
trains at the rate times

    (k + 1) / W                        k < W (the first step at 1/W of the rate)
    ((S + D - k) / D) ** P             S <= k < S + D (from the whole rate down to (1/D)**P)
    (1 / D) ** P                       k >= S + D (where the decay ended)
    1                                  otherwise (no warm-up, no decay: the constant rate)

A factor is a function of the step alone, so a resumed run trains at the rates the straight
one would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recsz.model.rowopt import RowOptimizer


@dataclass(frozen=True)
class LRSchedule:
    warmup: int = 0
    decay_start: int = 0
    decay_steps: int = 0
    power: float = 2.0

    def __post_init__(self) -> None:
        if min(self.warmup, self.decay_start, self.decay_steps) < 0 or not self.power > 0:
            raise ValueError(f"{self}: steps must be >= 0 and the power > 0")
        if self.decay_steps and self.decay_start < self.warmup:
            raise ValueError(
                f"the decay starts at step {self.decay_start}, before the warm-up's "
                f"{self.warmup} steps end"
            )

    @property
    def constant(self) -> bool:
        return not self.warmup and not self.decay_steps

    def factor(self, step: int) -> float:
        """What step ``step`` (from 0) multiplies every learning rate by."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay_steps and step >= self.decay_start:
            left = max(self.decay_start + self.decay_steps - step, 1)
            return float((left / self.decay_steps) ** self.power)
        return 1.0


class ScheduledRates:
    """Sets the rates of ``rows`` (the tables' row optimizer, one object shared by every
    table kind) and of ``optimizers`` (torch's) to their rates when made, times the
    schedule's factor of a step; made before a checkpoint's optimizer states are loaded
    (which hold the rates of the step they were saved at)."""

    def __init__(
        self,
        schedule: LRSchedule,
        rows: RowOptimizer | None,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        self.schedule = schedule
        self.rows = rows
        self.optimizers = list(optimizers)
        self._row_lr = rows.lr if rows is not None else 0.0
        self._lrs = [[float(g["lr"]) for g in o.param_groups] for o in self.optimizers]

    def at(self, step: int) -> float:
        """Every rate for step ``step``; returns the factor."""
        f = self.schedule.factor(step)
        if self.rows is not None:
            self.rows.lr = self._row_lr * f
        for opt, lrs in zip(self.optimizers, self._lrs, strict=True):
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                group["lr"] = lr * f
        return f
