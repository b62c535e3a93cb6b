"""The binary form of Criteo files: what `recsz preprocess` writes and training memory-maps.

Three raw little-endian arrays (``dense.f32`` (N, 13), ``cats.i32`` (N, 26), ``labels.f32``
(N,)) plus ``meta.json``; :func:`load` memory-maps them, so a 45-million-line file (or
Terabyte's 4 billion) never has to fit in memory. :func:`preprocess` streams raw files
(:mod:`recsz.data.criteo`) into it, several at once in processes.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recsz import diskroom
from recsz.data.criteo import (
    N_CAT,
    N_DENSE,
    Arrays,
    CriteoFormatError,
    ParseStats,
    in_order,
    iter_blocks,
    parse_threads,
    skipped_note,
)

FORMAT_VERSION = 1


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
            raise CriteoFormatError(f"{named}: no samples" + skipped_note(stats))
    except BaseException as e:
        for t in [*tmp.values(), *(p for part in parts for p in part.values())]:
            t.unlink(missing_ok=True)  # no partial output survives a failure
        if isinstance(e, OSError) and (no_room := diskroom.full(out, e)):
            raise no_room from e
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
    from concurrent.futures import ProcessPoolExecutor

    from recsz.console import bar as progress_bar

    done: list[tuple[ParseStats, list[int]]] = []
    threads = max(1, parse_threads() // min(jobs, len(raws)))  # the cores, not each's
    work = functools.partial(_write_one, table_sizes, skip_bad_lines, threads)
    with (
        ProcessPoolExecutor(min(jobs, len(raws))) as pool,
        progress_bar(progress, total=len(raws), unit="file", desc="preprocess") as bar,
    ):
        # the next file taken once a part is gone: never more than ``jobs`` on the disk
        for (_, part), got in in_order(work, zip(raws, parts, strict=True), pool, jobs):
            done.append(got)
            for k, path in files.items():
                if len(done) == 1:
                    os.replace(part[k], path)
                    continue
                with open(path, "ab") as f, open(part[k], "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 24)
                part[k].unlink()
            bar.update(1)
    return done


def _write_one(
    table_sizes: Sequence[int], skip_bad_lines: bool, threads: int,
    raw_part: tuple[str | os.PathLike[str], dict[str, Path]],
) -> tuple[ParseStats, list[int]]:  # fmt: skip
    """One raw file into its part (a process of :func:`_write_parallel`)."""
    return _write([raw_part[0]], raw_part[1], table_sizes, skip_bad_lines, False, threads)


def _write(
    raws: Sequence[str | os.PathLike[str]],
    files: dict[str, Path],
    table_sizes: Sequence[int],
    skip_bad_lines: bool,
    progress: bool = False,
    threads: int | None = None,
) -> tuple[ParseStats, list[int]]:
    """The rows of ``raws``, in order, written to ``files`` (each parsed on ``threads``:
    :func:`recsz.data.criteo.iter_blocks`'); the counts, the rows of each."""
    from recsz.console import bar as progress_bar

    gzipped = any(str(r).endswith(".gz") for r in raws)  # its bytes read are not its size
    total = None if gzipped else sum(os.path.getsize(r) for r in raws)
    stats, rows_each = ParseStats(), []
    with (
        open(files["dense"], "wb") as fd,
        open(files["cats"], "wb") as fc,
        open(files["labels"], "wb") as fl,
        progress_bar(progress, total=total, unit="B", unit_scale=True, desc="preprocess") as bar,
    ):  # fmt: skip
        for one in raws:
            before = stats.lines
            blocks = iter_blocks(
                one, table_sizes, skip_bad_lines=skip_bad_lines, stats=stats, threads=threads
            )
            for blk in blocks:
                fd.write(blk.dense.astype("<f4").tobytes())
                fc.write(blk.cats.astype("<i4").tobytes())
                fl.write(blk.labels.astype("<f4").tobytes())
                bar.update(stats.bytes - bar.n)
            rows_each.append(stats.lines - before)
    return stats, rows_each


def _meta(path: Path) -> dict[str, Any]:
    """``meta.json``'s fields, or a ValueError naming the file (and line) where they are not
    those `recsz preprocess` writes."""
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {e.lineno}: not JSON ({e.msg})") from None
    try:
        rows, sizes = int(meta["rows"]), [int(t) for t in meta["table_sizes"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: no rows and table_sizes as `recsz preprocess` writes them "
                         f"({type(e).__name__}: {e})") from None  # fmt: skip
    if rows < 0 or any(t < 1 for t in sizes):
        raise ValueError(f"{path}: rows {rows}, table_sizes {sizes}: out of range")
    return meta | {"rows": rows, "table_sizes": sizes}


def load(out_dir: str | os.PathLike[str], table_sizes: Sequence[int] | None = None) -> Arrays:
    """Memory-map a preprocessed directory; refuse one hashed into other table sizes."""
    d = Path(out_dir)
    meta_path = d / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(
            f"{d}: no meta.json (a `recsz preprocess` directory) and no day_N_dense.npy "
            f"(TorchRec's preprocessed days); run `recsz preprocess RAW.tsv {d}` first"
        )
    meta = _meta(meta_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')} unsupported")
    if table_sizes is not None and list(table_sizes) != list(meta["table_sizes"]):
        raise ValueError(
            f"{d} was hashed into table sizes {meta['table_sizes']}, the model has "
            f"{list(table_sizes)}; preprocess again with this preset (and --max-rows)"
        )
    n = int(meta["rows"])
    for name, row_bytes in (("dense.f32", 4 * N_DENSE), ("cats.i32", 4 * N_CAT), ("labels.f32", 4)):
        if not (d / name).exists():
            raise FileNotFoundError(f"{d / name}: missing, named by {meta_path} (a `recsz "
                                    "preprocess` directory holds dense.f32, cats.i32 and "
                                    "labels.f32 beside it)")  # fmt: skip
        size = (d / name).stat().st_size
        if size != n * row_bytes:
            raise ValueError(
                f"{d / name}: {size} bytes, expected {n * row_bytes} for the {n} rows of "
                f"{meta_path} (truncated or from another run?)"
            )
    dense = np.memmap(d / "dense.f32", dtype="<f4", mode="r", shape=(n, N_DENSE))
    cats = np.memmap(d / "cats.i32", dtype="<i4", mode="r", shape=(n, N_CAT))
    labels = np.memmap(d / "labels.f32", dtype="<f4", mode="r", shape=(n,))
    return Arrays(dense, cats, labels)
