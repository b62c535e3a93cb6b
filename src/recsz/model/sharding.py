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


def optimizer_row_bytes(optimizer: str, dim: int) -> int:
    """The row optimizer's state a row of ``dim`` values holds, in bytes (float32)."""
    return {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * dim}[optimizer]


def rank_loads(
    table_sizes: Sequence[int], dim: int, owners: Sequence[int], world: int,
    value_bytes: int = 4, optimizer: str = "sgd",
) -> list[dict[str, float]]:  # fmt: skip
    """What each of ``world`` ranks holds and sends under ``owners``: its tables, their rows,
    their bytes (``value_bytes`` a value) and their optimizer's (:func:`optimizer_row_bytes`),
    and its share of the forward all-to-all's bytes (every sample's vector of each of its
    tables)."""
    out = [{"tables": 0, "rows": 0, "table_bytes": 0, "optimizer_bytes": 0, "send_share": 0.0}
           for _ in range(world)]  # fmt: skip
    for t, r in enumerate(owners):
        n = table_sizes[t]
        out[r]["tables"] += 1
        out[r]["rows"] += n
        out[r]["table_bytes"] += n * dim * value_bytes
        out[r]["optimizer_bytes"] += n * optimizer_row_bytes(optimizer, dim)
    for load in out:
        load["send_share"] = load["tables"] / max(1, len(owners))
    return out
