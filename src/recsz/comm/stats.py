"""What the embedding exchange counts (bytes, ratios, seconds) and who owns which table."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class GroupsSent(NamedTuple):
    """One direction's payloads of a step: per group (destination) its tables and their
    rows, the raw bytes one table's rows stood for, the payloads' lengths, the tables'
    bounds (all groups in order, or None) and whether each group left the rank."""

    direction: str
    groups: list[tuple[list[int], list[int]]]
    raw: int
    used: torch.Tensor
    ebs: torch.Tensor | None
    remote: list[bool]


@dataclass
class CommStats:
    """Counters of one rank; ratios are raw fp32 bytes over payload bytes."""

    raw: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, int] = field(default_factory=lambda: defaultdict(int))
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
    _later: list[GroupsSent] = field(default_factory=list)

    def count(
        self, direction: str, table: int, raw: int, sent: int, eb: float | None, remote: bool
    ) -> None:
        """One chunk sent: ``raw`` bytes it stood for, ``sent`` payload bytes, its bound;
        ``remote``: it left this rank (only those bytes are on the wire)."""
        self.raw[direction] += raw
        self.sent[direction] += sent
        self.table_raw[direction][table] += raw
        self.table_sent[direction][table] += sent
        if remote:
            self.wire[direction] += sent
        if eb is not None:
            self.last_eb[direction][table] = eb

    def count_groups(self, sent: GroupsSent) -> None:
        """Group payloads sent; kept as they are when their lengths or bounds are on a
        device, and read when the counters next are (:meth:`settle`): no sync in the
        step."""
        if sent.used.device.type == "cpu" and (sent.ebs is None or sent.ebs.device.type == "cpu"):
            self._fold(sent)
        else:
            self._later.append(sent)

    def settle(self) -> None:
        """Fold the counts kept on the device into the counters."""
        for sent in self._later:
            self._fold(sent)
        self._later.clear()

    def _fold(self, s: GroupsSent) -> None:
        """A group's bytes shared out to its tables by rows."""
        u, k = s.used.tolist(), 0
        e = s.ebs.tolist() if s.ebs is not None else [None] * sum(len(t) for t, _ in s.groups)
        for (tables, sizes), nb, far in zip(s.groups, u, s.remote, strict=True):
            rows = max(1, sum(sizes))
            for t, r in zip(tables, sizes, strict=True):
                self.count(s.direction, t, s.raw, int(nb) * r // rows, e[k], far)
                k += 1

    def ratio(self, direction: str) -> float:
        self.settle()
        s = self.sent[direction]
        return self.raw[direction] / s if s else float("nan")

    def summary(self) -> dict[str, Any]:
        self.settle()
        return {
            "fwd_ratio": self.ratio("fwd"),
            "bwd_ratio": self.ratio("bwd"),
            "bytes_raw": self.raw["fwd"] + self.raw["bwd"],
            "bytes_payload": self.sent["fwd"] + self.sent["bwd"],
            "bytes_sent": self.wire["fwd"] + self.wire["bwd"],
            "a2a_fwd_s": self.a2a_s["fwd"],
            "a2a_bwd_s": self.a2a_s["bwd"],
            "codec_s": self.codec_s,
        }


@dataclass
class ShardPlan:
    """Which rank owns each table (table-wise sharding)."""

    owners: list[int]
    world: int

    def tables_of(self, rank: int) -> list[int]:
        return [t for t, r in enumerate(self.owners) if r == rank]
