"""Error-bound policies: map (table, step, the values about to be sent) to a bound.

A policy holds state (classes, schedules); the codec it feeds is stateless, and neither
knows about ranks. Bounds are absolute when handed to a codec; in ``rel`` mode the
policy turns a relative bound into an absolute one with the value range of the table's
slice, as the paper does (eb_abs = eb_rel x (max - min)).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from recsz.codecs.base import EB_MAX
from recsz.codecs.payload import constant, upload
from recsz.devicepath import device_path

#: Smallest absolute bound handed out (a constant slice has range 0).
MIN_ABS_BOUND = 1e-30


_abs_checks = {"left": 1000}  # slices checked against an absolute bound, then no more


def checks_abs_on_host(mode: str) -> bool:
    """Whether absolute bounds are still checked against the data on the host."""
    return mode == "abs" and _abs_checks["left"] > 0


def _warn_if_wider_than_data(eb: float, x: torch.Tensor) -> None:
    """Warn (once) when an absolute bound spans the data's whole range: every value then
    decodes to about the same number and training learns nothing (measured: AUC 0.49)."""
    if _abs_checks["left"] <= 0:
        return
    _abs_checks["left"] -= 1
    lo, hi = finite_range(x.unsqueeze(0))
    if 0 < float(hi - lo) <= eb:  # (-inf where nothing is finite: no warning)
        _abs_checks["left"] = 0
        warnings.warn(
            f"absolute error bound {eb:g} is at least the range of the data it bounds "
            f"({float(hi - lo):g}): the codec may send every value as the same number; use "
            "--eb-mode rel or a bound well below the range",
            stacklevel=3,
        )


def absolute_bounds(factors: list[float], mode: str, x: torch.Tensor) -> torch.Tensor:
    """:func:`to_absolute` of many tables at once, where ``x`` lives and without a host
    sync: ``factors[j]`` read in ``mode`` against table j's values ``x[j]`` (table-major,
    any shape after the first dimension); float64, one reduction per end of the range."""
    f = constant(np.asarray(factors, np.float64), torch.float64, x.device)
    if mode == "abs":
        for eb, xj in zip(factors, x if _abs_checks["left"] > 0 else [], strict=False):
            _warn_if_wider_than_data(eb, xj)  # the first slices only (a host read each)
        return f.clamp(max=EB_MAX)
    if device_path(x.device):
        from recsz.policy import rangekernel

        if rangekernel.applies(x):
            return rangekernel.bounds(f, x, MIN_ABS_BOUND, EB_MAX)
    lo, hi = finite_range(x)
    r = hi - lo
    r = torch.where(r > 0, r, torch.maximum(lo.abs(), hi.abs()))  # constant: its magnitude
    r = torch.where(torch.isfinite(r), r, 0.0)  # nothing finite
    return (f * r).clamp(MIN_ABS_BOUND, EB_MAX)


def finite_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per table j, the smallest and largest finite value of x[j] (float64; +inf / -inf
    where it holds none), by torch reductions (a GPU uses :mod:`recsz.policy.rangekernel`)."""
    dims = tuple(range(1, x.dim()))
    if not device_path(x.device) and x.numel():  # all finite, the usual case: two passes, no copy
        lo, hi = x.amin(dims).double(), x.amax(dims).double()
        if bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            return lo, hi
    inf = float("inf")
    lo = torch.nan_to_num(x, nan=inf, posinf=inf, neginf=inf).amin(dims).double()
    hi = torch.nan_to_num(x, nan=-inf, posinf=-inf, neginf=-inf).amax(dims).double()
    return lo, hi


def to_absolute(eb: float, mode: str, x: torch.Tensor) -> float:
    """An absolute bound from ``eb`` read in ``mode`` ("abs", or "rel" to the range of x's
    finite values; a constant x: its magnitude), as a float: :func:`absolute_bounds` of
    one table."""
    return float(absolute_bounds([eb], mode, x.unsqueeze(0))[0])


def padded_tables(
    x: torch.Tensor, spans: list[list[tuple[int, int]]]
) -> list[tuple[list[int], torch.Tensor]]:
    """Tables' rows of x (table j's: its ``spans[j]``, (first row, rows) runs) as
    (tables, longest, width) tensors for one policy call each, each table's rows followed
    by rows of NaN, which no policy sees (:class:`BoundPolicy`); tables of lengths within
    a factor of two of each other in one tensor (at most twice their rows), given with
    their positions j. Tables without rows are left out. Two launches a tensor
    and two for all (on a GPU: an asynchronous upload of the indices, no host read). Off
    the GPU's path, where launches cost nothing and copies do, each table alone, unpadded
    (a view of x where its rows are one run)."""
    if not device_path(x.device):
        runs_of = [[x[a : a + n] for a, n in runs if n] for runs in spans]
        return [
            ([j], (rs[0] if len(rs) == 1 else torch.cat(rs)).unsqueeze(0))
            for j, rs in enumerate(runs_of)
            if rs
        ]
    lengths = [sum(n for _, n in runs) for runs in spans]
    by_size: dict[int, list[int]] = {}
    for j, n in enumerate(lengths):
        if n:
            by_size.setdefault(n.bit_length(), []).append(j)
    if not by_size:
        return []
    nan_row = x.shape[0]  # the row of NaN appended to x
    ext = torch.cat([x, x.new_full((1, x.shape[1]), float("nan"))])
    out = []
    for _, fs in sorted(by_size.items()):
        longest = max(lengths[j] for j in fs)
        index = np.full((len(fs), longest), nan_row, np.int64)
        for row, j in zip(index, fs, strict=True):
            row[: lengths[j]] = np.concatenate([np.arange(a, a + n) for a, n in spans[j]])
        rows = ext.index_select(0, upload(index.reshape(-1), torch.int64, x.device))
        out.append((fs, rows.view(len(fs), longest, x.shape[1])))
    return out


class BoundPolicy:
    """Base: no bound (lossless or casting codecs).

    Values that are not finite take no part in any policy's bounds or observations (a
    table's rows padded with rows of NaN give what its rows alone give: callers pad
    tables of several lengths into one tensor)."""

    name = "none"
    #: The fields of :meth:`state_dict` that map a table to what was learnt of it (a
    #: checkpoint of another number of ranks takes each table's from the rank that saw it)
    TABLE_STATE: tuple[str, ...] = ()

    def bounds(self, tables: list[int], step: int, x: torch.Tensor) -> torch.Tensor | None:
        """The bounds of many tables as a float64 tensor on x's device (``x[j]``: the
        values of ``tables[j]``), computed there without a host sync; None: no bound."""
        return None

    def observe(self, tables: list[int], step: int, x: torch.Tensor) -> None:
        """Feed a training step's values of ``tables`` (``x[j]``: table j's); adaptive
        policies learn from them."""

    def graph_key(self, step: int) -> Hashable | None:
        """What the host decides of ``step``'s bounds (hashable: steps with equal keys
        may replay one CUDA graph, :mod:`recsz.stepgraph`), or None where deciding needs
        the data on the host (that step runs eagerly)."""
        return ()

    def describe(self) -> dict[int, dict[str, Any]]:
        """Per-table state for the logs."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def probe_again(self, step: int) -> None:
        """Learn anew from ``step`` on, what a restore could not give back (a checkpoint
        with another rank's state); nothing for a policy that learns nothing."""

    def load_resharded(
        self, saved: list[dict[str, Any]], holders: dict[int, int], own: int
    ) -> None:
        """Restore from a checkpoint written by another number of ranks: ``saved``, every
        old rank's :meth:`state_dict`; each table's learnt state (:data:`TABLE_STATE`) from
        the rank ``holders[table]`` (the one that saw its values: its owner, for the
        forward), the rest from rank ``own``. ValueError as :meth:`load_state_dict`."""
        state = dict(saved[own])
        for key in self.TABLE_STATE:
            state[key] = {t: saved[r][key][t] for t, r in holders.items() if t in saved[r][key]}
        self.load_state_dict(state)


class FixedBound(BoundPolicy):
    """One bound for every table and step (absolute, or relative to each slice's range)."""

    name = "fixed"

    def __init__(self, eb: float, mode: str = "rel") -> None:
        if not eb > 0:
            raise ValueError(f"error bound must be positive, got {eb}")
        if mode not in ("abs", "rel"):
            raise ValueError(f"eb mode must be 'abs' or 'rel', got {mode!r}")
        self.eb = float(eb)
        self.mode = mode

    def bounds(self, tables: list[int], step: int, x: torch.Tensor) -> torch.Tensor | None:
        return absolute_bounds([self.eb] * len(tables), self.mode, x)

    def graph_key(self, step: int) -> Hashable | None:
        return None if checks_abs_on_host(self.mode) else ()
