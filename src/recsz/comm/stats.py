"""What the embedding exchange counts (bytes, ratios, seconds) and who owns which table."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch


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
    _later: list[Any] = field(default_factory=list)

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

    def count_groups(
        self,
        direction: str,
        groups: list[tuple[list[int], list[int]]],
        raw: int,
        used: torch.Tensor,
        ebs: torch.Tensor | None,
        remote: list[bool],
    ) -> None:
        """Group payloads sent (tables and their rows per group), their lengths and the
        tables' bounds; kept as they are when on a device and read when the counters
        next are (:meth:`settle`): no sync in the step. A group's bytes are shared out
        to its tables by rows."""
        entry = (direction, groups, raw, used, ebs, remote)
        if used.device.type == "cpu" and (ebs is None or ebs.device.type == "cpu"):
            self._fold(*entry)
        else:
            self._later.append(entry)

    def settle(self) -> None:
        """Fold the counts kept on the device into the counters."""
        for entry in self._later:
            self._fold(*entry)
        self._later.clear()

    def _fold(
        self,
        direction: str,
        groups: list[tuple[list[int], list[int]]],
        raw: int,
        used: torch.Tensor,
        ebs: torch.Tensor | None,
        remote: list[bool],
    ) -> None:
        u, k = used.tolist(), 0
        e = ebs.tolist() if ebs is not None else [None] * sum(len(t) for t, _ in groups)
        for (tables, sizes), nb, far in zip(groups, u, remote, strict=True):
            rows = max(1, sum(sizes))
            for t, r in zip(tables, sizes, strict=True):
                self.count(direction, t, raw, int(nb) * r // rows, e[k], far)
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
