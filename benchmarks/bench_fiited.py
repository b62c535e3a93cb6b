"""FIITED: embedding memory against accuracy, beside two baselines at the same memory.

    python benchmarks/bench_fiited.py [--quick] [--json-out PATH]

One process, each run a fresh model:
- ``dense``: no store (the reference);
- ``fiited``: FIITED's importance (gradient norms, last chunks first), several budgets;
- ``uniform``: the same leading chunks of every row from step 0 (a uniformly smaller
  dimension);
- ``frequency``: whole rows kept by how often they were looked up.
All three run on the same chunk store, so their memory (pool + pointers + scores, the
summary's ``embedding_bytes``) is counted alike. Data: the synthetic generator, 1,000,000
training samples (100,000 with --quick) on the ``tiny`` preset (dim 16, chunks of 8) and
on the ``bench`` preset (dim 64, chunks of 8: finer dimensions per row), and
the real 10k Criteo sample on ``tiny`` (one pass, batch 32, 3 seeds; skipped when
../shared/data is absent). Then 2 ranks with the hybrid codec under dual bounds both
ways: the all-to-all bytes with and without pruning.

Prints a table; writes JSON rows ``data, rule, budget, seed, auc, auc_delta,
embedding_bytes, memory_ratio, samples_per_s, speed_ratio, fwd_bytes, bwd_bytes``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from results_io import write_results

from recsz.train import main as train_main

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REAL = SHARED / "criteo_kaggle_head10k.tsv"


def configs(budgets: list[float], uniform: list[float]) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = [("dense", None)]
    out += [("fiited", b) for b in budgets]
    out += [("uniform", b) for b in uniform]  # whole chunks of every row
    out += [("frequency", b) for b in budgets]
    return out


def train(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        train_main([*flags, "--no-progress", "--out", tmp])
        return json.loads((Path(tmp) / "summary.json").read_text())


def store_flags(rule: str, budget: float | None, interval: int, chunk: int = 8) -> list[str]:
    if budget is None:
        return []
    return ["--fiited-budget", str(budget), "--fiited-chunk", str(chunk),
            "--fiited-interval", str(interval), "--fiited-rule", rule]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out", default="bench_out/fiited.json")
    a = ap.parse_args(argv)
    steps = 100 if a.quick else 1000
    synth = ["--batch-size", "1024", "--steps", str(steps), "--synthetic-eval", "20000"]
    bench = ["--preset", "bench", "--batch-size", "2048", "--steps", str(steps // 2),
             "--synthetic-eval", "20000"]  # fmt: skip
    tiny = ([0.5, 0.25, 0.1], [0.5])  # budgets, uniform budgets (chunks of 8: 2 a row)
    # (name, flags, seeds, pruning interval, chunk, (budgets, uniform budgets))
    datasets = [
        ("synthetic-tiny", synth, [0], 100, 8, tiny),
        ("synthetic-bench", bench, [0], 50, 8, ([0.25, 0.15, 0.125], [0.25, 0.125])),
    ]
    if REAL.exists():
        real = ["--data", str(REAL), "--batch-size", "32"]
        datasets.append(("real10k", real, [0] if a.quick else [0, 1, 2], 25, 8, tiny))
    else:
        print(f"[skip] real data: {REAL} not found", file=sys.stderr)
    rows = []
    for data, dflags, seeds, interval, chunk, (budgets, uniform) in datasets:
        for seed in seeds:
            base: dict = {}
            for rule, budget in configs(budgets, uniform):
                store = store_flags(rule, budget, interval, chunk)
                s = train([*dflags, "--seed", str(seed), *store])
                base = base or s
                rows.append(row(data, rule, budget, seed, s, base))
                print(line(rows[-1]), flush=True)
    # The all-to-all with the hybrid codec: do pruned (zero) chunks cost fewer bytes?
    wire = ["--nproc", "2", "--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--eb-policy",
            "dual", *synth[:2], "--steps", str(steps // 4)]  # fmt: skip
    base = {}
    for rule, budget in [("dense", None), ("fiited", 0.25), ("fiited", 0.1)]:
        s = train([*wire, *store_flags(rule, budget, 50)])
        base = base or s
        rows.append(row("synthetic-tiny-2ranks-hybrid", rule, budget, 0, s, base))
        print(line(rows[-1]), flush=True)
    write_results(rows, a.json_out, table(rows))
    return 0


def row(data: str, rule: str, budget: float | None, seed: int, s: dict, base: dict) -> dict:
    return {
        "data": data,
        "rule": rule,
        "budget": budget,
        "seed": seed,
        "auc": s["auc"],
        "auc_delta": s["auc"] - base["auc"],
        "embedding_bytes": s["embedding_bytes"],
        "memory_ratio": s["embedding_bytes_dense"] / s["embedding_bytes"],
        "samples_per_s": s["samples_per_s"],
        "speed_ratio": s["samples_per_s"] / base["samples_per_s"],
        "fwd_ratio": s["fwd_ratio"],
        "bwd_ratio": s["bwd_ratio"],
        "bytes_sent": s["bytes_sent"],
    }


def line(r: dict) -> str:
    b = "-" if r["budget"] is None else f"{r['budget']:.2f}"
    return (
        f"{r['data']:24s} seed {r['seed']} {r['rule']:9s} budget {b:>4s}  memory "
        f"{r['memory_ratio']:5.2f}x less  AUC {r['auc']:.4f} ({r['auc_delta']:+.4f})  "
        f"{r['speed_ratio']:.2f}x speed  wire {r['bytes_sent'] / 1e6:7.2f} MB"
    )


def table(rows: list[dict]) -> str:
    head = "| data | seed | rule | budget | memory (x less) | AUC | ΔAUC | speed vs dense | "
    out = [head + "fwd ratio | bwd ratio | MB on wire |", "|---" * 11 + "|"]
    for r in rows:
        b = "-" if r["budget"] is None else f"{r['budget']:.2f}"
        out.append(
            f"| {r['data']} | {r['seed']} | {r['rule']} | {b} | {r['memory_ratio']:.2f} | "
            f"{r['auc']:.4f} | {r['auc_delta']:+.4f} | {r['speed_ratio']:.2f}x | "
            f"{r['fwd_ratio']:.1f}x | {r['bwd_ratio']:.1f}x | {r['bytes_sent'] / 1e6:.2f} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
