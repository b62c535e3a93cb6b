"""Which MLP start learns more, by the model's count of tables: `--mlp-init dlrm` against
`--mlp-init torch`, one process each, on the generator's data of each shape.

    python benchmarks/bench_mlpinit.py [--shapes criteo,8x20000,...] [--seeds 3]
        [--steps 100] [--preset bench] [--json-out ...]

A shape is `criteo` (the preset's own tables) or a `--table-rows` value. Each (shape, start,
seed) trains `--steps` steps and reports its held-out AUC; the table gives each shape's
mean AUC of both starts and their difference (torch - dlrm), with the seeds it won. Prints
a table and writes JSON rows ``shape, tables, init, seed, auc``.
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

from recsz.config import TrainConfig  # noqa: E402

INITS = ("dlrm", "torch")


def run(shape: str, init: str, seed: int, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{shape}-{init}-{seed}"
    flags = ["--preset", a.preset, "--steps", str(a.steps), "--seed", str(seed),
             "--mlp-init", init, "--no-progress", "--out", str(out)]  # fmt: skip
    if shape != "criteo":
        flags += ["--table-rows", shape]
    subprocess.run([sys.executable, "-m", "recsz.cli", "train", *flags], check=True,
                   capture_output=True)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    rows = None if shape == "criteo" else shape
    tables = TrainConfig(preset=a.preset, table_rows=rows).model().n_tables
    return {"shape": shape, "tables": tables, "init": init, "seed": seed, "auc": summary["auc"]}


def table(rows: list[dict]) -> str:
    lines = ["| shape | dlrm AUC | torch AUC | torch - dlrm | seeds torch won |",
             "|---|---|---|---|---|"]  # fmt: skip
    for shape in dict.fromkeys(r["shape"] for r in rows):
        auc = {i: {r["seed"]: r["auc"] for r in rows if r["shape"] == shape and r["init"] == i}
               for i in INITS}  # fmt: skip
        seeds = sorted(set(auc["dlrm"]) & set(auc["torch"]))
        if not seeds:
            continue
        d, t = (statistics.mean(auc[i][s] for s in seeds) for i in INITS)
        won = sum(auc["torch"][s] > auc["dlrm"][s] for s in seeds)
        lines.append(f"| {shape} | {d:.4f} | {t:.4f} | {t - d:+.4f} | {won} of {len(seeds)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="criteo,8x20000,26x20000,40x20000,60x20000,100x20000")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--json-out", default=str(HERE / "results" / "mlpinit.json"))
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            for shape in a.shapes.split(","):
                for init in INITS:
                    rows.append(run(shape, init, seed, a, Path(tmp)))
                    print(json.dumps(rows[-1]), flush=True)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
