"""The reference cache: lookups, LRU eviction, and identical state on both ends."""

from __future__ import annotations

import torch

from recsz.comm.refcache import RefCache


def _step(cache: RefCache, ids: list[int], hit: list[bool], dim: int = 2) -> None:
    u = torch.tensor(ids)
    slots = cache.lookup(u)
    h = torch.tensor(hit) & (slots >= 0)
    vals = torch.arange(int((~h).sum()) * dim, dtype=torch.float32).view(-1, dim) + sum(ids)
    cache.commit(u, slots, h, vals)


def test_lookup_insert_and_lru_eviction() -> None:
    c = RefCache(3, 2)
    _step(c, [5, 7], [False, False])
    assert (c.lookup(torch.tensor([5, 7, 9])) >= 0).tolist() == [True, True, False]
    _step(c, [7, 9], [True, False])  # 5 is now least recently used
    _step(c, [11], [False])  # evicts 5
    assert (c.lookup(torch.tensor([5, 7, 9, 11])) >= 0).tolist() == [False, True, True, True]
    assert c.rows == 3


def test_more_new_ids_than_capacity() -> None:
    c = RefCache(2, 2)
    _step(c, [1, 2, 3, 4], [False] * 4)
    assert c.rows == 2 and (c.lookup(torch.tensor([1, 2])) >= 0).all()


def test_two_ends_stay_identical_over_many_steps() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = RefCache(50, 4), RefCache(50, 4)
    for _ in range(300):
        ids = torch.unique(torch.randint(0, 200, (40,), generator=g))
        hit_wish = torch.rand(ids.numel(), generator=g) < 0.5
        vals = torch.randn(ids.numel(), 4, generator=g)
        for c in (a, b):
            slots = c.lookup(ids)
            h = hit_wish & (slots >= 0)
            c.commit(ids, slots, h, vals[~h])
    assert a.digest() == b.digest() and a.rows == 50
    s = RefCache(50, 4)
    s.load_state_dict(a.state_dict())
    assert s.digest() == a.digest()
