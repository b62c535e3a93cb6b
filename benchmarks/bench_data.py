"""Making the batches: how fast the sources feed the trainer, and the trainer with them.

    python benchmarks/bench_data.py [--batches 2048,8192] [--steps 40] [--train-steps 30]
        [--order-rows N] [--parse-copies N] [--worlds 1,2,4,8] [--only PART,...]
        [--json-out PATH]

Every rank reads the global batch each step (the table owners need every sample's ids), so
on a GPU the host's batch making competes with a step of a few milliseconds (an H100 ran
the bench preset's steps of 8192 in 12 ms and waited 35 ms a step for the generator's
batches: results/issue13/session7/run2). Five parts, side by side in one run:

1. **Making alone**: samples/s of ``prefetch`` over ``--steps`` batches (the first left
   out), in the loop (``--prefetch 0``) and by the thread (``--prefetch 2``); sources: the
   built-in generator (bench preset tables) keeping its teacher's values of tables up to
   ``CACHED_ROWS`` rows (``kept``, the default) and hashing every id as before the
   thirty-first session (``hashed``); and, where ``../shared/data`` is here, the real 10k
   sample preprocessed into the same tables (its ~8k training rows over epochs).
2. **A file's training order** (``--data-order``): a preprocessed file of ``--order-rows``
   rows (written from the generator), read in the rows' permutation and in the batches'
   (the file in the page cache: what the order costs beyond the disk); and the same rows
   as TorchRec's preprocessed days (two ``day_N_*.npy`` triples, read where they lie), and
   as MLPerf's materialized multi-hot days made from those (``day_N_sparse_multi_hot.npz``,
   MLPerf's bag sizes: 214 ids a sample, of which the reader reads the 26 first).
3. **Parsing raw lines** (`recsz preprocess`, ``--data FILE``): lines/s of the reader on
   ``--parse-copies`` copies of the real sample, compiled (on one thread, and on the
   threads a reader takes here: ``criteo.parse_threads``), and with every line through
   ``parse_line`` (as the reader was before the thirty-first session); and `recsz
   preprocess` of four such files, one at a time and two at once (``--jobs 2``), with the
   most bytes its output directory held at once over the output's.
4. **A rank's part** (``ranks``): for W in ``--worlds`` ranks of a local batch b each, the
   time the prefetch thread takes to make the whole global batch of W x b (as every rank did
   before the thirty-second session) and to make one rank's part of it (its b samples, and
   its tables' ids of all W x b: the rank of the bench preset's plan with the most tables),
   given as the rank's b samples a second (median of 3 alternating runs); for the generator
   and for the ``--order-rows`` file read in its rows' order.
5. **The trainer**: one process, tiny preset (a step far cheaper than its batch, as a
   GPU's is), the largest batch: samples/s of the whole loop, batch waits included
   (steps x batch / (train_s + data_s)), with each generator.

Prints a table, writes JSON rows ``part, source, batch, way, samples_per_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from recsz.config import parse_train_args
from recsz.data import criteo, preprocessed, synthetic
from recsz.data.prefetch import prefetch
from recsz.data.source import DataSource, Part, SyntheticSource, make_source
from recsz.model import get_preset
from recsz.model.multihot import MLPERF_HOTNESS, mlperf_draws
from recsz.model.sharding import plan_tables
from recsz.train import run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CPU = torch.device("cpu")


WAYS = (("loop", 0), ("thread", 2))
PARTS = ("making", "parse", "order", "ranks", "trainer")


def making(source, name: str, batch: int, steps: int) -> list[dict]:
    rows = []
    for way, depth in WAYS:
        it = prefetch(source.train_batches(range(steps), batch), CPU, depth)
        next(it)
        t = time.perf_counter()
        n = sum(1 for _ in it)
        rate = n * batch / (time.perf_counter() - t)
        rows.append({"part": "making", "source": name, "batch": batch, "way": way,
                     "samples_per_s": rate})  # fmt: skip
        print(f"  {name:18s} batch {batch:5d} {way:7s} {rate:12,.0f} samples/s", flush=True)
    return rows


def synthetic_dir(out: Path, sizes: list[int], rows: int) -> Path:
    """``rows`` of the generator in `recsz preprocess`'s form (as a preprocessed file)."""
    gen, block = SyntheticSource(sizes, 1).gen, 1 << 16
    out.mkdir(parents=True)
    files = [(out / f).open("wb") for f in ("dense.f32", "cats.i32", "labels.f32")]
    for i, start in enumerate(range(0, rows, block)):
        a = gen.block(0, i, min(block, rows - start))
        for f, x, kind in zip(
            files, (a.dense, a.cats, a.labels), ("<f4", "<i4", "<f4"), strict=True
        ):
            f.write(x.astype(kind).tobytes())
    for f in files:
        f.close()
    meta = {"format_version": preprocessed.FORMAT_VERSION, "rows": rows, "table_sizes": sizes}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def npy_days(data: Path, out: Path, days: int = 2) -> Path:
    """The rows of preprocessed ``data`` as TorchRec's Criteo days (``day_N_*.npy``: dense
    float32, ids int64, labels int32 (rows, 1)), ``days`` of them."""
    a = preprocessed.load(data)
    out.mkdir()
    cuts = [len(a) * k // days for k in range(days + 1)]
    for k in range(days):
        lo, hi = cuts[k], cuts[k + 1]
        np.save(out / f"day_{k}_dense.npy", np.asarray(a.dense[lo:hi], dtype=np.float32))
        np.save(out / f"day_{k}_sparse.npy", np.asarray(a.cats[lo:hi], dtype=np.int64))
        np.save(out / f"day_{k}_labels.npy", np.asarray(a.labels[lo:hi], np.int32)[:, None])
    return out


def npz_days(days: Path, sizes: list[int]) -> Path:
    """``days`` (TorchRec's one-hot days) as MLPerf's materializer writes their multi-hot
    form beside them (``day_N_sparse_multi_hot.npz``: each feature's bags, MLPerf's sizes,
    its reference's draws), in a directory of their own with the dense and label files."""
    out = days.parent / "materialized"
    out.mkdir()
    draws = mlperf_draws(sizes, MLPERF_HOTNESS, range(len(sizes)))
    for sparse in sorted(days.glob("day_*_sparse.npy")):
        day = sparse.name[: -len("_sparse.npy")]
        ids = np.load(sparse) % np.asarray(sizes)
        bags = {}
        for j in range(len(sizes)):
            first = ids[:, j : j + 1].astype(np.int32)
            bags[str(j)] = np.c_[first, draws[j][ids[:, j]].numpy()] if j in draws else first
        np.savez(out / f"{day}_sparse_multi_hot.npz", **bags)
        for k in ("dense", "labels"):
            shutil.copy(days / f"{day}_{k}.npy", out / f"{day}_{k}.npy")
    return out


def orders(
    data: Path, sizes: list[int], batch: int, steps: int, kind: str = "recsz preprocess"
) -> list[dict]:
    """A file's training order: the rows' permutation against its batches'."""
    rows = []
    for order in ("rows", "batches"):
        src = make_source(str(data), sizes, 0, order=order)
        t = time.perf_counter()
        src.train_batch(0, batch)  # the epoch's permutation
        first = time.perf_counter() - t
        it = prefetch(src.train_batches(range(1, steps + 1), batch), CPU, 0)
        t = time.perf_counter()
        n = sum(1 for _ in it)
        rate = n * batch / (time.perf_counter() - t)
        drawn = src.n_train if order == "rows" else src.steps_per_epoch(batch)
        perm_mb = 8 * drawn / 2**20  # an epoch's permutation: int64 of rows or of batches
        rows.append({"part": "order", "source": f"{kind}, {src.n_train:,} rows", "batch": batch,
                     "way": order, "samples_per_s": rate, "permutation_MiB": perm_mb,
                     "first_batch_s": first})  # fmt: skip
        print(f"  order {kind} {order:8s} batch {batch:5d} {rate:12,.0f} samples/s, permutation "
              f"{perm_mb:,.1f} MiB, first batch {first:.2f} s", flush=True)  # fmt: skip
    return rows


def parsing(raw: Path, copies: int, tmp: Path, sizes: list[int]) -> list[dict]:
    """Lines a second of the raw reader (`recsz preprocess`, --data FILE): the compiled
    path, and every line through parse_line (the reader before the thirty-first session)."""
    big = tmp / "copies.tsv"
    with big.open("wb") as f:
        for _ in range(copies):
            f.write(raw.read_bytes())
    compiled = criteo.parse_lines

    def none_compiled(buf, table_sizes, labeled=True):  # every line left to parse_line
        labels, dense, ids, ok, starts = compiled(buf, table_sizes, labeled)
        ok[:] = False
        return labels, dense, ids, ok, starts

    rows = []
    criteo.read(raw, sizes)  # the kernels compiled (or loaded from numba's cache)
    many = criteo.parse_threads()
    ways = [("compiled, 1 thread", compiled, 1), (f"compiled, {many} threads", compiled, many),
            ("parse_line", none_compiled, 1)]  # fmt: skip
    for way, fn, threads in [w for k, w in enumerate(ways) if k != 1 or many > 1]:  # 1 core: once
        criteo.parse_lines = fn
        try:
            t = time.perf_counter()
            n = sum(len(b) for b in criteo.iter_blocks(big, sizes, threads=threads))
            rate = n / (time.perf_counter() - t)
        finally:
            criteo.parse_lines = compiled
        mb = big.stat().st_size / 2**20 * rate / n
        rows.append({"part": "parse", "source": f"{n:,} real lines", "batch": 0, "way": way,
                     "samples_per_s": rate, "MiB_per_s": mb})  # fmt: skip
        print(f"  parse {way:20s} {rate:12,.0f} lines/s ({mb:.1f} MiB/s)", flush=True)
    for jobs in (1, 2):  # four such files into one set, one at a time and two at once
        out = tmp / f"jobs{jobs}"
        with peak_bytes(out) as peak:
            t = time.perf_counter()
            preprocessed.preprocess([big] * 4, out, sizes, progress=False, jobs=jobs)
            rate = 4 * n / (time.perf_counter() - t)
        size = sum(f.stat().st_size for f in out.iterdir())
        rows.append({"part": "preprocess", "source": f"4 x {n:,} real lines", "batch": 0,
                     "way": f"jobs {jobs}", "samples_per_s": rate,
                     "peak_over_output": peak[0] / size})  # fmt: skip
        print(f"  preprocess --jobs {jobs} {rate:12,.0f} lines/s, the disk's peak "
              f"{peak[0] / size:.2f}x the output", flush=True)  # fmt: skip
        shutil.rmtree(out)
    return rows


@contextlib.contextmanager
def peak_bytes(d: Path) -> Iterator[list[int]]:
    """The most bytes ``d``'s files held at once while the block ran (polled every 5 ms)."""
    peak, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.wait(0.005):
            with contextlib.suppress(FileNotFoundError):
                peak[0] = max(peak[0], sum(f.stat().st_size for f in d.iterdir()))

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        stop.set()
        t.join()


def rank_parts(
    sources: list[tuple[str, DataSource]], batch: int, worlds: list[int], steps: int
) -> list[dict]:
    """Median of 3 alternating runs of each way, after the teacher's values are kept."""
    rows = []
    for name, source in sources:
        fit = [w for w in worlds if w * batch <= (source.n_train or w * batch)]
        for k in range(4 if fit else 0):  # past the teacher's filling
            source.train_batch(k, max(fit) * batch)
        rows += _rank_parts(name, source, batch, fit, steps)
    return rows


def _rank_parts(
    name: str, source: DataSource, batch: int, worlds: list[int], steps: int
) -> list[dict]:
    rows = []
    model = get_preset("bench").model
    for w in worlds:
        owners = plan_tables(model.table_sizes, model.emb_dim, w)
        rank = max(range(w), key=owners.count)
        part = Part(rank, w, tuple(t for t, r in enumerate(owners) if r == rank))
        ways = {"whole": (None, []), "part": (part, [])}
        for _ in range(3):
            for p, rates in ways.values():
                it = prefetch(source.train_batches(range(steps), w * batch, p), CPU, 2)
                next(it)
                t = time.perf_counter()
                n = sum(1 for _ in it)
                rates.append(n * batch / (time.perf_counter() - t))
        for way, (_, rates) in ways.items():
            rate = sorted(rates)[1]
            rows.append({"part": "ranks", "source": f"{name}, {w} ranks", "batch": batch,
                         "way": way, "samples_per_s": rate,
                         "tables": len(part.tables)})  # fmt: skip
            print(f"  {name} {w} ranks ({len(part.tables):2d} tables) batch {batch:5d} {way:5s} "
                  f"{rate:12,.0f} samples/s", flush=True)  # fmt: skip
    return rows


def trainer(batch: int, steps: int) -> list[dict]:
    rows = []
    for name, cached in (("synthetic, kept", synthetic.CACHED_ROWS), ("synthetic, hashed", 0)):
        argv = ["--preset", "tiny", "--batch-size", str(batch), "--steps", str(steps),
                "--no-progress", "--log-every", "0"]  # fmt: skip
        default, synthetic.CACHED_ROWS = synthetic.CACHED_ROWS, cached
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                s = run(parse_train_args(argv))
        finally:
            synthetic.CACHED_ROWS = default
        rate = steps * batch / (s["train_s"] + s["data_s"])
        rows.append({"part": "trainer", "source": name, "batch": batch, "way": "thread",
                     "samples_per_s": rate, "train_s": s["train_s"], "data_s": s["data_s"],
                     "auc": s["auc"]})  # fmt: skip
        print(f"  trainer {name:18s} batch {batch:5d} {rate:12,.0f} samples/s (waits "
              f"{s['data_s']:.2f} s of {s['train_s'] + s['data_s']:.2f} s, AUC {s['auc']:.4f})",
              flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="2048,8192")
    ap.add_argument("--steps", type=int, default=40, help="batches made per way")
    ap.add_argument("--train-steps", type=int, default=30, help="trainer steps per generator")
    ap.add_argument(
        "--order-rows", type=int, default=8_000_000, help="rows of the file the orders read"
    )
    ap.add_argument("--parse-copies", type=int, default=50, help="copies of the real sample parsed")
    ap.add_argument("--worlds", default="1,2,4,8", help="ranks of the rank-part rows")
    ap.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {PARTS}")
    ap.add_argument("--json-out", default="bench_out/data.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    only = set(args.only.split(","))
    if only - set(PARTS):
        ap.error(f"--only: unknown parts {sorted(only - set(PARTS))}; known: {PARTS}")
    print(f"machine: {os.cpu_count()} cores")
    sizes = get_preset("bench").model.table_sizes
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        sources = [
            ("synthetic, kept", SyntheticSource(sizes, 0)),
            ("synthetic, hashed", SyntheticSource(sizes, 0, cached_rows=0)),
        ]
        real = SHARED / "criteo_kaggle_head10k.tsv"
        if real.exists():
            preprocessed.preprocess(real, Path(tmp) / "real", sizes, progress=False)
            sources.append(("real 10k", make_source(str(Path(tmp) / "real"), sizes, 0)))
        else:
            print(f"({real} not here: the generator only)")
        for name, source in sources if "making" in only else ():
            for b in batches:
                if b <= (source.steps_per_epoch(1) or b):
                    rows += making(source, name, b, args.steps)
        if real.exists() and args.parse_copies and "parse" in only:
            rows += parsing(real, args.parse_copies, Path(tmp), list(sizes))
        big = None
        if args.order_rows and only & {"order", "ranks"}:
            big = synthetic_dir(Path(tmp) / "big", list(sizes), args.order_rows)
        if big and "order" in only:
            rows += orders(big, list(sizes), max(batches), args.steps)
            days = npy_days(big, Path(tmp) / "days")  # the same rows, as TorchRec's days
            rows += orders(days, list(sizes), max(batches), args.steps, "TorchRec .npy days")
            mat = npz_days(days, list(sizes))  # and as MLPerf's materialized multi-hot days
            rows += orders(mat, list(sizes), max(batches), args.steps, "MLPerf .npz days")
        if "ranks" in only:
            worlds = [int(w) for w in args.worlds.split(",")]
            parted: list[tuple[str, DataSource]] = [("synthetic", SyntheticSource(sizes, 0))]
            if big:
                parted.append(("file, rows", make_source(str(big), sizes, 0, order="rows")))
            for b in batches:
                rows += rank_parts(parted, b, worlds, args.steps)
    if "trainer" in only:
        rows += trainer(max(batches), args.train_steps)
    lines = ["| part | source | batch | way | samples/s | vs base |", "|---|---|---|---|---|---|"]
    for r in rows:  # base: the generator hashing every id; for the orders, the rows'
        base = [
            x["samples_per_s"]
            for x in rows
            if (
                (x["part"], x["batch"], x["way"]) == (r["part"], r["batch"], r["way"])
                and x["source"] == "synthetic, hashed"
            )
            or (
                r["part"] == "order" == x["part"]
                and x["way"] == "rows"
                and x["source"].startswith("recsz")
            )
            or (r["part"] == "parse" == x["part"] and x["way"] == "parse_line")
            or (r["part"] == "preprocess" == x["part"] and x["way"] == "jobs 1")
            or (
                r["part"] == "ranks" == x["part"]
                and (x["source"], x["batch"], x["way"]) == (r["source"], r["batch"], "whole")
            )
        ]
        vs = f"{r['samples_per_s'] / base[0]:.2f}x" if base else ""
        lines.append(f"| {r['part']} | {r['source']} | {r['batch']} | {r['way']} | "
                     f"{r['samples_per_s']:,.0f} | {vs} |")  # fmt: skip
    write_results(rows, args.json_out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
