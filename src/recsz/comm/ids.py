"""Distinct ids of a batch slice, as both ends of the exchange derive them.

Id-aware traffic sends one row per distinct id of each table in sorted id order; the
sample owner and the table owner each derive the same order from the ids they both hold.
:func:`distinct_pairs` does every table of a (sample owner, table owner) slice in one pass;
on the CPU :func:`unique_first` is a numpy stable argsort and one scan (~10x faster than
``torch.unique(return_inverse=True)`` on 1k ids).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from recsz.devicepath import device_path


def unique_first(col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ids (n,): inverse into the sorted distinct ids, each one's first position, and
    the sorted distinct ids themselves."""
    n = col.numel()
    if not device_path(col.device) and n:
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


#: Table index above any id: (table << 40) | id orders pairs table by table, id by id.
_TABLE_SHIFT = 40


class Distinct(NamedTuple):
    """The distinct (table, id) pairs of one (sample owner, table owner) slice: b samples
    of T tables, flattened table by table (position j * b + sample)."""

    inverse: torch.Tensor  # (T b,): index of each position's pair among the distinct pairs
    first: torch.Tensor  # (n,): each distinct pair's first position, table by table
    counts: list[int]  # (T,): distinct ids per table


def distinct_pairs(ids: torch.Tensor) -> Distinct:
    """For ids (b, T) (one column per table), the distinct ids of every column in one pass:
    sorted by table, then by id, so each table's rows are contiguous."""
    n_t = ids.shape[1]
    if n_t and int(ids.max()) >> _TABLE_SHIFT:
        raise ValueError(f"an id of {int(ids.max())} is too large for the exchange")
    shift = torch.arange(n_t, dtype=torch.int64, device=ids.device) << _TABLE_SHIFT
    keys = (ids.t() + shift.unsqueeze(1)).reshape(-1)
    inv, first, uniq = unique_first(keys)
    counts = torch.bincount(uniq >> _TABLE_SHIFT, minlength=n_t)
    return Distinct(inv, first, counts.tolist())
