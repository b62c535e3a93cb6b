"""TT-Rec tables: memory against accuracy, lookup speed, and the all-to-all of each placement.

    python benchmarks/bench_tt.py [--quick] [--seeds 0,1,2] [--json-out PATH]

1. ``accuracy``: one process, the ``kaggle`` preset's table sizes (the 7 largest tables as
   tensor trains unless stated), synthetic data, 1,000,000 training samples (batch 1024;
   100 steps with --quick): dense tables against TT tables of rank 8/16/32/64, 3/5/7 TT
   tables, with and without a cache of 10,000 hot rows per TT table. Embedding bytes
   (``embedding_bytes``: what the tables hold) and the whole model's (+ MLPs).
2. ``real``: the real 10k Criteo sample (one pass, batch 32, ``tiny`` preset, its 7 largest
   tables as TT of rank 8 with 1,000 cached rows), every seed; skipped without ../shared.
2b. ``bags``: as ``accuracy`` (1,000,000 samples; 100 steps with --quick) with MLPerf's
   multi-hot bags (``--multi-hot mlperf``): dense against tt7-r8+cache, every seed.
3. ``lookup``: lookup + update rows/s of one table of the kaggle preset's largest size
   (batches of 1024 of its ids from the synthetic generator, Adagrad): dense rows (the
   trainer's fused lookup) against a TT table, with and without its cache.
4. ``placement``: 2 ranks, ``bench`` preset, hybrid with dual bounds both ways: the
   all-to-all and all-reduce bytes with the TT tables sharded (in the all-to-all) or
   replicated (cores averaged with the MLPs).

Prints a table per part; writes JSON rows (``part``, ``config``, ``seed`` and the numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_io import write_results

from recsz.data.synthetic import SyntheticCriteo
from recsz.model import DenseArch, RowOptimizer, SparseArch, TTSpec, get_preset
from recsz.train import main as train_main

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REAL = SHARED / "criteo_kaggle_head10k.tsv"
CACHE = ["--tt-cache-rows", "10000"]


def train(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        train_main([*flags, "--no-progress", "--out", tmp])
        return json.loads((Path(tmp) / "summary.json").read_text())


def mlp_bytes(preset: str) -> int:
    m = DenseArch(get_preset(preset).model, 0)
    return 4 * sum(p.numel() for p in m.parameters())


def accuracy(quick: bool, seeds: list[int]) -> list[dict]:
    base = ["--preset", "kaggle", "--batch-size", "1024", "--steps", "100" if quick else "1000"]
    grid: list[tuple[str, list[str]]] = [("dense", [])]
    grid += [(f"tt7-r{r}+cache", ["--tt-tables", "7", "--tt-rank", str(r), *CACHE])
             for r in ([8] if quick else [8, 16, 32, 64])]  # fmt: skip
    grid += [("tt7-r8", ["--tt-tables", "7"])]
    grid += [
        (f"tt{k}-r8+cache", ["--tt-tables", str(k), *CACHE]) for k in ([] if quick else [3, 5])
    ]
    rows, mlp = [], mlp_bytes("kaggle")
    for seed in seeds:
        ref: dict = {}
        for name, flags in grid if seed == seeds[0] else grid[:2]:
            s = train([*base, "--seed", str(seed), *flags])
            ref = ref or s
            rows.append(result("accuracy", name, seed, s, ref, mlp))
            print(line(rows[-1]), flush=True)
    return rows


def bags(quick: bool, seeds: list[int]) -> list[dict]:
    """The accuracy part's model and data with MLPerf's multi-hot bags (214 ids a sample):
    dense tables against the 7 largest as TT tables of rank 8 with their caches, every
    seed."""
    base = ["--preset", "kaggle", "--batch-size", "1024", "--steps", "100" if quick else "1000",
            "--multi-hot", "mlperf"]  # fmt: skip
    rows, mlp = [], mlp_bytes("kaggle")
    for seed in seeds:
        ref = train([*base, "--seed", str(seed)])
        rows.append(result("bags", "dense", seed, ref, ref, mlp))
        tt = train([*base, "--seed", str(seed), "--tt-tables", "7", *CACHE])
        rows.append(result("bags", "tt7-r8+cache", seed, tt, ref, mlp))
        print(line(rows[-2]), line(rows[-1]), sep="\n", flush=True)
    return rows


def real(seeds: list[int]) -> list[dict]:
    if not REAL.exists():
        print(f"[skip] real data: {REAL} not found", file=sys.stderr)
        return []
    base = ["--data", str(REAL), "--batch-size", "32"]
    tt = ["--tt-tables", "7", "--tt-cache-rows", "1000"]
    rows, mlp = [], mlp_bytes("tiny")
    for seed in seeds:
        ref = train([*base, "--seed", str(seed)])
        rows.append(result("real", "dense", seed, ref, ref, mlp))
        rows.append(result("real", "tt7-r8+cache", seed, train([*base, "--seed", str(seed), *tt]),
                           ref, mlp))  # fmt: skip
        print(line(rows[-2]), line(rows[-1]), sep="\n", flush=True)
    return rows


def result(part: str, config: str, seed: int, s: dict, ref: dict, mlp: int) -> dict:
    return {
        "part": part,
        "config": config,
        "seed": seed,
        "auc": s["auc"],
        "auc_delta": s["auc"] - ref["auc"],
        "logloss": s["logloss"],
        "logloss_delta": s["logloss"] - ref["logloss"],
        "embedding_bytes": s["embedding_bytes"],
        "memory_ratio": s["embedding_bytes_dense"] / s["embedding_bytes"],
        "model_bytes": s["embedding_bytes"] + mlp,
        "samples_per_s": s["samples_per_s"],
        "step_ratio": ref["samples_per_s"] / s["samples_per_s"],
        "cache_hit_rate": s.get("tt_cache_hit_rate"),
    }


def line(r: dict) -> str:
    hit = r["cache_hit_rate"]
    return (
        f"{r['part']:9s} {r['config']:14s} seed {r['seed']}  memory {r['memory_ratio']:7.1f}x "
        f"less ({r['embedding_bytes'] / 1e6:8.2f} MB)  AUC {r['auc']:.4f} "
        f"({r['auc_delta']:+.4f})  step {r['step_ratio']:.2f}x dense"
        + (f"  cache hits {hit:.1%}" if hit is not None else "")
    )


def lookup(quick: bool) -> list[dict]:
    m = get_preset("kaggle").model
    big = max(range(m.n_tables), key=lambda t: m.table_sizes[t])
    n, steps = m.table_sizes[big], 100  # the cache fills every 100 (the trainer's default)
    gen = SyntheticCriteo(m.table_sizes, seed=0)  # the training data's skew
    batches = [torch.from_numpy(gen.block(0, i, 1024).cats[:, big]).long() for i in range(steps)]
    opt = RowOptimizer("adagrad", 0.05)
    rows = []
    for name, spec in [
        ("dense", None),
        ("tt-r8", TTSpec(frozenset({big}))),
        ("tt-r8+cache", TTSpec(frozenset({big}), cache_rows=10000)),
    ]:
        arch = SparseArch(m, [big], 0, opt, spec)
        ids = torch.zeros(1024, m.n_tables, dtype=torch.int64)
        for _ in range(2 if quick else 3):  # warm-up passes (the cache fills at each start)
            t0 = time.perf_counter()
            for b in batches:
                ids[:, big] = b
                arch(ids).sum().backward()
            dt = time.perf_counter() - t0
        rows.append({"part": "lookup", "config": name, "rows": n,
                     "rows_per_s": steps * 1024 / dt})  # fmt: skip
        print(f"lookup    {name:14s} {n} rows: {rows[-1]['rows_per_s'] / 1e6:.2f} M ids/s",
              flush=True)  # fmt: skip
    return rows


def placement(quick: bool) -> list[dict]:
    base = ["--preset", "bench", "--batch-size", "2048", "--steps", "10" if quick else "30",
            "--nproc", "2", "--fwd-codec", "hybrid", "--bwd-codec", "hybrid",
            "--eb-policy", "dual", "--tt-tables", "7"]  # fmt: skip
    rows = []
    for where in ("sharded", "replicated"):
        s = train([*base, "--tt-placement", where])
        rows.append({"part": "placement", "config": where, "bytes_raw": s["bytes_raw"],
                     "bytes_sent": s["bytes_sent"], "allreduce_bytes": s["allreduce_bytes"],
                     "samples_per_s": s["samples_per_s"], "auc": s["auc"]})  # fmt: skip
        r = rows[-1]
        print(f"placement {where:10s} all-to-all {r['bytes_sent'] / 1e6:7.2f} MB (raw "
              f"{r['bytes_raw'] / 1e6:.1f})  all-reduce {r['allreduce_bytes'] / 1e6:7.2f} MB  "
              f"{r['samples_per_s']:.0f} samples/s  AUC {r['auc']:.4f}", flush=True)  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    out = ["| part | config | seed | TT memory (x less) | embedding MB | model MB | AUC | ΔAUC | "
           "Δlogloss | step vs dense | cache hits |", "|---" * 11 + "|"]  # fmt: skip
    for r in rows:
        if r["part"] in ("accuracy", "bags", "real"):
            hit = "" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.1%}"
            out.append(
                f"| {r['part']} | {r['config']} | {r['seed']} | {r['memory_ratio']:.1f} | "
                f"{r['embedding_bytes'] / 1e6:.2f} | {r['model_bytes'] / 1e6:.2f} | "
                f"{r['auc']:.4f} | {r['auc_delta']:+.4f} | {r['logloss_delta']:+.4f} | "
                f"{r['step_ratio']:.2f}x | {hit} |"
            )
    out += ["", "| part | config | numbers |", "|---|---|---|"]
    for r in rows:
        if r["part"] == "lookup":
            out.append(f"| lookup | {r['config']} | {r['rows_per_s'] / 1e6:.2f} M ids/s |")
        elif r["part"] == "placement":
            out.append(
                f"| placement | {r['config']} | all-to-all {r['bytes_sent'] / 1e6:.2f} MB, "
                f"all-reduce {r['allreduce_bytes'] / 1e6:.2f} MB, "
                f"{r['samples_per_s']:.0f} samples/s, AUC {r['auc']:.4f} |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", default="0", help="comma list (accuracy: dense and the first "
                    "TT configuration for every seed, the rest for the first)")  # fmt: skip
    ap.add_argument("--parts", default="accuracy,bags,real,lookup,placement")
    ap.add_argument("--json-out", default="bench_out/tt.json")
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows: list[dict] = []
    parts = a.parts.split(",")
    if "accuracy" in parts:
        rows += accuracy(a.quick, seeds)
    if "bags" in parts:
        rows += bags(a.quick, seeds)
    if "real" in parts:
        rows += real(seeds)
    if "lookup" in parts:
        rows += lookup(a.quick)
    if "placement" in parts:
        rows += placement(a.quick)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
