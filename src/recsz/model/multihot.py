"""Multi-hot features as MLPerf's DLRM-DCNv2 makes them from one-hot Criteo.

Criteo gives one id per sample and feature. MLPerf's DLRM-DCNv2 benchmark (and
facebookresearch/dlrm's ``torchrec_dlrm``, its reference) trains on bags instead: table t's
bag of an id holds ``hotness[t]`` ids, the id itself first, the others drawn uniformly
from the table, once, for every id. A bag is then a function of the one-hot id, so the
batch keeps its one-hot ids (B, T) and the bags are made where they are looked up
(:class:`recsz.model.tables.SparseArch`), with fixed-size tensor operations. Where the
other ids come from (``--multi-hot-draws``): by default a hash of (table, slot, id), the
same on every rank and device, with no table of bags in memory; or ``mlperf``, the
reference's own draws (:func:`mlperf_draws`: numpy's legacy generator seeded 0, table
after table), which its materialized multi-hot Criteo (``day_N_sparse_multi_hot.npz``) holds:
with the one-hot days it was made from, the same bags. Id-aware traffic stays exact either
way: one vector per distinct one-hot id is one vector per distinct bag.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch
from torch import nn

#: Ids per bag of the 26 Criteo features in MLPerf's DLRM-DCNv2 (``--multi_hot_sizes``).
MLPERF_HOTNESS = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip

#: where a bag's other ids come from (``--multi-hot-draws``)
BAG_DRAWS = ("hash", "mlperf")
_DRAW_ROWS = 1 << 20  # rows of draws made at a time (the same stream as one call)

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # a 32-bit integer hash's multiplier: products stay below 2^59 in int64


def parse_hotness(spec: str, n_tables: int) -> tuple[int, ...] | None:
    """``--multi-hot``: '' (one id, None), 'mlperf', K (every table) or h1,...,hT."""
    spec = spec.strip()
    if not spec:
        return None
    if spec == "mlperf":
        if n_tables != len(MLPERF_HOTNESS):
            raise ValueError(
                f"--multi-hot mlperf gives {len(MLPERF_HOTNESS)} tables' bags, the model "
                f"has {n_tables} tables"
            )
        return MLPERF_HOTNESS
    try:
        sizes = tuple(int(s) for s in spec.split(","))
    except ValueError:
        raise ValueError(
            f"--multi-hot {spec!r}: expected mlperf, an integer or {n_tables} integers"
        ) from None
    if len(sizes) == 1:
        sizes *= n_tables
    if len(sizes) != n_tables or min(sizes) < 1:
        raise ValueError(
            f"--multi-hot {spec!r}: needs {n_tables} ids per bag (one per table), each >= 1"
        )
    return None if max(sizes) == 1 else sizes


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32), elementwise (the bags' draws,
    the tables' stochastic rounding)."""
    x = x ^ (x >> 16)  # a tensor of its own, then changed in place: 3 fewer made
    x.mul_(_MUL).bitwise_and_(_M32)
    x ^= x >> 16
    x.mul_(_MUL).bitwise_and_(_M32)
    x ^= x >> 16
    return x


class Draws(dict[int, torch.Tensor]):
    """Tables' draws, each table's (rows, hotness - 1) int32 a view into one flat buffer
    (``flat``, table t's from ``at[t]``), which :class:`Bags` holds as it is."""

    def __init__(self, flat: torch.Tensor, at: dict[int, int], shapes: dict[int, tuple[int, int]]):
        super().__init__(
            (t, flat[a : a + r * e].view(r, e)) for t, a in at.items() for r, e in [shapes[t]]
        )
        self.flat, self.at = flat, at


def mlperf_draws(sizes: Sequence[int], hotness: Sequence[int], kept: Collection[int]) -> Draws:
    """The other ids of the bags of tables ``kept``, as MLPerf's reference draws them
    (``torchrec_dlrm/multi_hot.py``, uniform): numpy's legacy generator seeded 0, then for
    every table in order ``randint(0, rows, (rows, hotness - 1))``; table t's bag of id i is
    i, then row i of its draws. The kept tables' draws as int32, written into one buffer as
    they are drawn; the tables before the last one kept are drawn too (the stream passes
    through them), a block of rows at a time, and dropped. About 100M ids a second here: a
    table of 40M rows and bags of 100 (feature 20 of the dcnv2 preset) takes 40 s and holds
    15.8 GB."""
    mine = sorted(t for t in set(kept) if hotness[t] > 1)
    shapes = {t: (sizes[t], hotness[t] - 1) for t in mine}
    at, end = {}, 0
    for t in mine:
        at[t], end = end, end + shapes[t][0] * shapes[t][1]
    draws = Draws(torch.empty(end, dtype=torch.int32), at, shapes)
    gen = np.random.RandomState(0)
    for t in range(max(kept, default=-1) + 1):
        rows, extra = sizes[t], hotness[t] - 1
        if rows > np.iinfo(np.int32).max:
            raise ValueError(f"--multi-hot-draws mlperf holds int32 ids: table {t} has {rows} rows")
        for start in range(0, rows if extra else 0, _DRAW_ROWS):
            n = min(_DRAW_ROWS, rows - start)  # (as int32: the same draws, half the bytes)
            block = gen.randint(0, rows, size=(n, extra), dtype=np.int32)
            if t in draws:
                draws[t][start : start + n] = torch.from_numpy(block)
    return draws


def draws_nbytes(sizes: Sequence[int], hotness: Sequence[int], tables: Collection[int]) -> int:
    """What :func:`mlperf_draws` holds for ``tables`` (each once: int32 ids)."""
    return 4 * sum(sizes[t] * (hotness[t] - 1) for t in set(tables))


def mlperf_first_draws(
    sizes: Sequence[int], hotness: Sequence[int], count: int
) -> tuple[int, np.ndarray]:
    """The first table with bags, and :func:`mlperf_draws`' of its first ``count`` rows
    (the stream's first ids: a check of a materialized day draws nothing else)."""
    t = next(t for t, h in enumerate(hotness) if h > 1)
    n = min(count, sizes[t])
    return t, np.random.RandomState(0).randint(0, sizes[t], (n, hotness[t] - 1), np.int32)


def _salt(table: int, slot: int) -> int:
    return int(mix32(torch.tensor((table * 1_000_003 + slot * 7919) & _M32)))


class Bags(nn.Module):
    """The bags of some tables (global ``tables``, in order), in a weight buffer where
    table j's rows start at ``offsets[j]``: for their one-hot ids (B, len(tables)), the
    rows of every bag and where each bag starts.

    Args:
        tables: the tables, as global indices (they choose the hash's salts).
        hotness: ids per bag of every table of the model (global).
        sizes: rows of each of ``tables``.
        offsets: first row of each of ``tables`` in the weight buffer.
        draws: where a bag's other ids come from: None, the hash; else the tables' draws
            (:func:`mlperf_draws`: every table of ``tables`` with bags), held here as they
            are (moved with the tables to their device).
    """

    col: torch.Tensor  # (H,) each id's one-hot column
    salt: torch.Tensor  # (H,) the hash's salt of each (table, slot)
    size: torch.Tensor  # (H,) rows of each id's table
    base: torch.Tensor  # (H,) first row of each id's table in the weight buffer
    first: torch.Tensor  # (H,) the bag's first id: the one-hot id itself
    bag_start: torch.Tensor  # (tables,) where each table's bag starts in a sample's H ids
    drawn: torch.Tensor  # every table's draws, flat (int32; empty: the hash draws)
    stride: torch.Tensor  # (H,) ids drawn a row of each id's table (0 for first ids)
    drawn_at: torch.Tensor  # (H,) where each id's table's draws start, plus its slot

    def __init__(
        self,
        tables: Sequence[int],
        hotness: Sequence[int],
        sizes: Sequence[int],
        offsets: Sequence[int],
        draws: Draws | None = None,
    ) -> None:
        super().__init__()
        at = draws.at if draws is not None else {}  # where each table's draws start
        if draws is not None and (missed := [t for t in tables if hotness[t] > 1 and t not in at]):
            raise ValueError(f"no draws of tables {sorted(set(missed))}, whose bags need them")
        per_id: list[tuple[int, int, int, int, bool, int, int]] = []
        starts = []
        for j, t in enumerate(tables):
            starts.append(len(per_id))
            per_id += [
                (j, _salt(t, k), sizes[j], offsets[j], k == 0, (hotness[t] - 1) * (k > 0),
                 at.get(t, 0) + max(k - 1, 0))
                for k in range(hotness[t])
            ]  # fmt: skip
        self.width = len(per_id)  # H: ids per sample, every table's bag side by side
        columns = zip(*per_id, strict=True)
        names = ("col", "salt", "size", "base", "first", "stride", "drawn_at")
        for name, values in zip(names, columns, strict=True):
            dtype = torch.bool if name == "first" else torch.int64
            self.register_buffer(name, torch.tensor(values, dtype=dtype), persistent=False)
        self.register_buffer("bag_start", torch.tensor(starts, dtype=torch.int64), persistent=False)
        drawn = draws.flat if draws is not None else torch.zeros(0, dtype=torch.int32)
        self.register_buffer("drawn", drawn, persistent=False)

    def ids(self, one_hot: torch.Tensor) -> torch.Tensor:
        """(B, H): each sample's bags, table after table; a bag's first id is the
        one-hot id, the others are drawn from its table (by the hash, or its draws' row)."""
        ids = one_hot.index_select(1, self.col)
        if self.drawn.numel():  # (a first id reads the table's first draw, not taken)
            drawn = self.drawn[ids * self.stride + self.drawn_at].long()
        else:
            lo = (ids ^ (ids >> 32)) & _M32
            drawn = torch.remainder(mix32(mix32(lo) ^ self.salt), self.size)
        return torch.where(self.first, ids, drawn)

    def rows(self, one_hot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The bags' rows in the weight buffer, flat (B x H,), and where each (sample,
        table) bag starts in them (B x tables,)."""
        batch = one_hot.shape[0]
        at = torch.arange(batch, device=one_hot.device, dtype=torch.int64) * self.width
        starts = (at[:, None] + self.bag_start).view(-1)
        return (self.ids(one_hot) + self.base).view(-1), starts
