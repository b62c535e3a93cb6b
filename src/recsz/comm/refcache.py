"""Temporal references: a bounded cache of the vectors a receiver holds, mirrored by the sender.

The sample owner keeps, per table, the last vector it decoded for each id; the table owner
keeps an identical mirror per destination. Both apply the same operations in the same
order — look up the step's distinct ids (sorted), then :meth:`RefCache.commit` with the
hit mask (sent along as a bitmap) and the decoded values of the misses — so the two
never disagree, which :meth:`digest` lets tests check.

Eviction is least-recently-used with ties broken by the smaller id, fully determined by
the sequence of commits, so it is the same on both ends.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class RefCache:
    """At most ``capacity`` (id -> vector) entries of one table, LRU-evicted."""

    def __init__(self, capacity: int, dim: int) -> None:
        if capacity < 1:
            raise ValueError(f"--ref-cache-rows must be >= 1, got {capacity}")
        self.capacity = capacity
        self.keys = torch.full((capacity,), -1, dtype=torch.int64)
        self.vals = torch.zeros(capacity, dim)
        self.last = torch.full((capacity,), -1, dtype=torch.int64)
        self.clock = 0
        self._reindex()

    def _reindex(self) -> None:
        self._sorted, self._order = torch.sort(self.keys)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where absent. ids (U,) distinct, int64."""
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        pos = torch.searchsorted(self._sorted, ids).clamp_(max=self.capacity - 1)
        found = self._sorted[pos] == ids
        return torch.where(found, self._order[pos], torch.full_like(pos, -1))

    def commit(
        self, ids: torch.Tensor, slots: torch.Tensor, hit: torch.Tensor, miss_vals: torch.Tensor
    ) -> None:
        """Store the misses' new values, evicting LRU entries for new ids; touch all ids.

        Args:
            ids: (U,) distinct ids of this step, sorted.
            slots: lookup(ids).
            hit: (U,) bool, True where the cached value was used.
            miss_vals: (M, D) decoded values of the ids where ``hit`` is False, in order.
        """
        self.clock += 1
        miss = ~hit
        m_ids, m_slots = ids[miss], slots[miss]
        new = m_slots < 0
        n_new = int(new.sum())
        if n_new > self.capacity:  # more new ids than the cache holds: keep the first ones
            keep_new = torch.nonzero(new).view(-1)[: self.capacity]
            new_mask = torch.zeros_like(new)
            new_mask[keep_new] = True
            drop = new & ~new_mask
            m_ids, m_slots, miss_vals = m_ids[~drop], m_slots[~drop], miss_vals[~drop]
            new = new[~drop]
            n_new = self.capacity
        if n_new:
            # Victims: slots not used this step, empty first (last = -1), then least
            # recently used, ties by smaller key: a total order both ends share.
            protect = slots[slots >= 0]
            score = self.last.clone()
            score[protect] = torch.iinfo(torch.int64).max
            by_key = torch.argsort(self.keys, stable=True)
            by_last = by_key[torch.argsort(score[by_key], stable=True)]
            victims = by_last[:n_new]
            m_slots = m_slots.clone()
            m_slots[new] = victims
            self.keys[victims] = m_ids[new]
        if m_slots.numel():
            self.vals[m_slots] = miss_vals.to(self.vals.dtype)
        touched = torch.cat([slots[slots >= 0], m_slots[m_slots >= 0]])
        self.last[touched] = self.clock
        if n_new:
            self._reindex()

    @property
    def rows(self) -> int:
        return int((self.keys >= 0).sum())

    def digest(self) -> str:
        """Hash of the whole state (keys, values, recency): equal on both ends."""
        h = hashlib.sha256()
        for t in (self.keys, self.vals, self.last):
            h.update(t.contiguous().numpy().tobytes())
        h.update(str(self.clock).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        return {
            "keys": self.keys.clone(),
            "vals": self.vals.clone(),
            "last": self.last.clone(),
            "clock": self.clock,
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        if s["keys"].numel() != self.capacity:
            raise ValueError(
                f"reference cache of {s['keys'].numel()} rows saved, "
                f"{self.capacity} configured (--ref-cache-rows)"
            )
        self.keys, self.vals, self.last = s["keys"].clone(), s["vals"].clone(), s["last"].clone()
        self.clock = int(s["clock"])
        self._reindex()
