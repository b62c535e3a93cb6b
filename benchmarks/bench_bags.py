"""MLPerf's own bags (``--multi-hot-draws mlperf``) against the hashed ones: what they cost.

    python benchmarks/bench_bags.py [--rows 2000000] [--worlds 1,8,16,64] [--batch 8192]
        [--steps 30] [--repeats 2] [--no-pace] [--quick] [--json-out PATH]

(a) **draws**: ``mlperf_draws`` of one table of ``--rows`` rows and bags of 100 ids
    (MLPerf's feature 20): ids drawn a second, one process. Then the dcnv2 preset's tables
    (MLPerf's rows and bags) on W ranks, by arithmetic on
    that rate: the longest a rank draws before its first step (the draws pass through every
    table before the last it holds) and the most a rank holds (GB of int32 draws), on the
    run's plan (``step.table_owners``: each table charged its draws).
(b) **lookup**: the bench preset's 26 tables (50k rows, dim 64) with MLPerf's bags, one
    process, ``--batch`` samples: the bags' ids alone, and the pooled lookup with its fused
    row-wise Adagrad update (forward + backward), hashed against drawn (median ms of 20).
(c) **pace**: the bench preset with ``--multi-hot mlperf``, 2 gloo ranks of this machine,
    global batch 2048, ``--steps`` steps, hash against mlperf draws in one invocation:
    samples/s (median of ``--repeats``), held-out AUC.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from recsz.config import TrainConfig
from recsz.model import RowOptimizer, SparseArch, get_preset
from recsz.model.multihot import MLPERF_HOTNESS, Bags, draws_nbytes, mlperf_draws
from recsz.step import table_owners
from recsz.train import main as train_main

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402


def draw_rate(rows: int) -> dict:
    t = time.perf_counter()
    (d,) = mlperf_draws([rows], [100], {0}).values()
    s = time.perf_counter() - t
    return {"part": "draw", "rows": rows, "ids": d.numel(), "seconds": s,
            "ids_per_s": d.numel() / s}  # fmt: skip


def plan_rows(rate: float, worlds: list[int]) -> list[dict]:
    """dcnv2's draws on W ranks (table-wise plan), by arithmetic on ``rate``."""
    m = get_preset("dcnv2").model
    extra = [n * (h - 1) for n, h in zip(m.table_sizes, MLPERF_HOTNESS, strict=True)]
    out = []
    for w in worlds:
        cfg = TrainConfig(preset="dcnv2", multi_hot="mlperf", multi_hot_draws="mlperf",
                          batch_size=w)  # fmt: skip
        owners = table_owners(cfg, w)  # the run's plan (its tables charged their draws)
        waits, held = [], []
        for r in range(w):
            mine = [t for t, o in enumerate(owners) if o == r]
            drawn = sum(extra[: max(mine) + 1]) if mine else 0
            waits.append(drawn / rate)
            held.append(draws_nbytes(m.table_sizes, MLPERF_HOTNESS, mine) / 1e9)
        out.append({"part": "plan", "world": w, "max_wait_s": max(waits),
                    "max_held_gb": max(held), "total_gb": 4 * sum(extra) / 1e9})  # fmt: skip
    return out


def lookup_rows(batch: int) -> list[dict]:
    m = get_preset("bench").model
    n = len(m.table_sizes)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, r, (batch,), generator=g) for r in m.table_sizes], 1)
    up = torch.randn(batch, n, m.emb_dim, generator=g)
    out = []
    for draws in ("hash", "mlperf"):
        arch = SparseArch(m, range(n), 0, RowOptimizer("rowwise_adagrad", 0.01),
                          hotness=MLPERF_HOTNESS, bag_draws=draws)  # fmt: skip
        bags = arch.multi_hot
        assert isinstance(bags, Bags)
        times: dict[str, list[float]] = {"ids_ms": [], "step_ms": []}
        for i in range(23):
            t = time.perf_counter()
            bags.ids(ids)
            t1 = time.perf_counter()
            (arch(ids) * up).sum().backward()
            t2 = time.perf_counter()
            if i >= 3:
                times["ids_ms"].append(1e3 * (t1 - t))
                times["step_ms"].append(1e3 * (t2 - t1))
        row = {k: statistics.median(v) for k, v in times.items()}
        out.append({"part": "lookup", "draws": draws, "batch": batch, **row,
                    "draws_mb": bags.drawn.numel() * 4 / 1e6})  # fmt: skip
    return out


def pace_row(draws: str, steps: int, repeats: int, preset: str) -> dict:
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            argv = ["--preset", preset, "--nproc", "2", "--steps", str(steps),
                    "--batch-size", "2048", "--synthetic-eval", "8192", "--no-progress",
                    "--log-every", "1000000", "--multi-hot", "mlperf",
                    "--multi-hot-draws", draws, "--out", out]  # fmt: skip
            assert train_main(argv) == 0
            runs.append(json.loads((Path(out) / "summary.json").read_text()))
    return {"part": "pace", "draws": draws, "preset": preset,
            "samples_per_s": statistics.median(r["samples_per_s_steady"] for r in runs),
            "auc": statistics.median(r["auc"] for r in runs)}  # fmt: skip


def table(rows: list[dict]) -> str:
    out = []
    for r in (r for r in rows if r["part"] == "draw"):
        out += [f"Draws: {r['ids']:,} ids ({r['rows']:,} rows x 99) in {r['seconds']:.2f} s: "
                f"{r['ids_per_s'] / 1e6:.1f}M ids/s.", ""]  # fmt: skip
    plan = [r for r in rows if r["part"] == "plan"]
    if plan:
        out += ["| dcnv2 on W ranks | longest draw before step 0 | most a rank holds | "
                "all ranks' draws |", "|---|---|---|---|"]  # fmt: skip
        out += [f"| {r['world']} | {r['max_wait_s']:.0f} s | {r['max_held_gb']:.1f} GB | "
                f"{r['total_gb']:.1f} GB |" for r in plan]  # fmt: skip
    look = [r for r in rows if r["part"] == "lookup"]
    if look:
        out += ["", "| bags (bench tables, MLPerf's hotness) | batch | ids ms | lookup + "
                "update ms | draws held MB |", "|---|---|---|---|---|"]  # fmt: skip
        out += [f"| {r['draws']} | {r['batch']} | {r['ids_ms']:.2f} | {r['step_ms']:.1f} | "
                f"{r['draws_mb']:.1f} |" for r in look]  # fmt: skip
    pace = [r for r in rows if r["part"] == "pace"]
    if pace:
        out += ["", "| draws | preset | samples/s | AUC |", "|---|---|---|---|"]
        out += [f"| {r['draws']} | {r['preset']} | {r['samples_per_s']:,.0f} | "
                f"{r['auc']:.4f} |" for r in pace]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--worlds", default="1,8,16,64")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-pace", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes, the tiny preset (tests)")
    ap.add_argument("--json-out", default=str(HERE / "results" / "bags.json"))
    a = ap.parse_args(argv)
    rows = [draw_rate(20_000 if a.quick else a.rows)]
    rows += plan_rows(rows[0]["ids_per_s"], [int(w) for w in a.worlds.split(",")])
    rows += lookup_rows(64 if a.quick else a.batch)
    if not a.no_pace:
        preset, steps, repeats = ("tiny", 3, 1) if a.quick else ("bench", a.steps, a.repeats)
        for draws in ("hash", "mlperf"):
            rows.append(pace_row(draws, steps, repeats, preset))
            print(json.dumps(rows[-1]), flush=True)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
