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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recsz.comm.exchange import frame, unframe

if TYPE_CHECKING:
    from recsz.codecs import Codec


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


def encode_with_refs(
    mirror: RefCache, uniq: torch.Tensor, rows: torch.Tensor, eb: float | None, codec: Codec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sender side for one (table, receiver): reference what the receiver holds within eb.

    Args:
        mirror: the sender's copy of the receiver's cache for this table.
        uniq: (U,) the distinct ids the receiver needs, sorted.
        rows: (U, D) their current vectors.
        eb: the bound (None for a lossless codec: only identical vectors are referenced).
    Returns:
        (framed bytes: hit bitmap + codec payload of the misses, hit mask (U,),
        the values the receiver will hold (U, D)).
    """
    slots = mirror.lookup(uniq)
    hit = slots >= 0
    if bool(hit.any()):
        held = mirror.vals[slots[hit]]
        ok = (
            ((rows[hit] - held).abs().amax(1) <= eb)
            if eb is not None
            else (rows[hit] == held).all(1)
        )
        hit[hit.clone()] = ok
    payload = codec.encode(rows[~hit].contiguous(), eb)
    sent_vals = codec.decode(payload)  # exactly what the receiver will hold
    held_all = mirror.vals[slots.clamp(min=0)].clone()
    held_all[~hit] = sent_vals.to(held_all.dtype)
    mirror.commit(uniq, slots, hit, sent_vals)
    bits = torch.from_numpy(np.packbits(hit.numpy()))
    return frame([bits, payload]), hit, held_all


def decode_with_refs(
    cache: RefCache,
    uniq: torch.Tensor,
    part: torch.Tensor,
    decode: Callable[[torch.Tensor], torch.Tensor],
    where: str,
) -> torch.Tensor:
    """Receiver side: rebuild the distinct vectors from bitmap, cache and the misses' payload.

    Raises ValueError naming ``where`` if the bytes disagree with this cache (out of sync).
    """
    bits, payload = unframe(part, 2, where)
    u = uniq.numel()
    if bits.numel() != (u + 7) // 8:
        raise ValueError(f"{where}: reference bitmap has {bits.numel()} bytes for {u} ids")
    hit = torch.from_numpy(np.unpackbits(bits.numpy(), count=u).astype(bool))
    slots = cache.lookup(uniq)
    if bool((hit & (slots < 0)).any()):
        raise ValueError(f"{where}: references ids this rank does not hold: caches out of sync")
    misses = decode(payload)
    if misses.shape[0] != int((~hit).sum()):
        raise ValueError(f"{where}: {misses.shape[0]} vectors for {int((~hit).sum())} misses")
    vals = torch.empty(u, cache.vals.shape[1])
    vals[hit] = cache.vals[slots[hit]]
    vals[~hit] = misses
    cache.commit(uniq, slots, hit, misses)
    return vals
