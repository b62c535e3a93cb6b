"""Early stopping on real data: a run trained past its first epoch overfits, and
`--patience` ends it soon after its best evaluation, whose checkpoint it keeps.

    python benchmarks/bench_patience.py [--data ../shared/data/criteo_kaggle_head10k.tsv]
        [--steps 500] [--batch-size 64] [--eval-every 25] [--patience 2] [--seeds 3]
        [--preset tiny] [--json-out ...]

For each seed, one process trains ``--steps`` steps (the sample's 8,000 training rows at
batch 64: 125 a pass, so 500 are four passes) twice: through to the end, and with
``--patience``; both evaluate and keep a checkpoint every ``--eval-every`` steps
(``--keep-checkpoints 1``: the newest and the best evaluated). Each row: the steps trained,
their seconds (training, batch waits and evaluations), the final AUC (the last
evaluation's), the best evaluation (``best_checkpoint``: its step and AUC), and that
checkpoint scored again by ``recsz evaluate`` (the model kept is the model evaluated: the
same AUC). Prints a table and writes JSON rows ``seed, way, steps, seconds, final_auc,
best_step, best_auc, best_reevaluated``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

from recsz import cli  # noqa: E402

DATA = HERE.parents[1] / "shared" / "data" / "criteo_kaggle_head10k.tsv"


def _recsz(*args: str) -> None:
    """A `recsz` command in this process (one process: the imports paid once), quiet."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(list(args))
    if rc:
        raise RuntimeError(f"recsz {' '.join(args)}: exit status {rc}")


def run(seed: int, way: str, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{way}-{seed}"
    flags = ["--preset", a.preset, "--data", str(a.data), "--steps", str(a.steps),
             "--batch-size", str(a.batch_size), "--eval-every", str(a.eval_every),
             "--checkpoint-every", str(a.eval_every), "--keep-checkpoints", "1",
             "--seed", str(seed), "--no-progress", "--out", str(out)]  # fmt: skip
    if way == "patience":
        flags += ["--patience", str(a.patience)]
    _recsz("train", *flags)
    s = json.loads((out / "summary.json").read_text())
    best = s["best_checkpoint"]
    _recsz("evaluate", best["path"], "--no-progress", "--json", str(out / "best.json"))
    again = json.loads((out / "best.json").read_text())
    seconds = s["train_s"] + s["data_s"] + s["eval_s_total"]
    return {"seed": seed, "way": way, "steps": s["steps"], "seconds": seconds,
            "final_auc": s["auc"], "best_step": best["step"], "best_auc": best["auc"],
            "best_reevaluated": again["auc"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| seed | way | steps | seconds | final AUC | best step | best AUC | best, "
             "evaluated again |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['seed']} | {r['way']} | {r['steps']} | {r['seconds']:.1f} | "
                     f"{r['final_auc']:.4f} | {r['best_step']} | {r['best_auc']:.4f} | "
                     f"{r['best_reevaluated']:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--json-out", default=str(HERE / "results" / "patience.json"))
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            for way in ("full", "patience"):
                rows.append(run(seed, way, a, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
