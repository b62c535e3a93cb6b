"""Table-wise sharding: a small planner that gives each table to one rank."""

from __future__ import annotations

from collections.abc import Sequence


def plan_tables(table_sizes: Sequence[int], dim: int, world: int) -> list[int]:
    """Owner rank of each table, balancing table memory and lookup count across ranks.

    Every table is looked up once per sample, so lookup cost (and all-to-all bytes) grows
    with the number of tables a rank holds, while memory grows with their rows. Tables
    go largest first (longest-processing-time greedy) to the rank whose share of memory
    plus share of tables would be smallest afterwards; ties go to the lower rank, so
    every rank computes the same plan.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    n = len(table_sizes)
    total_mem = float(sum(table_sizes)) * dim
    mem = [0.0] * world
    count = [0] * world
    owners = [0] * n
    for t in sorted(range(n), key=lambda t: (-table_sizes[t], t)):
        cost = table_sizes[t] * dim
        best = min(
            range(world),
            key=lambda r: ((mem[r] + cost) / total_mem + (count[r] + 1) / n, r),
        )
        owners[t] = best
        mem[best] += cost
        count[best] += 1
    return owners
