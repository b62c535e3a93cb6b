"""The threshold policy of DCT-MP (Gupta et al., KDD 2021): a hard threshold per table.

The threshold is the magnitude that keeps the target fraction of a table's entries (the
top-k by magnitude), recomputed only every ``refresh`` iterations — the paper refreshes
"once every few thousand iterations" to keep its cost off the critical path — and used
as-is in between, so the kept fraction drifts as values change.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from recsz.codecs.payload import upload
from recsz.policy.base import MIN_ABS_BOUND, BoundPolicy


def topk_threshold(x: torch.Tensor, keep: float) -> float:
    """Smallest magnitude among the ceil(keep * n) largest |x| (keep everything at 1.0)."""
    a = x.detach().abs().reshape(-1)
    a = a[torch.isfinite(a)]
    if a.numel() == 0:
        return MIN_ABS_BOUND
    k = max(1, min(a.numel(), int(-(-keep * a.numel() // 1))))
    thr = float(torch.topk(a, k, sorted=False).values.min())
    return max(thr, MIN_ABS_BOUND) if keep < 1.0 else MIN_ABS_BOUND


class DCTThreshold(BoundPolicy):
    """Per-table hard threshold, refreshed every ``refresh`` iterations."""

    name = "dct"
    TABLE_STATE = ("thresholds", "refreshed_at")

    def __init__(self, keep: float, refresh: int) -> None:
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"--dct-keep must be in (0, 1], got {keep}")
        if refresh < 1:
            raise ValueError(f"--dct-refresh must be >= 1, got {refresh}")
        self.keep = keep
        self.refresh = refresh
        self.thresholds: dict[int, float] = {}
        self.refreshed_at: dict[int, int] = {}

    def bounds(self, tables: list[int], step: int, x: torch.Tensor) -> torch.Tensor | None:
        for j, t in enumerate(tables):  # the refresh reads the values on the host
            if t not in self.thresholds or step - self.refreshed_at[t] >= self.refresh:
                self.thresholds[t] = topk_threshold(x[j], self.keep)
                self.refreshed_at[t] = step
        return upload([self.thresholds[t] for t in tables], torch.float64, x.device)

    def graph_key(self, step: int) -> Hashable | None:
        return None  # thresholds are refreshed from the data on the host

    def describe(self) -> dict[int, dict[str, Any]]:
        return {t: {"class": "dct", "threshold": v} for t, v in self.thresholds.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"thresholds": dict(self.thresholds), "refreshed_at": dict(self.refreshed_at)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.thresholds = {int(k): float(v) for k, v in state["thresholds"].items()}
        self.refreshed_at = {int(k): int(v) for k, v in state["refreshed_at"].items()}
