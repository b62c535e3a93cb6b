"""What the embedding exchange counts (bytes, ratios, seconds) and who owns which table."""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from recsz.devicepath import device_path


class GroupsSent(NamedTuple):
    """One direction's payloads of a step: per group (destination) its tables and their
    rows, the raw bytes one table's rows stood for, the payloads' lengths, the tables'
    bounds (all groups in order, or None), whether each group left the rank and whether
    it left the host (None: none did)."""

    direction: str
    groups: list[tuple[list[int], list[int]]]
    raw: int
    used: torch.Tensor
    ebs: torch.Tensor | None
    remote: list[bool]
    apart: list[bool] | None = None


@dataclass
class CommStats:
    """Counters of one rank; ratios are raw fp32 bytes over payload bytes."""

    raw: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: of the groups that left the host: their raw bytes, and their payloads'
    between_raw: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    between: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    table_raw: dict[str, dict[int, int]] = field(
        default_factory=lambda: {"fwd": defaultdict(int), "bwd": defaultdict(int)}
    )
    table_sent: dict[str, dict[int, int]] = field(
        default_factory=lambda: {"fwd": defaultdict(int), "bwd": defaultdict(int)}
    )
    last_eb: dict[str, dict[int, float]] = field(default_factory=lambda: {"fwd": {}, "bwd": {}})
    a2a_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    codec_s: float = 0.0
    max_err: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _hold: bool = False  # inside :meth:`held`
    _later: list[GroupsSent] = field(default_factory=list)

    def count_groups(self, sent: GroupsSent) -> None:
        """Group payloads sent; kept as they are when their lengths or bounds are on a
        device, and read when the counters next are (:meth:`settle`): no sync in the step.
        Inside :meth:`held`, every count is kept apart."""
        on_host = not any(device_path(t.device) for t in (sent.used, sent.ebs) if t is not None)
        if on_host and not self._hold:
            self._fold(sent)
        else:
            self._later.append(sent)

    @contextlib.contextmanager
    def held(self) -> Iterator[list[GroupsSent]]:
        """Every count made inside, on the device or on the host, kept out of the counters
        and handed over in the list yielded when the block ends (a captured CUDA graph's
        step: its replays count them again, :mod:`recsz.stepgraph`)."""
        mark, before, self._hold = len(self._later), self._hold, True
        taken: list[GroupsSent] = []
        try:
            yield taken
        finally:
            self._hold = before
            taken += self._later[mark:]
            del self._later[mark:]

    def settle(self) -> None:
        """Fold the counts kept on the device into the counters."""
        for sent in self._later:
            self._fold(sent)
        self._later.clear()

    def _fold(self, s: GroupsSent) -> None:
        """A group's payload bytes shared out to its tables by rows; each table's rows
        stood for ``s.raw`` bytes; only the bytes of groups that left the rank count as
        on the wire."""
        d, u, k = s.direction, s.used.tolist(), 0
        e = s.ebs.tolist() if s.ebs is not None else [None] * sum(len(t) for t, _ in s.groups)
        apart = s.apart or [False] * len(s.groups)
        for (tables, sizes), nb, far, out in zip(s.groups, u, s.remote, apart, strict=True):
            rows = max(1, sum(sizes))
            for t, r in zip(tables, sizes, strict=True):
                sent = int(nb) * r // rows
                self.raw[d] += s.raw
                self.sent[d] += sent
                self.wire[d] += sent if far else 0
                self.between_raw[d] += s.raw if out else 0
                self.between[d] += sent if out else 0
                self.table_raw[d][t] += s.raw
                self.table_sent[d][t] += sent
                if (eb := e[k]) is not None:
                    self.last_eb[d][t] = eb
                k += 1

    @classmethod
    def resumed(
        cls, saved: Sequence[CommStats], rank: int, world: int, tables: Collection[int]
    ) -> CommStats:
        """Rank ``rank`` of ``world``'s counters, resumed from a checkpoint that another
        number of ranks wrote (``saved``: their counters, by rank): the bytes of saved
        ranks ``rank``, ``rank + world``, ... (each counted once: the ranks' sums stay the
        run's), the forward counts of the ``tables`` it now owns (whoever owned them, as a
        table's owner reports them), and the seconds of saved rank ``rank % len(saved)``."""
        out = cls()
        for s in saved[rank::world]:
            counted = ((out.raw, s.raw), (out.sent, s.sent), (out.wire, s.wire),
                       (out.between, s.between), (out.between_raw, s.between_raw))  # fmt: skip
            for mine, theirs in counted:
                for d, n in theirs.items():
                    mine[d] += n
            for t, n in s.table_raw["bwd"].items():
                out.table_raw["bwd"][t] += n
            for t, n in s.table_sent["bwd"].items():
                out.table_sent["bwd"][t] += n
            for d, e in s.max_err.items():
                out.max_err[d] = max(out.max_err[d], e)
        for s in saved:
            for t in set(tables) & set(s.table_raw["fwd"]):
                out.table_raw["fwd"][t] += s.table_raw["fwd"][t]
                out.table_sent["fwd"][t] += s.table_sent["fwd"][t]
            for d, last in s.last_eb.items():
                out.last_eb[d].update(
                    last if d == "bwd" else {t: last[t] for t in tables if t in last}
                )
        timed = saved[rank % len(saved)]
        out.a2a_s.update(timed.a2a_s)
        out.codec_s = timed.codec_s
        return out

    def recolumned(self, k_old: int, k_new: int) -> CommStats:
        """These counters with each table's (``--column-shards`` changed on resume: shard
        c of table t is table t * k + c) shared out evenly to its ``k_new`` new shards, the
        first taking what does not divide; each new shard's last bound its old first's."""
        self.settle()
        out = copy.copy(self)
        out.table_raw = {d: defaultdict(int) for d in self.table_raw}
        out.table_sent = {d: defaultdict(int) for d in self.table_sent}
        for mine, theirs in ((out.table_raw, self.table_raw), (out.table_sent, self.table_sent)):
            for d, per in theirs.items():
                whole: dict[int, int] = defaultdict(int)
                for v, n in per.items():
                    whole[v // k_old] += n
                for t, n in whole.items():
                    for c in range(k_new):
                        mine[d][t * k_new + c] = n // k_new + (n % k_new if c == 0 else 0)
        out.last_eb = {
            d: {t // k_old * k_new + c: eb for t, eb in last.items() if t % k_old == 0
                for c in range(k_new)}
            for d, last in self.last_eb.items()
        }  # fmt: skip
        out._later = []
        return out

    def __setstate__(self, state: dict) -> None:
        """Counters a checkpoint of before ``between`` holds: none between hosts yet."""
        none: dict[str, dict[str, int]] = {k: defaultdict(int) for k in ("between", "between_raw")}
        self.__dict__.update({**none, **state})

    def ratio(self, direction: str) -> float:
        self.settle()
        s = self.sent[direction]
        return self.raw[direction] / s if s else float("nan")


@dataclass
class ShardPlan:
    """Which rank owns each table (table-wise sharding)."""

    owners: list[int]
    world: int

    def tables_of(self, rank: int) -> list[int]:
        return [t for t, r in enumerate(self.owners) if r == rank]
