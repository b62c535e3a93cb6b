"""Half-precision tables (``--table-dtype``): accuracy, pace and memory against float32.

    python benchmarks/bench_tabledtype.py [--seeds 0,1,2] [--steps 1000] [--quick]
        [--flags '--emb-optimizer sgd --emb-lr 0.01'] [--no-pace] [--variants fp32,bf16,...]
        [--json-out benchmarks/results/tabledtype.json]

Each variant trains the ``tiny`` DLRM in one process (codec ``none``) on (a) the synthetic
generator (``--steps`` of batch 256) and (b) the real 10k Criteo sample (one pass of batch
32), one run a seed, evaluated on the held-out set at the end; and (c) the ``bench`` preset
(Terabyte's dims) for ``--pace-steps`` steps of batch 2048, one seed, for the pace. Variants:
``fp32``; ``fp16`` and ``bf16`` (stochastic rounding, the product); ``fp16-rne`` and
``bf16-rne``: the same tables rounded to nearest, made here by replacing the rounding in
this process (the ablation that says whether the stochastic rounding earns its place).
Every run of an invocation shares the machine's state: compare rows within one. The
table adds each preset's table memory at each dtype (rows x dim x bytes: what a rank
holds of them, all ranks together). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from recsz.model import get_preset, rowopt
from recsz.train import main as train_main

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

SHARED = HERE.parents[1] / "shared" / "data"
VARIANTS = ("fp32", "fp16", "bf16", "fp16-rne", "bf16-rne")


def nearest(x: torch.Tensor, dtype: torch.dtype, salt: torch.Tensor) -> torch.Tensor:
    """The ablation: round to nearest (what a plain cast does)."""
    return x.to(dtype)


def one(variant: str, data: str, seed: int, a: argparse.Namespace) -> dict:
    dtype, _, mode = variant.partition("-")
    if data == "synthetic":
        flags = ["--steps", str(a.steps), "--batch-size", "256", "--synthetic-eval", "20000"]
    elif data == "pace":  # (--quick: the tiny preset, for the tests)
        preset = "tiny" if a.quick else "bench"
        flags = ["--preset", preset, "--steps", str(a.pace_steps), "--synthetic-eval", "2048"]
    else:
        flags = ["--data", data, "--batch-size", "32"]
    stochastic = rowopt.round_stochastic
    if mode == "rne":
        rowopt.round_stochastic = nearest  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as out:
            argv = [*flags, "--table-dtype", dtype, "--seed", str(seed), "--no-progress",
                    "--log-every", "1000000", "--out", out, *a.flags.split()]  # fmt: skip
            assert train_main(argv) == 0
            s = json.loads((Path(out) / "summary.json").read_text())
    finally:
        rowopt.round_stochastic = stochastic  # type: ignore[assignment]
    return {
        "variant": variant,
        "data": "real 10k" if data not in ("synthetic", "pace") else data,
        "seed": seed,
        "auc": s["auc"],
        "logloss": s["logloss"],
        "samples_per_s": s["samples_per_s_steady"],
        "embedding_mb": s["embedding_bytes"] / 1e6,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | synthetic AUC | synthetic logloss | real AUC | real logloss | "
        "bench samples/s | bench tables MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        mine = [r for r in rows if r["variant"] == v]
        if not mine:
            continue

        def mean(data: str, k: str, runs: list[dict] = mine) -> str:
            got = [r[k] for r in runs if r["data"] == data]
            if not got:
                return ""
            spread = f" ({min(got):.4f}-{max(got):.4f})" if len(got) > 1 else ""
            return f"{statistics.mean(got):.4f}{spread}"

        pace = [r for r in mine if r["data"] == "pace"]
        speed = f"{pace[0]['samples_per_s']:,.0f}" if pace else ""
        mb = f"{pace[0]['embedding_mb']:.1f}" if pace else ""
        lines.append(
            f"| {v} | {mean('synthetic', 'auc')} | {mean('synthetic', 'logloss')} | "
            f"{mean('real 10k', 'auc')} | {mean('real 10k', 'logloss')} | {speed} | {mb} |"
        )
    lines += ["", "| preset | tables fp32 GB | fp16 / bf16 GB |", "|---|---|---|"]
    for p in ("kaggle", "terabyte", "dcnv2"):
        m = get_preset(p).model
        gb = sum(m.table_sizes) * m.emb_dim * 4 / 1e9
        lines.append(f"| {p} | {gb:.2f} | {gb / 2:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--pace-steps", type=int, default=60)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="one seed, a few steps (tests)")
    ap.add_argument("--flags", default="", help="more `recsz train` flags for every run")
    ap.add_argument("--no-pace", action="store_true", help="the accuracy runs only")
    ap.add_argument("--json-out", default=str(HERE / "results" / "tabledtype.json"))
    a = ap.parse_args(argv)
    seeds = [0] if a.quick else [int(s) for s in a.seeds.split(",")]
    if a.quick:
        a.steps, a.pace_steps = 8, 4
    real = SHARED / "criteo_kaggle_head10k.tsv"
    data = ["synthetic", *([str(real)] if real.exists() and not a.quick else [])]
    rows = []
    for v in a.variants.split(","):
        for d in data:
            for seed in seeds:
                rows.append(one(v, d, seed, a))
                print(json.dumps(rows[-1]), flush=True)
        if not a.no_pace:
            rows.append(one(v, "pace", 0, a))
            print(json.dumps(rows[-1]), flush=True)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
