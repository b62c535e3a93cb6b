"""Distinct ids of a batch slice, as both ends of the exchange derive them.

Id-aware traffic sends one row per distinct id in sorted id order; the sample owner and the
table owner each derive the same order from the ids they both hold. This runs ~100 times a
step (every table, both directions), so on the CPU it is a numpy stable argsort and one
scan (~10x faster than ``torch.unique(return_inverse=True)`` on 1k ids).
"""

from __future__ import annotations

import numpy as np
import torch


def unique_first(col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ids (n,): inverse into the sorted distinct ids, each one's first position, and
    the sorted distinct ids themselves."""
    n = col.numel()
    if col.device.type == "cpu" and n:
        a = col.numpy()
        order = np.argsort(a, kind="stable")  # stable: a group's first entry is its first id
        s = a[order]
        new = np.empty(n, dtype=bool)
        new[0] = True
        np.not_equal(s[1:], s[:-1], out=new[1:])
        inv = np.empty(n, dtype=np.int64)
        inv[order] = np.cumsum(new) - 1
        return torch.from_numpy(inv), torch.from_numpy(order[new]), torch.from_numpy(s[new])
    uniq, inv = torch.unique(col, sorted=True, return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=col.device)
    first.scatter_reduce_(0, inv, torch.arange(n, device=col.device), reduce="amin")
    return inv, first, uniq
