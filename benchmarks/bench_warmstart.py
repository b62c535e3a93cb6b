"""A warm start (``--init-from``) against a cold one, as a daily model is retrained.

    python benchmarks/bench_warmstart.py [--data ../shared/data/criteo_kaggle_head10k.tsv]
        [--seeds 0,1,2] [--batch-size 128] [--preset tiny] [--json-out PATH]

The real sample's rows in order are cut into "yesterday" (the first 60%), "today" (the
next 30%) and a held-out tail (the last 10%). Per seed, one process, one pass each:
``yesterday`` trains on yesterday's rows and is exported (``recsz export``); ``cold``
trains on today's rows from a fresh start; ``warm`` on today's rows from yesterday's
model (``--init-from``, optimizer state afresh); ``both`` on yesterday's and today's rows
from a fresh start (what retraining everything costs: 3x today's steps). Each is
evaluated on the held-out tail. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

DEFAULT_DATA = HERE.parents[1] / "shared" / "data" / "criteo_kaggle_head10k.tsv"
RUNS = ("yesterday", "cold", "warm", "both")


def split(data: Path, into: Path) -> dict[str, Path]:
    """The sample's rows cut into yesterday's, today's, both and the held-out tail."""
    lines = data.read_text().splitlines(keepends=True)
    a, b = int(0.6 * len(lines)), int(0.9 * len(lines))
    parts = {"yesterday": lines[:a], "today": lines[a:b], "both": lines[:b], "tail": lines[b:]}
    out = {}
    for name, rows in parts.items():
        out[name] = into / f"{name}.tsv"
        out[name].write_text("".join(rows))
    return out


def seed_runs(files: dict[str, Path], seed: int, a: argparse.Namespace, tmp: Path) -> list[dict]:
    from recsz.cli import main as cli

    base = ["--preset", a.preset, "--batch-size", str(a.batch_size), "--seed", str(seed),
            "--eval-data", str(files["tail"]), "--no-progress"]  # fmt: skip
    model = tmp / f"yesterday-{seed}.pt"
    data = {"yesterday": "yesterday", "cold": "today", "warm": "today", "both": "both"}
    rows = []
    for run in RUNS:
        out = tmp / f"{run}-{seed}"
        extra = ["--checkpoint-every", "1000000"] if run == "yesterday" else []
        if run == "warm":
            extra = ["--init-from", str(model)]
        argv = ["train", *base, "--data", str(files[data[run]]), "--out", str(out), *extra]
        assert cli(argv) == 0, run
        if run == "yesterday":
            assert cli(["export", str(out), "--out", str(model)]) == 0
        s = json.loads((out / "summary.json").read_text())
        rows.append({"run": run, "seed": seed, "steps": s["steps"], "auc": s["auc"],
                     "logloss": s["logloss"], "ne": s["ne"]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--json-out", default=str(HERE / "results" / "warmstart.json"))
    a = ap.parse_args(argv)
    data = Path(a.data)
    if not data.is_file():
        raise SystemExit(
            f"bench_warmstart: {data}: no such file (../shared/data beside the checkout)"
        )
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        files = split(data, tmp)
        for seed in (int(s) for s in a.seeds.split(",")):
            rows += seed_runs(files, seed, a, tmp)
    lines = [
        "| run | steps | AUC (mean) | logloss (mean) | AUC per seed |",
        "|---|---|---|---|---|",
    ]
    for run in RUNS:
        mine = [r for r in rows if r["run"] == run]
        aucs = [r["auc"] for r in mine]
        lines.append(
            f"| {run} | {mine[0]['steps']} | {statistics.mean(aucs):.4f} | "
            f"{statistics.mean(r['logloss'] for r in mine):.4f} | "
            + ", ".join(f"{x:.4f}" for x in aucs)
            + " |"
        )
    by = {(r["run"], r["seed"]): r["auc"] for r in rows}
    gain = [by["warm", s] - by["cold", s] for s in sorted({r["seed"] for r in rows})]
    head = (f"{data.name}: yesterday 60%, today 30%, held-out 10%; {a.preset} preset, batch "
            f"{a.batch_size}, one pass each, one process\n\n")  # fmt: skip
    tail = f"\nwarm - cold AUC per seed: {', '.join(f'{g:+.4f}' for g in gain)}\n"
    write_results(rows, a.json_out, head + "\n".join(lines) + "\n" + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
