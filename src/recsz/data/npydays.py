"""Criteo days as TorchRec preprocesses them, read where they lie: a directory of
``day_N_dense.npy`` (float32 (rows, 13), already log-scaled), ``day_N_sparse.npy`` (integer
(rows, 26), the raw 32-bit categories or TorchRec's contiguous ids) and ``day_N_labels.npy``
(integer (rows, 1)), what ``torchrec.datasets.criteo.BinaryCriteoUtils`` writes
(``tsv_to_npys``, ``shuffle``) and MLPerf's DLRM recipes train from. Other data in the same
layout trains a model of its shape (``--dense-features`` dense columns, a sparse column a
table of ``--table-rows``). Each file is
memory-mapped and the days are read one after another as one set, so Terabyte's 24 days
(~1 TB) are not converted or copied; a category becomes the id ``value % table rows``, as
TorchRec's ``num_embeddings_per_feature`` hashing does (0, missing, stays 0).

A day may hold MLPerf DLRM-DCNv2's materialized multi-hot form instead of its sparse
``.npy``: ``day_N_sparse_multi_hot.npz``, one (rows, hotness) array a feature whose first
column is the one-hot id (the rest is a function of it: MLPerf's reference's draws,
:mod:`recsz.model.multihot`); those ids are read, each array memory-mapped inside the
(uncompressed) archive. The run must then make the same bags (:func:`check_bags`).
"""

from __future__ import annotations

import re
import struct
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from recsz.data.criteo import N_DENSE, Arrays

_DAY = re.compile(r"day_(\d+)_dense\.npy")
_KINDS = ("dense", "sparse", "labels")


def holds_days(d: Path) -> bool:
    """Whether directory ``d`` holds TorchRec's day files (and no `recsz preprocess` set)."""
    return not (d / "meta.json").exists() and any(_DAY.fullmatch(p.name) for p in d.iterdir())


def _days(d: Path) -> list[int]:
    """The numbers of ``d``'s days (those with a dense file), in order."""
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _DAY.fullmatch(p.name)))


def load(
    d: Path, table_sizes: Sequence[int], n_dense: int = N_DENSE, labeled: bool = True
) -> Arrays:
    """The days of ``d``, in day order, as one set of rows (memory-mapped), each of
    ``n_dense`` dense values and an id a table; ``labeled`` False: samples to score, their
    labels NaN (a day's labels file, where there is one, is not read)."""
    days = _days(d)
    if not days:
        raise FileNotFoundError(f"{d}: no day_N_dense.npy (TorchRec's preprocessed Criteo days)")
    files: dict[str, list[np.ndarray]] = {k: [] for k in _KINDS}
    for day in days:
        dense = _open(d / f"day_{day}_dense.npy")
        nan = np.broadcast_to(np.float32(np.nan), (dense.shape[0] if dense.ndim else 0, 1))
        got = {"dense": dense, "labels": _open(d / f"day_{day}_labels.npy") if labeled else nan}
        got["sparse"] = _sparse(d, day, len(table_sizes))
        rows = {k: a.shape[0] for k, a in got.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"{d}: day {day}'s files hold different row counts {rows}")
        _check(d / f"day_{day}_dense.npy", got["dense"], n_dense,
               "the model's dense inputs (--dense-features)", np.floating)  # fmt: skip
        _check(d / f"day_{day}_sparse.npy", got["sparse"], len(table_sizes),
               "an id of each of the model's tables (--table-rows)", np.integer)  # fmt: skip
        _check(d / f"day_{day}_labels.npy", got["labels"], 1, "a label a row, 0 or 1",
               np.integer, np.floating, np.bool_)  # fmt: skip
        for k, a in got.items():
            files[k].append(a)
    sizes = np.asarray(table_sizes, dtype=np.int64)
    fields = (
        Days(files["dense"], lambda x, cols: np.array(x, dtype=np.float32)),  # a copy
        Days(files["sparse"], lambda x, cols: np.remainder(x, sizes[cols], dtype=np.int64)),
        Days(files["labels"], lambda x, cols: np.array(x[:, 0], dtype=np.float32)),
    )
    # Array-likes: what a source reads of an array (runs of rows, rows, a column).
    return Arrays(*(cast(np.ndarray, f) for f in fields))


def _sparse(d: Path, day: int, n_cat: int) -> Any:
    """A day's (rows, ``n_cat``) one-hot ids: its sparse ``.npy``, or else the first ids of
    its materialized multi-hot ``.npz``."""
    npz = d / f"day_{day}_sparse_multi_hot.npz"
    if (d / f"day_{day}_sparse.npy").exists() or not npz.exists():
        return _open(d / f"day_{day}_sparse.npy")
    return FirstIds(npz, n_cat)


def check_bags(
    d: Path, table_sizes: Sequence[int], hotness: Sequence[int] | None, draws: str
) -> None:
    """A ValueError naming the file where ``d``'s materialized multi-hot days (its first)
    hold other bags than the run makes: other sizes, or bags not MLPerf's reference's draws
    (those of its first rows' ids below 2^20 of the first table with bags, checked against
    them); nothing for one-hot days."""
    from recsz.model.multihot import mlperf_first_draws

    days = _days(d)
    first = _sparse(d, days[0], len(table_sizes)) if days else None
    if not isinstance(first, FirstIds):
        return
    spec = ",".join(map(str, first.widths))
    if tuple(hotness or ()) != first.widths or draws != "mlperf":
        raise ValueError(f"{first.path}: MLPerf's materialized bags of {spec} ids; train on it "
                         f"with --multi-hot {spec} --multi-hot-draws mlperf (the same bags, "
                         f"made from its first ids)")  # fmt: skip
    t, want = mlperf_first_draws(table_sizes, first.widths, 1 << 20)
    bags = first.members[t][:10_000]
    ids = bags[:, 0].astype(np.int64)
    seen = ids < len(want)
    if not np.array_equal(bags[seen, 1:], want[ids[seen]]):
        raise ValueError(f"{first.path}: feature {t}'s bags are not MLPerf's reference's "
                         "draws (numpy seeded 0, uniform) over these tables' rows")  # fmt: skip


class FirstIds:
    """A materialized multi-hot day's one-hot ids: the first id of each feature's bag, read
    by rows as a (rows, ``n_cat``) array, from each feature's array memory-mapped in the
    archive."""

    def __init__(self, path: Path, n_cat: int) -> None:
        self.path = path
        self.members = _members(path, n_cat)
        lengths = {len(m) for m in self.members}
        if len(lengths) != 1:
            raise ValueError(f"{path}: its features hold different row counts {lengths}")
        self.shape = (lengths.pop(), n_cat)
        self.dtype = self.members[0].dtype
        self.widths = tuple(int(m.shape[1]) for m in self.members)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: Any) -> np.ndarray:
        return np.stack([m[rows, 0] for m in self.members], 1)


def _members(path: Path, n_cat: int) -> list[np.ndarray]:
    """Features 0..n_cat-1 of an ``np.savez`` archive (stored, not compressed),
    memory-mapped."""
    out: list[np.ndarray] = []
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as f:
            for j in range(n_cat):
                info = z.NameToInfo.get(f"{j}.npy")
                if info is None:
                    raise ValueError(f"{path}: no array {j} (a materialized day holds "
                                     f"0..{n_cat - 1}, one a table)")  # fmt: skip
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"{path}: array {j} is compressed; only np.savez's stored "
                                     "arrays are read where they lie")  # fmt: skip
                f.seek(info.header_offset + 26)  # the local header: its name's and extra's lengths
                name, extra = struct.unpack("<HH", f.read(4))
                f.seek(info.header_offset + 30 + name + extra)
                try:
                    major, _ = np.lib.format.read_magic(f)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if major == 1
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, fortran, dtype = read(f)
                except ValueError as e:
                    raise ValueError(f"{path}: array {j} is not a .npy array ({e})") from e
                if fortran or len(shape) != 2 or not np.issubdtype(dtype, np.integer):
                    raise ValueError(f"{path}: array {j} is {dtype} {shape}, expected integer "
                                     "(rows, ids a bag)")  # fmt: skip
                out.append(np.memmap(path, dtype, "r", offset=f.tell(), shape=shape))
    except (zipfile.BadZipFile, OSError, struct.error) as e:
        raise ValueError(f"{path}: not an .npz archive numpy wrote ({e})") from e
    return out


def _open(path: Path) -> np.ndarray:
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (each day needs its dense, sparse and labels)")
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from e


def _check(path: Path, a: np.ndarray, width: int, what: str, *kinds: Any) -> None:
    """A ValueError naming ``path`` unless ``a`` is (rows, ``width``) of a dtype of one of
    ``kinds`` (numpy's abstract types: ``np.integer``...); ``what`` says what it holds."""
    if a.shape[1:] != (width,) or not any(np.issubdtype(a.dtype, k) for k in kinds):
        named = " or ".join(k.__name__ for k in kinds)
        raise ValueError(
            f"{path}: {a.dtype} {a.shape}, expected {named} (rows, {width}): {what}, "
            "as TorchRec's BinaryCriteoUtils writes"
        )


class Days:
    """Several memory-mapped arrays' rows one after another, as one array of rows, each
    read through ``convert(rows, columns)`` (the ids' modulo, the labels' shape; it
    returns a new array, never the file's memory): by a
    slice (a view, read when made an array: ``np.array(days[a:b])``), by row indices, or
    by row indices and one column."""

    def __init__(
        self,
        parts: list[np.ndarray],
        convert: Callable[[np.ndarray, Any], np.ndarray],
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self._parts, self._convert = parts, convert
        self._ends = np.cumsum([len(p) for p in parts])
        self._start = start
        self._stop = int(self._ends[-1]) if stop is None else stop
        empty = convert(parts[0][:0], slice(None))
        self.shape = (self._stop - self._start, *empty.shape[1:])
        self.dtype = empty.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The rows of this run, each day's read in one sweep."""
        pieces, first = [], 0
        for part, end in zip(self._parts, self._ends, strict=True):
            lo, hi = max(self._start, first), min(self._stop, int(end))
            if lo < hi:
                pieces.append(self._convert(part[lo - first : hi - first], slice(None)))
            first = int(end)
        if not pieces:
            pieces.append(self._convert(self._parts[0][:0], slice(None)))
        out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, key: Any) -> Any:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        if isinstance(rows, slice):
            a, b, step = rows.indices(len(self))
            if step != 1 or cols != slice(None):
                raise IndexError("days are sliced by runs of whole rows")
            return Days(self._parts, self._convert, self._start + a, self._start + max(a, b))
        idx = np.asarray(rows, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"rows {idx.min()}..{idx.max()} of {len(self)}")
        return self._read(idx + self._start, cols)

    def _read(self, idx: np.ndarray, cols: Any) -> np.ndarray:
        """Rows ``idx`` (of all days), each day's gathered from its file; rows in order
        (a source sorts a batch's) are read day after day and joined, any others placed."""
        day = np.searchsorted(self._ends, idx, side="right")
        ordered = bool((day[1:] >= day[:-1]).all())
        order = np.arange(len(idx)) if ordered else np.argsort(day, kind="stable")
        days = day[order]
        cuts = np.flatnonzero(days[1:] != days[:-1]) + 1
        pieces = []
        for run in np.split(order, cuts) if len(idx) else []:
            k = int(day[run[0]])
            mine = idx[run] - (self._ends[k - 1] if k else 0)
            pieces.append(self._convert(self._parts[k][mine][:, cols], cols))
        if not pieces:
            return self._convert(self._parts[0][:0][:, cols], cols)
        if len(pieces) == 1 and ordered:
            return pieces[0]
        joined = np.concatenate(pieces)
        if ordered:
            return joined
        out = np.empty_like(joined)
        out[order] = joined
        return out
