"""Reader for the Criteo Display Advertising Challenge layout, and its binary form.

One sample per line, tab separated, 40 fields: label (0/1), 13 integer counts I1..I13
(may be empty or negative), 26 categorical features C1..C26 (32-bit hexadecimal hashes,
may be empty). The Terabyte ``day_N`` files share the layout.

Conventions (as in facebookresearch/dlrm and MLPerf):
- a missing count is 0, a negative count is clamped to 0, dense = log(1 + x);
- a categorical hex string is hashed into its table's size; id 0 of every table is
  reserved for "missing", so a present value maps to ``1 + h % (size - 1)``;
- lines whose trailing empty fields were stripped are padded, never rejected;
- anything else that does not parse raises :class:`CriteoFormatError` naming the file,
  the line and the field, unless ``skip_bad_lines`` is set, in which case the line is
  counted and reported.

The binary form written by :func:`preprocess` is three raw little-endian arrays
(``dense.f32`` (N, 13), ``cats.i32`` (N, 26), ``labels.f32`` (N,)) plus ``meta.json``;
:func:`load` memory-maps them, so a 45-million-line file never has to fit in memory.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recsz.data.fastparse import parse_lines

N_DENSE = 13
N_CAT = 26
N_FIELDS = 1 + N_DENSE + N_CAT
FORMAT_VERSION = 1


class CriteoFormatError(ValueError):
    """A line of a Criteo file could not be parsed; the message names file:line:field."""


#: Counts beyond this are not Criteo counts (they would overflow log1p and int64).
_MAX_COUNT = 2**63 - 1


def _show(s: str, limit: int = 40) -> str:
    """A field for an error message: quoted, and cut when long (a 30 MB field must not
    make a 30 MB message)."""
    return repr(s) if len(s) <= limit else f"{s[:limit]!r}... ({len(s)} characters)"


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
    line: str, table_sizes: Sequence[int], where: str = "<input>"
) -> tuple[float, list[float], list[int], bool]:
    """Parse one line into (label, dense[13], ids[26], padded).

    Raises CriteoFormatError naming ``where`` (file:line) and the field at fault.
    """
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) > N_FIELDS:
        raise CriteoFormatError(f"{where}: {len(fields)} fields, expected at most {N_FIELDS}")
    padded = len(fields) < N_FIELDS
    if padded:
        if len(fields) < 1 + N_DENSE and line.strip() == "":
            raise CriteoFormatError(f"{where}: empty line")
        fields = fields + [""] * (N_FIELDS - len(fields))
    lab = fields[0]
    if lab not in ("0", "1"):
        raise CriteoFormatError(f"{where}: field 1 (label): {_show(lab)} is not 0 or 1")
    dense: list[float] = []
    for j in range(N_DENSE):
        s = fields[1 + j]
        if s == "":
            v = 0
        else:
            try:
                v = int(s) if len(s) <= 20 else _MAX_COUNT + 1
            except ValueError:
                raise CriteoFormatError(
                    f"{where}: field {2 + j} (I{j + 1}): {_show(s)} is not an integer"
                ) from None
            if abs(v) > _MAX_COUNT:
                raise CriteoFormatError(
                    f"{where}: field {2 + j} (I{j + 1}): {_show(s)} is too large for a count"
                )
        dense.append(math.log1p(v) if v > 0 else 0.0)
    ids: list[int] = []
    for j in range(N_CAT):
        s = fields[1 + N_DENSE + j]
        if s == "":
            ids.append(0)
            continue
        if len(s) > 8:
            raise CriteoFormatError(
                f"{where}: field {2 + N_DENSE + j} (C{j + 1}): {_show(s)} is longer than 8 hex "
                "digits"
            )
        try:
            raw = int(s, 16)
        except ValueError:
            raise CriteoFormatError(
                f"{where}: field {2 + N_DENSE + j} (C{j + 1}): {_show(s)} is not hexadecimal"
            ) from None
        ids.append(hash_category(raw, table_sizes[j]))
    return float(lab), dense, ids, padded


def iter_blocks(
    path: str | os.PathLike[str],
    table_sizes: Sequence[int],
    block_rows: int = 65536,
    skip_bad_lines: bool = False,
    stats: ParseStats | None = None,
    chunk_bytes: int = 1 << 24,
) -> Iterator[Arrays]:
    """Stream a raw Criteo file as blocks of ``block_rows`` samples (the last: the rest).

    Reads ``chunk_bytes`` at a time, so any file size streams in bounded memory. The
    lines of the usual form are parsed in compiled code (:mod:`recsz.data.fastparse`), the
    others by :func:`parse_line`, which pads them or names what is wrong.
    """
    if len(table_sizes) != N_CAT:
        raise ValueError(f"need {N_CAT} table sizes, got {len(table_sizes)}")
    stats = stats if stats is not None else ParseStats()
    sizes = np.asarray(table_sizes, dtype=np.int64)
    pending: Arrays | None = None  # parsed, not yet yielded
    lineno = 0
    opener = gzip.open if str(path).endswith(".gz") else open  # Terabyte's days: day_N.gz
    with opener(path, "rb") as f:  # bytes: a bad byte is one bad line, not a lost position
        rest = b""
        while True:
            chunk = f.read(chunk_bytes)
            data = rest + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)  # whole lines; at the end all
            data, rest = data[:cut], data[cut:]
            if not data:
                if chunk:
                    continue  # a line longer than a chunk: read on
                break
            stats.bytes += len(data)
            blk, lines = _parse_chunk(data, path, lineno, sizes, table_sizes, skip_bad_lines, stats)
            lineno += lines
            if pending is not None:
                blk = Arrays(
                    *(np.concatenate([getattr(pending, f), getattr(blk, f)]) for f in _FILES)
                )
            start = 0
            while len(blk) - start >= block_rows:
                yield _rows(blk, start, start + block_rows)
                start += block_rows
            pending = _rows(blk, start, len(blk)) if start < len(blk) else None
    if pending is not None:
        yield pending


def _parse_chunk(
    data: bytes,
    path: str | os.PathLike[str],
    first_line: int,
    sizes: np.ndarray,
    table_sizes: Sequence[int],
    skip_bad_lines: bool,
    stats: ParseStats,
) -> tuple[Arrays, int]:
    """The samples of the whole lines ``data`` (line ``first_line + 1`` first), and its
    lines' count."""
    labels, dense, ids, ok, starts = parse_lines(np.frombuffer(data, np.uint8), sizes)
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
            y, d, c, padded = parse_line(line, table_sizes, where)
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
        return Arrays(dense, ids, labels), len(ok)
    return Arrays(dense[keep], ids[keep], labels[keep]), len(ok)


def _rows(a: Arrays, start: int, stop: int) -> Arrays:
    return Arrays(a.dense[start:stop], a.cats[start:stop], a.labels[start:stop])


def _skipped_note(stats: ParseStats) -> str:
    if not stats.skipped:
        return ""
    return f" ({stats.skipped} bad lines skipped; first: {stats.first_error})"


def read(
    path: str | os.PathLike[str],
    table_sizes: Sequence[int],
    skip_bad_lines: bool = False,
    stats: ParseStats | None = None,
) -> Arrays:
    """Read a whole raw file into arrays (the text itself is never held)."""
    stats = stats if stats is not None else ParseStats()
    blocks = list(iter_blocks(path, table_sizes, skip_bad_lines=skip_bad_lines, stats=stats))
    if not blocks:
        raise CriteoFormatError(f"{path}: no samples" + _skipped_note(stats))
    return Arrays(
        np.concatenate([b.dense for b in blocks]),
        np.concatenate([b.cats for b in blocks]),
        np.concatenate([b.labels for b in blocks]),
    )


def preprocess(
    raw: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    table_sizes: Sequence[int],
    skip_bad_lines: bool = False,
    progress: bool = True,
    jobs: int = 1,
) -> ParseStats:
    """Convert a raw file, or several in order (Terabyte's ``day_0`` .. ``day_22``, plain or
    gzipped), to one memory-mappable binary form, streaming block by block; ``jobs`` > 1
    parses up to that many files at once (processes), their rows joined in order as they
    come (:func:`_write_parallel`)."""

    raws = [raw] if isinstance(raw, (str, os.PathLike)) else list(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = {k: out / f"{k}.tmp" for k in _FILES}
    parts = [{k: out / f"{k}.part{i}" for k in _FILES} for i in range(len(raws))]
    try:
        if jobs > 1 and len(raws) > 1:
            done = _write_parallel(raws, parts, tmp, table_sizes, skip_bad_lines, jobs, progress)
            stats = ParseStats(**{f: sum(getattr(st, f) for st, _ in done) for f in _COUNTS})
            stats.first_error = next((st.first_error for st, _ in done if st.first_error), "")
            rows_each = [rows for _, (rows,) in done]
        else:
            stats, rows_each = _write(raws, tmp, table_sizes, skip_bad_lines, progress)
        if stats.lines == 0:
            named = ", ".join(str(r) for r in raws)
            raise CriteoFormatError(f"{named}: no samples" + _skipped_note(stats))
    except BaseException:
        for t in [*tmp.values(), *(p for part in parts for p in part.values())]:
            t.unlink(missing_ok=True)  # no partial output survives a failure
        raise
    for k, name in _FILES.items():
        os.replace(tmp[k], out / name)
    meta = {
        "format_version": FORMAT_VERSION,
        "rows": stats.lines,
        "table_sizes": list(table_sizes),
        "skipped_lines": stats.skipped,
        "padded_lines": stats.padded,
        "source": str(raws[0]) if len(raws) == 1 else [str(r) for r in raws],
        "rows_per_source": rows_each,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return stats


#: The fields of :class:`Arrays` and the files that hold them.
_FILES = {"dense": "dense.f32", "cats": "cats.i32", "labels": "labels.f32"}
_COUNTS = ("lines", "padded", "skipped", "bytes")


def _write_parallel(
    raws: Sequence[str | os.PathLike[str]],
    parts: list[dict[str, Path]],
    files: dict[str, Path],
    table_sizes: Sequence[int],
    skip_bad_lines: bool,
    jobs: int,
    progress: bool,
) -> list[tuple[ParseStats, list[int]]]:
    """Each of ``raws`` parsed by a process into its ``parts``, at most ``jobs`` at once;
    each part, once it and those before it are done, appended to ``files`` (the first one
    renamed) and deleted while the next files are parsed, so no serial pass over the whole
    output follows the last file (Terabyte: ~700 GB), and at most ``jobs`` parts wait."""
    from collections import deque
    from concurrent.futures import Future, ProcessPoolExecutor

    from tqdm import tqdm

    done: list[tuple[ParseStats, list[int]]] = []
    with (
        ProcessPoolExecutor(min(jobs, len(raws))) as pool,
        tqdm(total=len(raws), unit="file", disable=not progress) as bar,
    ):
        ahead: deque[Future] = deque()
        waiting = iter(range(len(raws)))

        def submit() -> None:
            i = next(waiting, None)
            if i is not None:
                ahead.append(pool.submit(_write, [raws[i]], parts[i], table_sizes, skip_bad_lines))

        for _ in range(jobs):
            submit()
        while ahead:
            done.append(ahead.popleft().result())
            part = parts[len(done) - 1]
            for k, path in files.items():
                if len(done) == 1:
                    os.replace(part[k], path)
                    continue
                with open(path, "ab") as f, open(part[k], "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 24)
                part[k].unlink()
            submit()  # after the part is gone: never more than ``jobs`` on the disk
            bar.update(1)
    return done


def _write(
    raws: Sequence[str | os.PathLike[str]],
    files: dict[str, Path],
    table_sizes: Sequence[int],
    skip_bad_lines: bool,
    progress: bool = False,
) -> tuple[ParseStats, list[int]]:
    """The rows of ``raws``, in order, written to ``files``; the counts, the rows of each."""
    from tqdm import tqdm

    gzipped = any(str(r).endswith(".gz") for r in raws)  # its bytes read are not its size
    total = None if gzipped else sum(os.path.getsize(r) for r in raws)
    stats, rows_each = ParseStats(), []
    with (
        open(files["dense"], "wb") as fd,
        open(files["cats"], "wb") as fc,
        open(files["labels"], "wb") as fl,
        tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
             desc="preprocess") as bar,
    ):  # fmt: skip
        for one in raws:
            before = stats.lines
            for blk in iter_blocks(one, table_sizes, skip_bad_lines=skip_bad_lines, stats=stats):
                fd.write(blk.dense.astype("<f4").tobytes())
                fc.write(blk.cats.astype("<i4").tobytes())
                fl.write(blk.labels.astype("<f4").tobytes())
                bar.update(stats.bytes - bar.n)
            rows_each.append(stats.lines - before)
    return stats, rows_each


def load(out_dir: str | os.PathLike[str], table_sizes: Sequence[int] | None = None) -> Arrays:
    """Memory-map a preprocessed directory; refuse one hashed into other table sizes."""
    d = Path(out_dir)
    meta_path = d / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{d}: no meta.json; run `recsz preprocess RAW.tsv {d}` first")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')} unsupported")
    if table_sizes is not None and list(table_sizes) != list(meta["table_sizes"]):
        raise ValueError(
            f"{d} was hashed into table sizes {meta['table_sizes']}, the model has "
            f"{list(table_sizes)}; preprocess again with this preset"
        )
    n = int(meta["rows"])
    for name, row_bytes in (("dense.f32", 4 * N_DENSE), ("cats.i32", 4 * N_CAT), ("labels.f32", 4)):
        size = (d / name).stat().st_size if (d / name).exists() else -1
        if size != n * row_bytes:
            raise ValueError(
                f"{d / name}: {size} bytes, expected {n * row_bytes} for the {n} rows of "
                f"{meta_path} (truncated or from another run?)"
            )
    dense = np.memmap(d / "dense.f32", dtype="<f4", mode="r", shape=(n, N_DENSE))
    cats = np.memmap(d / "cats.i32", dtype="<i4", mode="r", shape=(n, N_CAT))
    labels = np.memmap(d / "labels.f32", dtype="<f4", mode="r", shape=(n,))
    return Arrays(dense, cats, labels)
