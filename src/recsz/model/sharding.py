"""Table-wise sharding: a small planner that gives each table to one rank; and column
shards, which make a table's columns several tables for it."""

from __future__ import annotations

from collections.abc import Sequence


def plan_tables(table_sizes: Sequence[int], dim: int, world: int) -> list[int]:
    """Owner rank of each table, balancing table memory and lookup count across ranks.

    Every table is looked up once per sample, so lookup cost (and the forward all-to-all
    bytes a rank sends) grows with the number of tables a rank holds, while memory grows
    with their rows. Tables go largest first (longest-processing-time greedy) to the rank
    whose larger share afterwards, of memory or of tables, would be smallest (then their
    sum, then the lower rank: every rank computes the same plan). Against the sum of the
    two shares alone (the plan before the thirty-fifth session), over 240 plans (every
    preset, 2 to 128 ranks, 1 to 8 column shards) the busiest rank's larger share is never
    larger and in 93 smaller, its tables e.g. 1.23x the mean where they were 1.85x
    (benchmarks/README.md, "Column shards")."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    n = len(table_sizes)
    total_mem = float(sum(table_sizes)) * dim
    mem = [0.0] * world
    count = [0] * world
    owners = [0] * n
    for t in sorted(range(n), key=lambda t: (-table_sizes[t], t)):
        cost = table_sizes[t] * dim
        shares = [((mem[r] + cost) / total_mem, (count[r] + 1) / n) for r in range(world)]
        best = min(range(world), key=lambda r: (max(shares[r]), sum(shares[r]), r))
        owners[t] = best
        mem[best] += cost
        count[best] += 1
    return owners


def column_shards(table_sizes: Sequence[int], dim: int, k: int) -> tuple[list[int], int]:
    """Every table split into ``k`` shards of its columns (TorchRec's column-wise sharding):
    the shards' rows (shard c of table t is shard t * k + c, with t's rows) and their
    width, dim / k. Each shard is planned, looked up, exchanged and bounded as a table;
    the receiver's (b, T * k, dim / k) embeddings are the model's (b, T, dim), side by side.
    """
    if k < 1 or dim % k:
        raise ValueError(f"--column-shards {k}: must divide the tables' dim {dim}")
    return [n for n in table_sizes for _ in range(k)], dim // k
