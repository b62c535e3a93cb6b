"""Column shards (``--column-shards K``): what the plan spreads, and what the shards cost.

    python benchmarks/bench_columns.py [--presets terabyte,dcnv2] [--worlds 8,16,32,64,128]
        [--shards 1,2,4,8] [--pace-shards 1,2,4] [--configs none,hybrid] [--steps 30]
        [--repeats 3] [--no-pace] [--quick] [--json-out benchmarks/results/columns.json]

(a) **plan**: the planner's table-wise plan (``model/sharding.plan_tables``) of each
    preset's tables on W ranks, whole (K = 1) or each table in K column shards: the most
    table memory a rank holds (GB, float32) against the mean, the ranks that hold none,
    and the largest share of the forward all-to-all's bytes one rank sends (each rank
    sends B x its tables' widths: the ideal is 1/W). Arithmetic on the plan, no training:
    what a cluster of W GPUs would hold.
(b) **pace**: the bench preset (Terabyte's dims) on 2 gloo ranks of this machine, global
    batch 2048, ``--steps`` steps, each configuration with K = 1, 2, 4 in one invocation
    (median samples/s after the first steps of ``--repeats`` runs): on 2 ranks the tables
    are balanced whole, so this is what the shards cost (K x the tables in the exchange and
    the codec), not what they win. Codecs: ``none`` (the id-aware default) and ``hybrid``
    (dual-level bounds both ways).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from recsz.model import get_preset
from recsz.model.sharding import column_shards, plan_tables, rank_loads
from recsz.train import main as train_main

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

CONFIGS = {
    "none": [],
    "hybrid": ["--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--eb-policy", "dual"],
}


def plan_row(preset: str, world: int, k: int) -> dict:
    m = get_preset(preset).model
    sizes, width = column_shards(m.table_sizes, m.emb_dim, k)
    loads = rank_loads(sizes, width, plan_tables(sizes, width, world), world)
    mem = [x["table_bytes"] / 1e9 for x in loads]
    mean = sum(mem) / world
    return {"part": "plan", "preset": preset, "world": world, "shards": k,
            "max_gb": max(mem), "mean_gb": mean, "max_over_mean": max(mem) / mean,
            "idle_ranks": sum(1 for x in loads if not x["tables"]),
            "max_send_share": max(x["send_share"] for x in loads)}  # fmt: skip


def pace_row(config: str, k: int, steps: int, repeats: int, preset: str) -> dict:
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            argv = ["--preset", preset, "--nproc", "2", "--steps", str(steps),
                    "--batch-size", "2048", "--synthetic-eval", "8192", "--no-progress",
                    "--log-every", "1000000", "--column-shards", str(k), "--out", out,
                    *CONFIGS[config]]  # fmt: skip
            assert train_main(argv) == 0
            runs.append(json.loads((Path(out) / "summary.json").read_text()))
    s = runs[0]
    return {"part": "pace", "config": config, "shards": k, "preset": preset,
            "samples_per_s": statistics.median(r["samples_per_s_steady"] for r in runs),
            "bytes_sent_mb": s["bytes_sent"] / 1e6, "fwd_ratio": s["fwd_ratio"],
            "bwd_ratio": s["bwd_ratio"], "auc": s["auc"], "codec_s": s["codec_s"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    out = ["| preset | ranks | shards K | max GB a rank | mean GB | max / mean | ranks idle | "
           "largest share of the forward bytes (ideal 1/W) |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in (r for r in rows if r["part"] == "plan"):
        out.append(f"| {r['preset']} | {r['world']} | {r['shards']} | {r['max_gb']:.2f} | "
                   f"{r['mean_gb']:.2f} | {r['max_over_mean']:.2f} | {r['idle_ranks']} | "
                   f"{r['max_send_share']:.3f} ({1 / r['world']:.3f}) |")  # fmt: skip
    pace = [r for r in rows if r["part"] == "pace"]
    if pace:
        out += ["", "| config | shards K | samples/s | vs K = 1 | bytes sent MB | fwd / bwd "
                "ratio | codec s | AUC |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in pace:
            base = next(p for p in pace if p["config"] == r["config"] and p["shards"] == 1)
            out.append(f"| {r['config']} | {r['shards']} | {r['samples_per_s']:,.0f} | "
                       f"{r['samples_per_s'] / base['samples_per_s']:.2f}x | "
                       f"{r['bytes_sent_mb']:.1f} | {r['fwd_ratio']:.1f}x / {r['bwd_ratio']:.1f}x"
                       f" | {r['codec_s']:.2f} | {r['auc']:.4f} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="terabyte,dcnv2")
    ap.add_argument("--worlds", default="8,16,32,64,128")
    ap.add_argument("--shards", default="1,2,4,8")
    ap.add_argument("--pace-shards", default="1,2,4")
    ap.add_argument("--configs", default="none,hybrid")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-pace", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, a few steps (tests)")
    ap.add_argument("--json-out", default=str(HERE / "results" / "columns.json"))
    a = ap.parse_args(argv)
    rows = [plan_row(p, int(w), int(k)) for p in a.presets.split(",")
            for w in a.worlds.split(",") for k in a.shards.split(",")]  # fmt: skip
    if not a.no_pace:
        preset, steps, repeats = ("tiny", 4, 1) if a.quick else ("bench", a.steps, a.repeats)
        for config in a.configs.split(","):
            for k in a.pace_shards.split(","):
                rows.append(pace_row(config, int(k), steps, repeats, preset))
                print(json.dumps(rows[-1]), flush=True)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
