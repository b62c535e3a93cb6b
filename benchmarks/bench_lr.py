"""The learning rates' schedule against constant rates: held-out AUC and logloss over seeds.

    python benchmarks/bench_lr.py [--preset bench] [--batch-size 8192] [--steps 240]
        [--seeds 0,1] [--configs NAME,...] [--data synthetic|FILE] [--json-out PATH]

Each configuration is one `recsz train` run a seed (one process, codec ``none``, plain SGD
on the MLPs and the tables at one rate, as the reference DLRM trains), evaluated on the
held-out set at the end; the table gives each configuration's mean and its runs'. A larger
batch wants a larger rate, which is where a warm-up (the first steps' large gradients at a
fraction of it) and a decay (the last steps' noise) are meant to help.
Prints a table and writes JSON (default benchmarks/results/lr.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

#: name: flags (the rate and the schedule; "{w}" a tenth of the steps, "{s}" / "{d}" the
#: decay's start and steps: the second half)
CONFIGS = {
    "sgd-0.1": "--lr 0.1 --emb-lr 0.1",
    "sgd-1": "--lr 1 --emb-lr 1",
    "sgd-1+warmup": "--lr 1 --emb-lr 1 --lr-warmup-steps {w}",
    "sgd-1+warmup+decay": "--lr 1 --emb-lr 1 --lr-warmup-steps {w} --lr-decay-start {s} "
    "--lr-decay-steps {d}",
    "sgd-3": "--lr 3 --emb-lr 3",
    "sgd-3+warmup": "--lr 3 --emb-lr 3 --lr-warmup-steps {w}",
    "sgd-3+warmup+decay": "--lr 3 --emb-lr 3 --lr-warmup-steps {w} --lr-decay-start {s} "
    "--lr-decay-steps {d}",
    "sgd-0.1+decay": "--lr 0.1 --emb-lr 0.1 --lr-decay-start {s} --lr-decay-steps {d}",
    "sgd-0.3": "--lr 0.3 --emb-lr 0.3",
    "sgd-0.3+decay": "--lr 0.3 --emb-lr 0.3 --lr-decay-start {s} --lr-decay-steps {d}",
    "sgd-10": "--lr 10 --emb-lr 10",
    "sgd-10+warmup": "--lr 10 --emb-lr 10 --lr-warmup-steps {w}",
    "sgd-24": "--lr 24 --emb-lr 24",
    "sgd-24+warmup": "--lr 24 --emb-lr 24 --lr-warmup-steps {w}",
}


def one(a: argparse.Namespace, flags: str, seed: int) -> dict:
    w, half = max(1, a.steps // 10), a.steps // 2
    extra = flags.format(w=w, s=half, d=a.steps - half).split()
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "recsz.train", "--preset", a.preset, "--data", a.data,
                "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seed", str(seed),
                "--emb-optimizer", "sgd", "--dense-optimizer", "sgd", "--synthetic-eval",
                str(a.n_eval), "--log-every", str(a.steps), "--no-progress", "--out", out,
                *extra]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:  # a diverged run stops with its message: a result, not a failure
            return {"auc": float("nan"), "logloss": float("nan"), "diverged": True}
        s = json.loads((Path(out) / "summary.json").read_text())
    return {"auc": s["auc"], "logloss": s["logloss"], "diverged": False,
            "samples_per_s": s["samples_per_s"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    out = ["| configuration | mean AUC | mean logloss | runs (AUC) |", "|---|---|---|---|"]
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        ok = [r for r in mine if not r["diverged"]]
        auc = f"{statistics.mean(r['auc'] for r in ok):.4f}" if ok else "diverged"
        ll = f"{statistics.mean(r['logloss'] for r in ok):.4f}" if ok else "-"
        runs = ", ".join("diverged" if r["diverged"] else f"{r['auc']:.4f}" for r in mine)
        out.append(f"| {name} | {auc} | {ll} | {runs} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--data", default="synthetic")
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--n-eval", type=int, default=200_000)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--configs", default=",".join(list(CONFIGS)[:7]))
    ap.add_argument("--json-out", default=str(HERE / "results" / "lr.json"))
    a = ap.parse_args(argv)
    rows = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for name in a.configs.split(","):
            r = {"config": name, "seed": seed, "preset": a.preset, "batch": a.batch_size,
                 "steps": a.steps, "data": a.data, **one(a, CONFIGS[name], seed)}  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
