"""Where batches come from: the synthetic generator, a raw Criteo file or a preprocessed one.

Every batch is a pure function of (seed, step), so each rank of a distributed job can read
the same global batch (the table owners need every sample's ids) and a resumed run sees
exactly the batches it would have seen. A rank asks for its :class:`Part` of it: a source
may leave what the rank never reads as 0 (the generator does; W ranks make about 1/W of
it each instead of all of it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recsz import hostmemory
from recsz.data import criteo, npydays, preprocessed
from recsz.data.criteo import FIELDS, N_DENSE
from recsz.data.synthetic import SyntheticCriteo

#: The share of a file's rows held out for evaluation by default (its last rows).
EVAL_FRACTION = 0.2

#: The orders of a file's training rows in an epoch: ``rows``, a permutation of them all
#: (8 bytes a row, and each batch read from rows anywhere in the file); ``batches``, a
#: permutation of the epoch's batches of contiguous rows (8 bytes a batch, each batch read
#: in one sweep: for data preprocessed shuffled, as MLPerf's Terabyte is, or too large for
#: the first); ``auto``: rows up to :data:`ROWS_ORDER_MAX` training rows, batches above.
DATA_ORDERS = ("auto", "rows", "batches")
ROWS_ORDER_MAX = 1 << 27  # a permutation of 1 GiB


@dataclass
class Batch:
    """dense (B, 13) float32, ids (B, 26) int64, labels (B,) float32 (a model of other
    tables or dense inputs: as many columns)."""

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(self.dense[start:stop], self.ids[start:stop], self.labels[start:stop])

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device`` (itself when it is there already)."""
        if self.labels.device == device:
            return self
        moved = (t.to(device, non_blocking=True) for t in (self.dense, self.ids, self.labels))
        return Batch(*moved)

    def padded(self, n: int) -> Batch:
        """The batch with rows of zeros after its own up to ``n`` (id 0 of every table)."""
        extra = n - len(self)
        if extra <= 0:
            return self
        fields = (self.dense, self.ids, self.labels)
        return Batch(*(torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) for t in fields))

    def pin_memory(self) -> Batch:
        return Batch(self.dense.pin_memory(), self.ids.pin_memory(), self.labels.pin_memory())


@dataclass(frozen=True)
class Part:
    """What one rank reads of a global batch: every value of its samples (the ``rank``-th
    of ``world`` equal slices) and, of every sample, the ids of ``tables`` (those it looks
    up for the whole batch)."""

    rank: int
    world: int
    tables: tuple[int, ...]

    def rows(self, n: int) -> slice:
        """The rank's samples of a global batch of ``n``: the ``rank``-th slice of
        ceil(n / world) (a batch that does not divide, the evaluation set's last, leaves
        the last ranks fewer samples, or none)."""
        b = -(-n // self.world)
        return slice(min(n, self.rank * b), min(n, (self.rank + 1) * b))


def to_batch(a: criteo.Arrays) -> Batch:
    return Batch(
        torch.from_numpy(np.ascontiguousarray(a.dense, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(a.cats, dtype=np.int64)),
        torch.from_numpy(np.ascontiguousarray(a.labels, dtype=np.float32)),
    )


class DataSource:
    """Training batches by step, and a fixed evaluation set."""

    name: str
    n_train: int | None  # None: an endless stream
    skipped_lines: int = 0  # malformed input lines left out (--skip-bad-lines)
    labeled: bool = True  # False: its batches' labels are NaN (Criteo's test layout)

    def train_batch(self, step: int, batch_size: int, part: Part | None = None) -> Batch:
        """The global batch of ``step``; with ``part``, its values that ``part`` names
        (any other may be 0)."""
        raise NotImplementedError

    def train_batches(
        self, steps: Iterable[int], batch_size: int, part: Part | None = None
    ) -> Iterator[Batch]:
        """The training batches of ``steps``, each made when asked for."""
        return (self.train_batch(step, batch_size, part) for step in steps)

    def eval_batches(self, batch_size: int, part: Part | None = None) -> Iterator[Batch]:
        """The evaluation set in batches of ``batch_size`` (the last may be smaller); with
        ``part``, the values it names (any other may be 0)."""
        raise NotImplementedError

    def steps_per_epoch(self, batch_size: int) -> int | None:
        if self.n_train is None:
            return None
        return max(1, self.n_train // batch_size)


class SyntheticSource(DataSource):
    """The built-in generator: an endless training stream and a fixed eval set (``kw``:
    :class:`SyntheticCriteo`'s, ``n_dense`` among them)."""

    def __init__(
        self, table_sizes: Sequence[int], seed: int, n_eval: int = 20_000, **kw: object
    ) -> None:
        self.gen = SyntheticCriteo(table_sizes, seed=seed, **kw)  # type: ignore[arg-type]
        self.name = "synthetic"
        self.n_train = None
        self.n_eval = n_eval

    def train_batch(self, step: int, batch_size: int, part: Part | None = None) -> Batch:
        if part is None:
            return to_batch(self.gen.block(0, step, batch_size))
        return to_batch(self.gen.block(0, step, batch_size, part.rows(batch_size), part.tables))

    def eval_batches(self, batch_size: int, part: Part | None = None) -> Iterator[Batch]:
        # One block, so that the set is the same whatever the batches' size (and the ranks').
        for start in range(0, self.n_eval, batch_size):
            span = slice(start, min(self.n_eval, start + batch_size))
            n = span.stop - start
            rows, tables = (None, ()) if part is None else (part.rows(n), part.tables)
            yield to_batch(self.gen.block(1, 0, self.n_eval, rows, tables, span))


class ArraySource(DataSource):
    """Rows of a file: the first (1 - eval_frac) train, the rest evaluate; or, with
    ``held_out`` (the rows of another file, named ``held_out_name``), all train and those
    evaluate.

    Training order is a fresh permutation each epoch (of the rows or of the batches:
    ``order``, :data:`DATA_ORDERS`), drawn from (seed, epoch); the remainder of an epoch
    that does not fill a batch is dropped. ``labeled`` False: samples to score, their
    labels NaN (not checked).
    """

    def __init__(
        self,
        arrays: criteo.Arrays,
        seed: int,
        eval_frac: float = EVAL_FRACTION,
        name: str = "file",
        table_sizes: Sequence[int] = (),
        skipped_lines: int = 0,
        held_out: criteo.Arrays | None = None,
        held_out_name: str = "eval file",
        order: str = "auto",
        labeled: bool = True,
    ) -> None:
        n = len(arrays)
        if held_out is None:
            if not 0.0 < eval_frac < 1.0:
                raise ValueError(f"--eval-fraction must be in (0, 1), got {eval_frac}")
            n_eval = max(1, round(n * eval_frac))
            if n - n_eval < 1:
                raise ValueError(f"{name}: {n} rows are too few to split into train and eval")
            k = self._first_held_out = n - n_eval  # its rows are named as in the file
            held_out = criteo.Arrays(arrays.dense[k:], arrays.cats[k:], arrays.labels[k:])
            held_out_name = name
        else:
            n_eval, self._first_held_out = 0, 0
        self.arrays = arrays
        self.held_out, self.held_out_name = held_out, held_out_name
        self.seed = seed
        self.name = name
        self.labeled = labeled
        self.table_sizes = list(table_sizes) or [2**62] * arrays.cats.shape[1]
        self.skipped_lines = skipped_lines
        self.n_train = n - n_eval
        if order not in DATA_ORDERS:
            raise ValueError(f"--data-order {order!r} is not one of: {', '.join(DATA_ORDERS)}")
        if order == "auto":
            order = "rows" if self.n_train <= ROWS_ORDER_MAX else "batches"
        self.order = order
        self._perm_epoch = -1
        self._perm = np.arange(0)

    def _rows(
        self, idx: np.ndarray | slice, held_out: bool = False, part: Part | None = None
    ) -> Batch:
        """The rows ``idx`` (indices, or a slice: contiguous, read in one sweep); of rows
        read one by one, only ``part``'s values (those of a slice cost little more)."""
        a = self.held_out if held_out else self.arrays
        name = self.held_out_name if held_out else self.name
        first = self._first_held_out if held_out else 0
        if isinstance(idx, slice):  # a copy: a batch never shares the source's memory
            first += idx.start
            blk = criteo.Arrays(*(np.array(x[idx]) for x in (a.dense, a.cats, a.labels)))
        else:
            idx = np.sort(idx) if isinstance(a.dense, (np.memmap, npydays.Days)) else idx
            blk = _gather(a, idx, part)
        # Arrays may come from files edited or damaged after preprocessing: refuse values
        # no Criteo line can produce, naming the row, before they reach a model.
        bad_label = (blk.labels != 0) & (blk.labels != 1) & self.labeled  # (else NaN)
        bad_dense = ~np.isfinite(blk.dense).all(1)
        bad_ids = ((blk.cats < 0) | (blk.cats >= np.asarray(self.table_sizes))).any(1)
        bad = bad_label | bad_dense | bad_ids
        if bad.any():
            i = int(np.argmax(bad))
            what = (
                f"label {float(blk.labels[i])!r} is not 0 or 1"
                if bad_label[i]
                else "a dense value is not finite"
                if bad_dense[i]
                else "a categorical id is outside its table"
            )
            row = first + (i if isinstance(idx, slice) else int(idx[i]))
            raise criteo.CriteoFormatError(f"{name}: row {row}: {what}")
        return to_batch(blk)

    def train_batch(self, step: int, batch_size: int, part: Part | None = None) -> Batch:
        assert self.n_train is not None
        if batch_size > self.n_train:
            raise ValueError(
                f"{self.name}: batch size {batch_size} exceeds the {self.n_train} training rows"
            )
        spe = self.n_train // batch_size
        epoch, pos = divmod(step, spe)
        whole = self.order == "batches"  # permute the epoch's batches, not its rows
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, 3, epoch])
            self._perm = rng.permutation(spe if whole else self.n_train)
            self._perm_epoch = epoch
        if whole:
            start = int(self._perm[pos]) * batch_size
            return self._rows(slice(start, start + batch_size))
        return self._rows(self._perm[pos * batch_size : (pos + 1) * batch_size], part=part)

    def eval_batches(self, batch_size: int, part: Part | None = None) -> Iterator[Batch]:
        # Contiguous rows: read whole in one sweep, whatever the part.
        n = len(self.held_out)
        for start in range(0, n, batch_size):
            yield self._rows(slice(start, min(n, start + batch_size)), held_out=True)


def _gather(a: criteo.Arrays, idx: np.ndarray, part: Part | None) -> criteo.Arrays:
    """Rows ``idx`` of ``a``; with ``part``, only its values (the rest 0), where that reads
    less: a column is gathered value by value, a row at once, and a part of more than a
    third of the tables took longer than the whole rows (benchmarks/README.md, "A rank's
    part of the batch")."""
    if part is None or 3 * len(part.tables) > a.cats.shape[1]:
        return criteo.Arrays(a.dense[idx], a.cats[idx], a.labels[idx])
    rows = part.rows(len(idx))
    whole = [getattr(a, f) for f in FIELDS]
    out = criteo.Arrays(*(np.zeros((len(idx), *x.shape[1:]), x.dtype) for x in whole))
    for t in part.tables:  # a column of the rows: no other column's values copied
        out.cats[:, t] = a.cats[idx, t]
    for x, f in zip(whole, FIELDS, strict=True):
        getattr(out, f)[rows] = x[idx[rows]]
    return out


def make_source(
    data: str,
    table_sizes: Sequence[int],
    seed: int,
    skip_bad_lines: bool = False,
    synthetic_eval: int = 20_000,
    eval_frac: float | None = None,
    eval_data: str | None = None,
    order: str = "auto",
    n_dense: int = N_DENSE,
) -> DataSource:
    """``synthetic`` (``synthetic_eval`` held-out samples), a raw Criteo TSV file, a
    directory made by ``recsz preprocess`` or one of TorchRec's preprocessed days: its
    last ``eval_frac`` held out, or, with ``eval_data`` (another such file or directory,
    e.g. Terabyte's day_23), all of it trains and that evaluates. ``eval_frac`` None:
    :data:`EVAL_FRACTION`; ``order``: a file's training order (:data:`DATA_ORDERS`);
    ``n_dense``: the dense inputs a sample (a model of other tables and inputs than
    Criteo's reads synthetic data or .npy days of its shape)."""
    if data == "synthetic":
        if eval_data is not None:
            raise ValueError("--eval-data needs --data from a file: the generator's samples "
                             "are not the held-out file's")  # fmt: skip
        return SyntheticSource(table_sizes, seed, synthetic_eval, n_dense=n_dense)
    named = {"--data": data, "--eval-data": eval_data}
    _check_room([(f, Path(d)) for f, d in named.items() if d is not None and Path(d).is_file()])
    arrays, skipped = _read(data, "--data", table_sizes, skip_bad_lines, n_dense)
    held_out = None if eval_data is None else _read(eval_data, "--eval-data", table_sizes,
                                                    skip_bad_lines, n_dense)[0]  # fmt: skip
    frac = EVAL_FRACTION if eval_frac is None else eval_frac
    return ArraySource(arrays, seed, frac, str(data), table_sizes, skipped, held_out,
                       str(eval_data), order)  # fmt: skip


def held_out_source(
    eval_data: str,
    table_sizes: Sequence[int],
    skip_bad_lines: bool = False,
    n_dense: int = N_DENSE,
) -> DataSource:
    """``eval_data`` (a raw Criteo TSV, a `recsz preprocess` directory or TorchRec's days)
    as an evaluation set alone: a model trained elsewhere evaluated on it (a raw file
    streamed, :mod:`recsz.data.stream`; a directory memory-mapped)."""
    if Path(eval_data).is_file():
        from recsz.data.stream import RawStream

        return RawStream([eval_data], table_sizes, skip_bad_lines, n_dense=n_dense)
    rows = _read(eval_data, "--eval-data", table_sizes, skip_bad_lines, n_dense)[0]
    return _held_out_alone(rows, eval_data, table_sizes)


def unlabeled_source(days: str, table_sizes: Sequence[int], n_dense: int = N_DENSE) -> DataSource:
    """TorchRec-layout ``.npy`` days (directory ``days``) as samples to score alone
    (``recsz predict``): their labels NaN, a day's labels file not needed."""
    rows = npydays.load(Path(days), table_sizes, n_dense, labeled=False)
    return _held_out_alone(rows, days, table_sizes, labeled=False)


def _held_out_alone(
    rows: criteo.Arrays, name: str, table_sizes: Sequence[int], labeled: bool = True
) -> ArraySource:
    """``rows`` (named ``name``) as an evaluation set alone: all of them held out."""
    return ArraySource(rows, 0, name=name, table_sizes=table_sizes, held_out=rows,
                       held_out_name=name, labeled=labeled)  # fmt: skip


def check_criteo_layout(flag: str, data: str, n_tables: int, n_dense: int) -> None:
    """Where ``data`` is in Criteo's layout (a raw file, a `recsz preprocess` directory), a
    ValueError naming ``flag`` and it unless the model (``n_tables``, ``n_dense``) is
    Criteo's shape (:func:`criteo.check_layout`); nothing for anything else."""
    p = Path(data)
    if p.is_file() or (p / "meta.json").exists():
        criteo.check_layout(f"{flag} {data}", n_tables, n_dense)


def _read(
    data: str, flag: str, table_sizes: Sequence[int], skip_bad_lines: bool, n_dense: int
) -> tuple[criteo.Arrays, int]:
    """The rows of a raw Criteo file or a preprocessed directory, and the lines skipped."""
    p = Path(data)
    if p.is_dir() and npydays.holds_days(p):  # TorchRec's .npy days, read where they lie
        return npydays.load(p, table_sizes, n_dense), 0
    check_criteo_layout(flag, data, len(table_sizes), n_dense)
    if p.is_dir():
        arrays = preprocessed.load(p, table_sizes)
        skipped = int(json.loads((p / "meta.json").read_text()).get("skipped_lines", 0))
        return arrays, skipped
    if not p.exists():
        raise FileNotFoundError(f"{flag} {data}: no such file or directory")
    stats = criteo.ParseStats()
    arrays = criteo.read(p, table_sizes, skip_bad_lines=skip_bad_lines, stats=stats)
    if stats.skipped:
        print(f"{p}: skipped {stats.skipped} bad lines (first: {stats.first_error})")
    return arrays, stats.skipped


#: Host memory while a raw file is read into arrays, per byte of its text: a row's arrays
#: take ~1.09x its line (264 bytes against ~242 on the real sample), the blocks read and
#: their concatenation are both held at the end; a gzipped file's text taken as 4x its size.
RAW_READ_BYTES_PER_BYTE = 2.2
GZIP_TEXT_PER_BYTE = 4


def _check_room(raws: list[tuple[str, Path]]) -> None:
    """Refuse, before reading them, raw files (flag, path) whose arrays would not fit
    together in this host's available memory on every local rank (each reads its own
    copy): an out-of-memory kill in the middle of a run names nothing; a preprocessed
    directory is memory-mapped once."""
    available = hostmemory.available() if raws else None
    if available is None:
        return
    text = sum(p.stat().st_size * (GZIP_TEXT_PER_BYTE if p.suffix == ".gz" else 1)
               for _, p in raws)  # fmt: skip
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = RAW_READ_BYTES_PER_BYTE * text * ranks
    if need > available:
        gib, named = 2.0**30, ", ".join(f"{flag} {p}" for flag, p in raws)
        raise MemoryError(
            f"{named}: reading these raw files takes about {need / ranks / gib:.1f} GiB "
            f"of memory on each of this host's {ranks} rank(s), {need / gib:.1f} GiB in all, "
            f"more than the {available / gib:.1f} GiB available; preprocess them once "
            f"(`recsz preprocess FILE DIR`) and give DIR instead (memory-mapped, shared "
            "by the ranks)"
        )
