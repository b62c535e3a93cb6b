"""Dual-level adaptive error bound (arXiv 2407.04272, section 5): per table and per iteration.

Table level: a *homogenization index* per table measures how strongly quantization at a
probe bound merges the distinct values of the table's traffic:

    H = sum over dims j of distinct(quantized x[:, j]) / sum over dims j of distinct(x[:, j])

H near 1: values are far apart relative to the bound (small, heavily trained tables),
so a loose bound loses little that distinguishes them. H near 0: many distinct values
collapse into one code (large tables whose rarely seen rows sit near their
initialisation), so the table needs a tight bound to keep them apart.

Why per dimension rather than whole vectors: measured on the real 10k Criteo sample
(dim 32 model after 250 steps, batches of 1024, probe 0.03 and 0.25 relative),
quantization merged *no* distinct vector in any of the 26 tables (row-level H = 1.000
everywhere), so a row-level index cannot tell tables apart. Per dimension, the same
traffic gave H = 0.023-0.042 for the 13 tables with more than 3,000 rows, 0.09-0.27 for
the 583-2,173-row tables, and 0.44-0.94 for the 8 tables of 3-305 rows. Hence the
thresholds ``tight if H < 0.035``, ``loose if H >= 0.5``, base otherwise: the tight class
holds the largest tables (the published study put its 8 largest there by hand) and the
loose class the tables of 3-305 rows (published: 3-105 rows). Default relative bounds
tight / base / loose = 0.01 / 0.03 / 0.05 (the published ones).

The index is computed online from the first ``probe_steps`` iterations' traffic (until
then every table gets the base bound), and again over a window every ``every``
iterations; every class change is logged.

Iteration level: a multiplier m(t) on every bound, from C at t = 0 down to 1 at t = T in
10 equal steps (the published schedule), then 1; ``constant`` (m = 1) is the table-wise
policy alone. (Linear and logarithmic decays and hand-set table classes went in the ninth
session: no benchmark row chose them.)
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recsz.devicepath import device_path
from recsz.policy.base import BoundPolicy, absolute_bounds, checks_abs_on_host

if TYPE_CHECKING:
    from recsz.config import TrainConfig

CLASSES = ("tight", "base", "loose")
SCHEDULES = ("step", "constant")


def decay_multiplier(t: int, total: int, c: float, schedule: str) -> float:
    """m(t): C at t = 0 down to 1 at t = total in 10 equal steps, 1 afterwards."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown decay schedule {schedule!r}; choose from {SCHEDULES}")
    if schedule == "constant" or t >= total or c == 1.0:
        return 1.0
    return c - (c - 1.0) * math.floor(10 * max(0.0, t / total)) / 10


def _distinct(a: np.ndarray) -> int:
    """Distinct values per row of ``a`` (D, N), each row sorted, summed."""
    return int(a.shape[0] * (a.shape[1] > 0) + np.count_nonzero(a[:, 1:] != a[:, :-1]))


def homogenization_counts(x: torch.Tensor, probe_eb: torch.Tensor) -> torch.Tensor:
    """Per table j of x (T, N, D): distinct values in each column before and after
    quantization at ``probe_eb[j]`` (absolute; codes round(x / 2eb) in x's precision, an
    estimate: near-ties may round either way), summed over the columns, as (T, 2) int64
    where x lives (no host sync on a GPU). Rows holding a NaN or an infinity are left out."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # exact for fp16 / bf16 (numpy has no bf16)
    if not device_path(x.device):
        # Table by table in numpy: it sorts contiguous columns ~10x faster than torch sorts
        # across rows here, and skipping the non-finite rows beats masking them. One sort:
        # the codes of sorted values are sorted (dividing and rounding are monotonic).
        out = []
        for xj, eb in zip(x.numpy(), probe_eb.tolist(), strict=True):
            fin = np.isfinite(xj)
            cols = (xj if fin.all() else xj[fin.all(1)]).T.copy()
            cols.sort(axis=1)
            codes = np.rint(cols / cols.dtype.type(2.0 * eb))
            out.append((_distinct(cols), _distinct(codes)))
        return torch.tensor(out, dtype=torch.int64).view(-1, 2)
    return sorted_counts(x, probe_eb)


def sorted_counts(x: torch.Tensor, probe_eb: torch.Tensor) -> torch.Tensor:
    """:func:`homogenization_counts` by torch operations on all tables at once (a GPU's
    way: no host sync; on the CPU several times slower than numpy's)."""
    fin = torch.isfinite(x).all(-1, keepdim=True)
    x = torch.sort(torch.where(fin, x, torch.inf), dim=1).values  # inf: last, not counted
    codes = torch.round(x / (2 * probe_eb.view(-1, 1, 1)).to(x.dtype))  # sorted as x is
    counts = []
    for s in (x, codes):
        f = torch.isfinite(s)
        counts.append(f[:, :1].sum((1, 2)) + ((s[:, 1:] != s[:, :-1]) & f[:, 1:]).sum((1, 2)))
    return torch.stack(counts, 1)


@dataclass
class _Window:
    before: int = 0
    after: int = 0


@dataclass
class DualBound(BoundPolicy):
    """Table classes from the homogenization index, times an iteration decay.

    ``decay_schedule="constant"`` gives the table-wise policy alone.
    """

    n_tables: int
    class_eb: dict[str, float]  # relative (or absolute) bound per class
    mode: str = "rel"
    thresholds: tuple[float, float] = (0.035, 0.5)  # H < lo: tight; H >= hi: loose
    probe_steps: int = 10  # iterations of traffic before the first classification
    every: int = 1000  # iterations between re-evaluations (0: never)
    decay_schedule: str = "step"
    decay_c: float = 2.0
    decay_t: int = 65_536
    name: str = "dual"
    TABLE_STATE = ("classes", "index", "win")  # (a class attribute: no annotation)
    classes: dict[int, str] = field(default_factory=dict)
    index: dict[int, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    _win: dict[int, _Window] = field(default_factory=dict)
    _pending: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    _again: int | None = None  # a probe window from this step (:meth:`probe_again`)

    def __post_init__(self) -> None:
        if set(self.class_eb) != set(CLASSES) or min(self.class_eb.values()) <= 0:
            raise ValueError(f"class bounds must be positive for {CLASSES}, got {self.class_eb}")
        lo, hi = self.thresholds
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"thresholds must satisfy 0 <= lo <= hi <= 1, got {self.thresholds}")
        if self.decay_c < 1:
            raise ValueError(f"decay C must be >= 1, got {self.decay_c}")
        decay_multiplier(0, max(1, self.decay_t), self.decay_c, self.decay_schedule)

    def class_of(self, table: int) -> str:
        return self.classes.get(table, "base")

    def _in_window(self, step: int) -> bool:
        """Probe windows: [0, probe) and then [k every, k every + probe) for k >= 1."""
        if step < self.probe_steps:
            return True
        if self._again is not None and self._again <= step < self._again + self.probe_steps:
            return True
        return bool(self.every) and step >= self.every and step % self.every < self.probe_steps

    def observe(self, tables: list[int], step: int, x: torch.Tensor) -> None:
        """In a probe window: the tables' counts before and after quantization at the
        base bound (``x[j]``: table j's rows, (N, D)), kept where x lives until the window
        closes (no host sync on a GPU)."""
        if not tables or x.numel() == 0 or not self._in_window(step):
            return
        x = x.detach().reshape(len(tables), -1, x.shape[-1])
        probe = absolute_bounds([self.class_eb["base"]] * len(tables), self.mode, x)
        self._pending.append((list(tables), homogenization_counts(x, probe)))

    def _fold(self) -> None:
        """Add the window's pending counts into its per-table totals (one host read each)."""
        for tables, counts in self._pending:
            for t, (before, after) in zip(tables, counts.tolist(), strict=True):
                w = self._win.setdefault(t, _Window())
                w.before += before
                w.after += after
        self._pending.clear()

    def _maybe_classify(self, step: int) -> None:
        """After a probe window, turn its accumulated counts into classes."""
        if self._in_window(step):
            return
        self._fold()
        if not self._win:
            return
        lo, hi = self.thresholds
        for t, w in sorted(self._win.items()):
            h = w.after / w.before if w.before else 1.0
            self.index[t] = h
            cls = "tight" if h < lo else "loose" if h >= hi else "base"
            if self.class_of(t) != cls:
                self.events.append(
                    {
                        "step": step,
                        "table": t,
                        "index": round(h, 4),
                        "from": self.class_of(t),
                        "to": cls,
                    }
                )
            self.classes[t] = cls
        self._win.clear()

    def multiplier(self, step: int) -> float:
        return decay_multiplier(step, self.decay_t, self.decay_c, self.decay_schedule)

    def bounds(self, tables: list[int], step: int, x: torch.Tensor) -> torch.Tensor | None:
        self._maybe_classify(step)
        m = self.multiplier(step)
        return absolute_bounds([self.class_eb[self.class_of(t)] * m for t in tables], self.mode, x)

    def graph_key(self, step: int) -> Hashable | None:
        # Probing, or classifying what was probed, reads counts on the host.
        if self._in_window(step) or self._pending or self._win or checks_abs_on_host(self.mode):
            return None
        return tuple(sorted(self.classes.items())), self.multiplier(step)

    def describe(self) -> dict[int, dict[str, Any]]:
        return {
            t: {"class": self.class_of(t), "index": self.index.get(t)} for t in range(self.n_tables)
        }

    def state_dict(self) -> dict[str, Any]:
        self._fold()
        return {
            "classes": dict(self.classes),
            "index": dict(self.index),
            "events": list(self.events),
            "win": {t: (w.before, w.after) for t, w in self._win.items()},
            "again": self._again,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s; ValueError naming what does not fit this policy
        (a class it does not have, a table beyond its ``n_tables``, a missing field)."""
        try:
            classes = {int(k): v for k, v in state["classes"].items()}
            index = {int(k): float(v) for k, v in state["index"].items()}
            events = list(state["events"])
            win = {int(t): _Window(*v) for t, v in state["win"].items()}
            again = None if state.get("again") is None else int(state["again"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{self.name} policy state is malformed: {e!r}") from None
        if bad := {c for c in classes.values() if c not in CLASSES}:
            raise ValueError(f"{self.name} policy state: unknown classes {sorted(bad)}")
        tables = set(classes) | set(index) | set(win)
        if outside := sorted(t for t in tables if not 0 <= t < self.n_tables):
            raise ValueError(
                f"{self.name} policy state: tables {outside} beyond this policy's {self.n_tables}"
            )
        self.classes, self.index, self.events, self._win = classes, index, events, win
        self._again = again

    def probe_again(self, step: int) -> None:
        """A probe window of ``probe_steps`` from ``step``, its classes after it (until then
        the tables keep theirs: base where none)."""
        self._again = step


def parse_class_eb(spec: str, what: str) -> dict[str, float]:
    """``tight,base,loose`` bounds (``what``: the flag, for the error): three finite
    positive numbers, none below the one before it."""
    try:
        vals = [float(v) for v in spec.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 3:
        raise ValueError(f"{what}: expected three numbers tight,base,loose; got {spec!r}")
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise ValueError(f"{what}: bounds must be finite and > 0; got {spec!r}")
    if not vals[0] <= vals[1] <= vals[2]:
        raise ValueError(f"{what}: tight <= base <= loose, got {spec!r}")
    return dict(zip(CLASSES, vals, strict=True))


def make_adaptive(cfg: TrainConfig, direction: str, n_tables: int) -> DualBound:
    """The table-wise (``table``) or dual-level (``dual``) policy of one direction."""
    return DualBound(
        n_tables=n_tables,
        class_eb=cfg.class_eb(direction),
        mode=cfg.eb_mode,
        probe_steps=cfg.hindex_probe_steps,
        every=cfg.hindex_every,
        decay_schedule=cfg.decay_schedule if cfg.eb_policy == "dual" else "constant",
        decay_c=cfg.decay_c,
        decay_t=cfg.decay_t,
        name=cfg.eb_policy,
    )
