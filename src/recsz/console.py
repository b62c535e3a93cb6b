"""What a command says on the terminal, or in the file that stands for it (a scheduler's
log): recsz's warnings as its other lines, tqdm's bars, and a run's progress (a bar, or a
line per metrics row where no terminal reads it).
"""

from __future__ import annotations

import io
import math
import os
import sys
import time
import warnings
from typing import Any, TextIO

from tqdm import tqdm


def plain_warnings() -> None:
    """recsz's own warnings said as a command's other lines are, ``recsz: warning: ...``
    (``recsz: warning: rank R: ...`` on a rank of several, each of which says its own: an
    absolute bound wider than its tables' data), not with Python's file, line and source
    line; the others' as Python says them."""
    shown = warnings.showwarning
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = f"rank {os.environ.get('RANK', '?')}: " if several else ""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:  # fmt: skip
        if f"{os.sep}recsz{os.sep}" in filename:
            tqdm.write(f"recsz: warning: {rank}{message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


#: Written to a file, progress says a line at most this often (seconds).
LINE_S = 30.0


def bar(show: bool, err: TextIO | None = None, **kw: Any) -> tqdm:
    """A tqdm bar (``kw``: tqdm's) where ``show``: on a terminal, drawn; written to a file
    (a scheduler's log), where a bar's redraws pile up on one line, its meter as a line at
    most each :data:`LINE_S` seconds, and at its end if it said one (what takes less says
    nothing)."""
    err = err or sys.stderr
    if show and not err.isatty():
        return _LogLines(err, **kw)
    return tqdm(disable=not show, file=err, **kw)


class _LogLines(tqdm):
    """tqdm's meter as lines of a log: :meth:`display`, which tqdm has its subclasses
    overload for another front end, writes a line when :data:`LINE_S` have passed."""

    def __init__(self, log: TextIO, **kw: Any) -> None:
        self._log, self._said_at, self._said = log, time.monotonic(), None
        super().__init__(file=io.StringIO(), mininterval=min(1.0, LINE_S), maxinterval=LINE_S, **kw)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is None and time.monotonic() - self._said_at >= LINE_S:
            self._line()
        return True

    def close(self) -> None:
        if self._said not in (None, self.n) and not self.disable:
            self._line()  # the total, if not said already
        super().close()

    def _line(self) -> None:
        self._log.write(f"{self}\n")
        self._log.flush()
        self._said_at, self._said = time.monotonic(), self.n


class Progress:
    """A run's progress, said by rank 0 (``show``): a bar on a terminal; written to a file (a
    scheduler's log, ``nohup``), where a bar's redraws pile up on one line, a line per
    metrics row instead, at most one each :data:`LINE_S` seconds but for the first, the
    last and those of an evaluation."""

    #: What the bar shows, from the metrics rows that hold it: (label, row key).
    SHOWN = (("loss", "loss"), ("auc", "eval_auc"))

    def __init__(self, total: int, initial: int, show: bool, err: TextIO | None = None) -> None:
        err = err or sys.stderr
        self.lines = show and not err.isatty()
        self.total, self._said_at = total, -math.inf
        self._start = (time.monotonic(), initial)  # (the time left: from the pace since)
        self.bar = tqdm(total=total, initial=initial, disable=not show or self.lines,
                        desc="train", unit="step", leave=False, file=err)  # fmt: skip
        self.shown: dict[str, str] = {}

    def update(self) -> None:
        """One more step."""
        self.bar.update(1)

    def row(self, row: dict[str, Any]) -> None:
        """A metrics row logged: the bar's last loss and AUC (a row may hold either or
        both), or its line."""
        self.shown.update({k: f"{row[c]:.4f}" for k, c in self.SHOWN if c in row})
        self.bar.set_postfix({k: self.shown[k] for k, _ in self.SHOWN if k in self.shown})
        now = time.monotonic()
        due = now - self._said_at >= LINE_S or row["step"] == self.total
        if self.lines and (due or "eval_auc" in row):
            self._said_at = now
            t0, first = self._start
            left = (now - t0) / (row["step"] - first) * (self.total - row["step"])
            tqdm.write(line_of(row, self.total, left if row["step"] > first else None))

    def close(self) -> None:
        self.bar.close()


def line_of(row: dict[str, Any], total: int, left_s: float | None = None) -> str:
    """A metrics row as one line of a log: ``step 200/1000  loss 0.4512  11,234 samples/s
    fwd 24.1x  bwd 19.8x  auc 0.7712  left 12:05``, the numbers the row holds (``left_s``:
    the seconds the run's pace leaves, said before its last step)."""
    out = [f"step {row['step']}/{total}"]
    if "loss" in row:
        out.append(f"loss {row['loss']:.4f}")
    if "samples_per_s" in row and math.isfinite(row["samples_per_s"]):
        out.append(f"{row['samples_per_s']:,.0f} samples/s")
    out += [f"{d} {row[f'{d}_ratio']:.1f}x" for d in ("fwd", "bwd") if f"{d}_ratio" in row]
    if "eval_auc" in row:
        out.append(f"auc {row['eval_auc']:.4f}")
    if left_s is not None and row["step"] < total:
        out.append(f"left {tqdm.format_interval(left_s)}")
    return "  ".join(out)
