"""Reader for the Criteo Display Advertising Challenge layout (its binary form:
:mod:`recsz.data.preprocessed`).

One sample per line, tab separated, 40 fields: label (0/1), 13 integer counts I1..I13
(may be empty or negative), 26 categorical features C1..C26 (32-bit hexadecimal hashes,
may be empty). The Terabyte ``day_N`` files share the layout.

Conventions (as in facebookresearch/dlrm and MLPerf):
- a missing count is 0, a negative count is clamped to 0, dense = log(1 + x);
- a categorical hex string is hashed into its table's size; id 0 of every table is
  reserved for "missing", so a present value maps to ``1 + h % (size - 1)``;
- lines whose trailing empty fields were stripped are padded, never rejected, as long as
  they reach the first category (a shorter line is no Criteo sample);
- anything else that does not parse raises :class:`CriteoFormatError` naming the file,
  the line and the field, unless ``skip_bad_lines`` is set, in which case the line is
  counted and reported.
"""

from __future__ import annotations

import gzip
import io
import itertools
import math
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from recsz.data.fastparse import parse_lines

N_DENSE = 13
N_CAT = 26
N_FIELDS = 1 + N_DENSE + N_CAT


T = TypeVar("T")
R = TypeVar("R")


class CriteoFormatError(ValueError):
    """A line of a Criteo file could not be parsed; the message names file:line:field."""


#: What a model of other tables or dense inputs than Criteo's reads instead of its files.
OTHER_DATA = "give it --data synthetic, or TorchRec-layout .npy days of its shape"


def check_layout(name: str, n_tables: int, n_dense: int, instead: str = OTHER_DATA) -> None:
    """A ValueError where a model of ``n_tables`` tables and ``n_dense`` dense inputs is to
    read Criteo's files (``name``: what is read), which hold 26 and 13 columns; it ends in
    ``instead``, what to do."""
    if (n_tables, n_dense) != (N_CAT, N_DENSE):
        raise ValueError(
            f"{name}: Criteo's files hold {N_DENSE} dense and {N_CAT} categorical columns, and "
            f"this model takes {n_dense} dense inputs and {n_tables} tables (--dense-features, "
            f'--table-rows): {instead} (README, "Your own data")'
        )


#: Counts beyond this are not Criteo counts (they would overflow log1p and int64).
_MAX_COUNT = 2**63 - 1


def _show(s: str, limit: int = 40) -> str:
    """A field for an error message: quoted, and cut when long (a 30 MB field must not
    make a 30 MB message)."""
    return repr(s) if len(s) <= limit else f"{s[:limit]!r}... ({len(s)} characters)"


#: The fields of :class:`Arrays`.
FIELDS = ("dense", "cats", "labels")


@dataclass
class Arrays:
    """A block of samples: dense (N, 13) float32, cats (N, 26) int64, labels (N,) float32."""

    dense: np.ndarray
    cats: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _mix32(h: int) -> int:
    """A 32-bit finalizer (murmur3 fmix32): spreads the raw hash before the modulo."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def hash_category(value: int, size: int) -> int:
    """Map a raw 32-bit category to an id in [1, size) (0 means missing)."""
    return 1 + _mix32(value) % (size - 1)


@dataclass
class ParseStats:
    """Counters a reader keeps so that skipped lines are reported, never hidden."""

    lines: int = 0
    padded: int = 0
    skipped: int = 0
    bytes: int = 0
    first_error: str = ""


def parse_line(
    line: str, table_sizes: Sequence[int], where: str = "<input>", labeled: bool = True
) -> tuple[float, list[float], list[int], bool]:
    """Parse one line into (label, dense[13], ids[26], padded); ``labeled`` False: a line of
    Criteo's test layout (39 fields, no label; the label returned is NaN).

    Raises CriteoFormatError naming ``where`` (file:line) and the field at fault.
    """
    fields = line.rstrip("\r\n").split("\t")
    given = len(fields)
    first = int(labeled)  # the first count's field, from 0
    width = first + N_DENSE + N_CAT
    if given > width:
        hint = "" if labeled else " (a labeled line? `recsz evaluate` scores those)"
        raise CriteoFormatError(f"{where}: {given} fields, expected at most {width}{hint}")
    padded = given < width
    if padded:
        if line.strip() == "":
            raise CriteoFormatError(f"{where}: empty line")
        fields = fields + [""] * (width - len(fields))
    lab = fields[0] if labeled else "nan"
    test_layout = " (an unlabeled line, Criteo's test layout? `recsz predict` scores those)"
    if labeled and lab not in ("0", "1"):
        raise CriteoFormatError(
            f"{where}: field 1 (label): {_show(lab)} is not 0 or 1{test_layout}"
        )
    try:
        dense, ids = _values(fields, first, table_sizes, where)
    except CriteoFormatError as e:
        if labeled and given == width - 1:  # one field short of a labeled line
            raise CriteoFormatError(f"{e}{test_layout}") from None
        raise
    if given <= first + N_DENSE:  # not one category: no Criteo sample, a file of another kind
        raise CriteoFormatError(
            f"{where}: {given} field{'s' * (given > 1)}, none of them a category: a Criteo line "
            f"holds {width} ({'label, ' if labeled else ''}13 counts, 26 categories), at least "
            f"{first + N_DENSE + 1} where its trailing empty fields were stripped"
        )
    return float(lab), dense, ids, padded


def _values(
    fields: list[str], first: int, table_sizes: Sequence[int], where: str
) -> tuple[list[float], list[int]]:
    """The counts (log1p) and the hashed categories of a line's ``fields`` (the first count
    at ``first``)."""
    dense: list[float] = []
    for j in range(N_DENSE):
        s = fields[first + j]
        if s == "":
            v = 0
        else:
            try:
                v = int(s) if len(s) <= 20 else _MAX_COUNT + 1
            except ValueError:
                raise CriteoFormatError(
                    f"{where}: field {first + 1 + j} (I{j + 1}): {_show(s)} is not an integer"
                ) from None
            if abs(v) > _MAX_COUNT:
                raise CriteoFormatError(
                    f"{where}: field {first + 1 + j} (I{j + 1}): {_show(s)} is too large for a "
                    "count"
                )
        dense.append(math.log1p(v) if v > 0 else 0.0)
    ids: list[int] = []
    for j in range(N_CAT):
        s = fields[first + N_DENSE + j]
        if s == "":
            ids.append(0)
            continue
        if len(s) > 8:
            raise CriteoFormatError(
                f"{where}: field {first + 1 + N_DENSE + j} (C{j + 1}): {_show(s)} is longer than "
                "8 hex digits"
            )
        try:
            raw = int(s, 16)
        except ValueError:
            raise CriteoFormatError(
                f"{where}: field {first + 1 + N_DENSE + j} (C{j + 1}): {_show(s)} is not "
                "hexadecimal"
            ) from None
        ids.append(hash_category(raw, table_sizes[j]))
    return dense, ids


def iter_blocks(
    path: str | os.PathLike[str],
    table_sizes: Sequence[int],
    block_rows: int = 65536,
    skip_bad_lines: bool = False,
    stats: ParseStats | None = None,
    chunk_bytes: int = 1 << 24,
    labeled: bool = True,
    threads: int | None = None,
) -> Iterator[Arrays]:
    """Stream a raw Criteo file as blocks of ``block_rows`` samples (the last: the rest);
    ``labeled`` False: a file of Criteo's test layout (no labels; NaN in their place).

    Reads ``chunk_bytes`` at a time, so any file size streams in bounded memory. The
    lines of the usual form are parsed in compiled code (:mod:`recsz.data.fastparse`), the
    pieces of whole lines on ``threads`` threads at once (default :func:`parse_threads`),
    the others by :func:`parse_line`, which pads them or names what is wrong, in the
    file's order: the samples and the errors do not depend on ``threads``.
    """
    if len(table_sizes) != N_CAT:
        raise ValueError(f"need {N_CAT} table sizes, got {len(table_sizes)}")
    stats = stats if stats is not None else ParseStats()
    sizes = np.asarray(table_sizes, dtype=np.int64)
    threads = parse_threads() if threads is None else threads

    def compiled(piece: tuple[bytes, int]) -> tuple[np.ndarray, ...]:
        return parse_lines(np.frombuffer(piece[0], np.uint8), sizes, labeled)

    pending: Arrays | None = None  # parsed, not yet yielded
    opener = gzip.open if str(path).endswith(".gz") else open  # Terabyte's days: day_N.gz
    with opener(path, "rb") as f:  # bytes: a bad byte is one bad line, not a lost position
        pieces = _whole_lines(f, chunk_bytes, path)
        for (data, first), parsed in _parsed(compiled, pieces, threads):
            stats.bytes += len(data)
            blk = _finish(parsed, data, path, first, table_sizes, skip_bad_lines, stats, labeled)
            if pending is not None:
                blk = Arrays(
                    *(np.concatenate([getattr(pending, f), getattr(blk, f)]) for f in FIELDS)
                )
            start = 0
            while len(blk) - start >= block_rows:
                yield _rows(blk, start, start + block_rows)
                start += block_rows
            pending = _rows(blk, start, len(blk)) if start < len(blk) else None
    if pending is not None:
        yield pending


#: the most threads one reader parses with (a file's pieces are read one after another)
PARSE_THREADS = 8


def parse_threads() -> int:
    """The threads a reader parses with: this process's cores shared by the host's ranks
    (``LOCAL_WORLD_SIZE``, each parses its copy), at most :data:`PARSE_THREADS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(PARSE_THREADS, (cores or 1) // ranks))


def _whole_lines(
    f: io.BufferedIOBase, chunk_bytes: int, path: str | os.PathLike[str]
) -> Iterator[tuple[bytes, int]]:
    """The file's bytes as pieces of whole lines of about ``chunk_bytes`` (the last: the
    rest, which may lack its newline), each with the count of lines before it."""
    rest, lines = b"", 0
    while True:
        chunk = _read_chunk(f, chunk_bytes, path, lines)
        data = rest + chunk
        cut = data.rfind(b"\n") + 1 if chunk else len(data)  # whole lines; at the end all
        data, rest = data[:cut], data[cut:]
        if not data:
            if chunk:
                continue  # a line longer than a chunk: read on
            return
        yield data, lines
        lines += data.count(b"\n")


def in_order(
    fn: Callable[[T], R], items: Iterable[T], pool: Executor, limit: int
) -> Iterator[tuple[T, R]]:
    """Each of ``items`` with ``fn`` of it, in the items' order, ``fn`` run on ``pool``: at
    most ``limit`` items taken and not yet done with, the one the consumer holds counted
    (the next is taken when the consumer asks for the one after it): bounded memory, or
    disk (``recsz preprocess``'s parts)."""
    rest = iter(items)
    ahead = deque((x, pool.submit(fn, x)) for x in itertools.islice(rest, limit))
    while ahead:
        item, done = ahead.popleft()
        yield item, done.result()
        ahead.extend((x, pool.submit(fn, x)) for x in itertools.islice(rest, 1))


def _parsed(fn: Callable[[T], R], pieces: Iterator[T], threads: int) -> Iterator[tuple[T, R]]:
    """:func:`in_order` on ``threads`` threads (each parsing while the reader finishes the
    piece before); one: in this thread."""
    if threads <= 1:
        yield from ((p, fn(p)) for p in pieces)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="recsz-parse")
    try:
        yield from in_order(fn, pieces, pool, threads + 1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


#: a gzipped file is read this much at a time, so that damage is placed within it
GZ_PIECE = 1 << 16


def _read_chunk(
    f: io.BufferedIOBase, size: int, path: str | os.PathLike[str], lines: int
) -> bytes | bytearray:
    """The next ``size`` bytes of ``f`` (``lines``: those read before, all whole); a
    gzipped file cut short or damaged is named, with the line up to which it is whole (to
    within :data:`GZ_PIECE` bytes), not a traceback of the gzip module's."""
    if not isinstance(f, gzip.GzipFile):
        return f.read(size)
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    try:
        while got < size and (n := f.readinto(view[got : got + GZ_PIECE])):
            got += n
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        whole = lines + buf.count(b"\n", 0, got)
        raise CriteoFormatError(
            f"{path}: damaged or truncated gzip data: whole up to line {whole}, damaged or "
            f"cut short within the {GZ_PIECE >> 10} KB after it ({e})"
        ) from None
    finally:
        view.release()
    del buf[got:]
    return buf


def _finish(
    parsed: tuple[np.ndarray, ...],
    data: bytes,
    path: str | os.PathLike[str],
    first_line: int,
    table_sizes: Sequence[int],
    skip_bad_lines: bool,
    stats: ParseStats,
    labeled: bool,
) -> Arrays:
    """The samples of the whole lines ``data`` (line ``first_line + 1`` first) from their
    compiled parse (:func:`recsz.data.fastparse.parse_lines`): the lines it left parsed by
    :func:`parse_line` and the bad ones named or skipped."""
    labels, dense, ids, ok, starts = parsed
    keep = ok.copy()
    for i in np.flatnonzero(~ok):  # the lines the compiled path left to parse_line
        raw = data[starts[i] : starts[i + 1]]
        if raw in (b"\n", b"\r\n"):
            continue  # blank line (e.g. at the end): nothing to read
        where = f"{path}:{first_line + i + 1}"
        try:
            try:
                line = raw.decode("ascii")
            except UnicodeDecodeError as e:
                raise CriteoFormatError(
                    f"{where}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not ASCII"
                ) from None
            y, d, c, padded = parse_line(line, table_sizes, where, labeled)
        except CriteoFormatError as e:
            if not skip_bad_lines:
                raise
            stats.skipped += 1
            stats.first_error = stats.first_error or str(e)
            continue
        stats.padded += int(padded)
        labels[i], dense[i], ids[i], keep[i] = y, d, c, True
    stats.lines += int(keep.sum())
    if keep.all():
        return Arrays(dense, ids, labels)
    return Arrays(dense[keep], ids[keep], labels[keep])


def _rows(a: Arrays, start: int, stop: int) -> Arrays:
    return Arrays(a.dense[start:stop], a.cats[start:stop], a.labels[start:stop])


def skipped_note(stats: ParseStats) -> str:
    if not stats.skipped:
        return ""
    return f" ({stats.skipped} bad lines skipped; first: {stats.first_error})"


def read(
    path: str | os.PathLike[str],
    table_sizes: Sequence[int],
    skip_bad_lines: bool = False,
    stats: ParseStats | None = None,
    labeled: bool = True,
) -> Arrays:
    """Read a whole raw file into arrays (the text itself is never held); ``labeled``:
    :func:`iter_blocks`'."""
    stats = stats if stats is not None else ParseStats()
    blocks = list(iter_blocks(path, table_sizes, skip_bad_lines=skip_bad_lines, stats=stats,
                              labeled=labeled))  # fmt: skip
    if not blocks:
        raise CriteoFormatError(f"{path}: no samples" + skipped_note(stats))
    return Arrays(
        np.concatenate([b.dense for b in blocks]),
        np.concatenate([b.cats for b in blocks]),
        np.concatenate([b.labels for b in blocks]),
    )
