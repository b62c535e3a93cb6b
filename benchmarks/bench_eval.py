"""Evaluation: the held-out numbers, and a whole evaluation across ranks, against the code
of another revision side by side.

    python benchmarks/bench_eval.py [--old DIR] [--sizes 1e6,1e7,3e7] [--worlds 1,2]
        [--presets tiny,bench] [--n-eval N] [--eval-batches 16384] [--repeats 3]
        [--rounds 1] [--raw-lines 1e6] [--raw-trained FLAGS;FLAGS] [--json-out PATH]

(a) **metrics**: AUC, logloss and accuracy of N predictions on the host, as the trainer
    computed them before (scikit-learn on float64 copies, after ``np.unique`` of the
    labels) and as ``recsz.metrics.binary_metrics`` does (torch, one sort); each in a
    process of its own, which also reports the host memory it took beyond its data (peak
    RSS after, less before); the AUC's and logloss's differences.
(b) **evaluation**: ``recsz.evaluation.evaluate`` of the ``--n-eval`` synthetic held-out
    samples (global batches of each of ``--eval-batches``) on W gloo ranks of one host,
    timed on rank 0 (median of ``--repeats`` after one untimed, in each of ``--rounds``
    processes, the trees taken in turn), with this checkout's
    code and with ``--old``'s (a checkout of another revision, e.g. ``git worktree add
    /tmp/old REV``): the same model, codec ``none``, the evaluation path alone. Before
    the thirty-third session every rank made every batch whole, copied its predictions
    to the host each batch and ran scikit-learn over all of them; now each makes its
    part, rank 0 computes.
(c) **a raw file**: ``recsz evaluate RUN --eval-data FILE`` of ``--raw-lines`` real Criteo
    lines (the 10k sample of ``../shared/data`` repeated), and ``recsz predict RUN TEST``
    of the same lines with their labels cut (Criteo's test layout), one process each, with
    this checkout's code and ``--old``'s (which has no ``predict``), in turn: seconds
    (median of ``--repeats``) and the process's peak host memory. Before the thirty-fifth session
    the file was read whole into arrays; now it is streamed a batch at a time. The model
    scored: the tiny preset's, or of each ``--raw-trained`` set of training flags (e.g.
    ``--preset bench --emb-optimizer adagrad``). Before the forty-second session scoring
    built the optimizers and their state (exact Adagrad's: as large as the tables).
Prints a table and writes JSON (default benchmarks/results/eval.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import write_results

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


# ---- (a) the metrics alone, each in its own process -------------------------------------
def metrics_child(way: str, n: int) -> None:
    import numpy as np
    import torch

    g = np.random.default_rng(0)
    y = (g.random(n) < 0.25).astype(np.float32)
    p = (1 / (1 + np.exp(-(g.normal(size=n) + 1.2 * y)))).astype(np.float32)
    p = np.round(p, 5).astype(np.float32)  # ties, as float32 sigmoids of a model have
    pt, yt = torch.from_numpy(p), torch.from_numpy(y)
    from sklearn.metrics import log_loss, roc_auc_score

    from recsz.metrics import binary_metrics

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    if way == "sklearn":
        yd, pd = y.astype(np.float64), p.astype(np.float64)
        assert len(np.unique(yd)) == 2
        auc = float(roc_auc_score(yd, pd))
        logloss = float(log_loss(yd, np.clip(pd, 1e-7, 1 - 1e-7), labels=[0.0, 1.0]))
        float(((pd > 0.5) == (yd > 0.5)).mean())
    else:
        got = binary_metrics(pt, yt)
        auc, logloss = got["auc"], got["logloss"]
    s = time.perf_counter() - t
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps({"s": s, "auc": auc, "logloss": logloss, "extra_bytes": extra}))


def metrics_rows(sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        runs: dict[str, list[dict]] = {"sklearn": [], "recsz": []}
        for _ in range(repeats if n <= 10_000_000 else 1):
            for way, got in runs.items():
                argv = [sys.executable, __file__, "--metrics-child", way, str(n)]
                out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
                got.append(json.loads(out.strip().splitlines()[-1]))
        old, new = runs["sklearn"], runs["recsz"]
        rows.append(
            {
                "part": "metrics",
                "samples": n,
                "sklearn_s": statistics.median(r["s"] for r in old),
                "recsz_s": statistics.median(r["s"] for r in new),
                "sklearn_extra_gb": max(r["extra_bytes"] for r in old) / 1e9,
                "recsz_extra_gb": max(r["extra_bytes"] for r in new) / 1e9,
                "auc_diff": abs(old[0]["auc"] - new[0]["auc"]),
                "logloss_diff": abs(old[0]["logloss"] - new[0]["logloss"]),
            }
        )
        r = rows[-1]
        print(f"metrics {n:,}: sklearn {r['sklearn_s']:.2f} s, recsz {r['recsz_s']:.2f} s")
    return rows


# ---- (b) a whole evaluation on W ranks ----------------------------------------------------
def eval_child(preset: str, n_eval: int, repeats: int, out: str, batch: int) -> None:
    """On each rank (under torchrun): the trainer's parts and one evaluation, timed."""
    import torch

    from recsz.config import parse_train_args
    from recsz.data.source import make_source
    from recsz.model import get_preset
    from recsz.ranks import Ranks
    from recsz.step import build_parts

    try:
        from recsz.evaluation import evaluate
    except ImportError:  # code before the thirty-fourth session (--old)
        from recsz.step import evaluate  # type: ignore[attr-defined,no-redef]

    torch.set_num_threads(1)  # the ranks share the host's cores, as the trainer's do
    argv = ["--preset", preset, "--synthetic-eval", str(n_eval), "--eval-batch-size", str(batch)]
    cfg = parse_train_args(argv)
    ranks = Ranks.from_env(600.0)
    parts, _ = build_parts(cfg, ranks)
    source = make_source("synthetic", get_preset(preset).model.table_sizes, 0, False, n_eval)
    times, got = [], {}
    for k in range(repeats + 1):
        ranks.barrier()
        t = time.perf_counter()
        got = evaluate(parts, source, cfg, 0, ranks)
        if k:
            times.append(time.perf_counter() - t)
    if ranks.rank == 0:
        Path(out).write_text(json.dumps({"times": times, "auc": got["auc"]}))
    ranks.close(True)


def eval_rows(
    old: str | None,
    worlds: list[int],
    presets: list[str],
    n_eval: int,
    repeats: int,
    batches: list[int],
    rounds: int = 1,
) -> list[dict]:
    rows = []
    trees = {"new": SRC} | ({"old": Path(old) / "src"} if old else {})
    for preset, w, batch in ((p, w, b) for p in presets for w in worlds for b in batches):
        got: dict[str, dict] = {name: {"times": []} for name in trees}
        for _ in range(rounds):  # the trees in turn, a process each a round
            for name, src in trees.items():
                out = Path(f"/tmp/bench_eval_{os.getpid()}_{name}.json")
                env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
                argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                        str(w), "--master-port", str(29700 + w), __file__, "--eval-child",
                        preset, str(n_eval), str(repeats), str(out), str(batch)]  # fmt: skip
                subprocess.run(argv, check=True, env=env, capture_output=True)
                one = json.loads(out.read_text())
                got[name] = {"times": got[name]["times"] + one["times"], "auc": one["auc"]}
                out.unlink()
        row = {"part": "evaluation", "preset": preset, "world": w, "samples": n_eval,
               "eval_batch": batch}  # fmt: skip
        for name, g in got.items():
            row[f"{name}_s"] = statistics.median(g["times"])
            row[f"{name}_auc"] = g["auc"]
        if "old_s" in row:
            row["speedup"] = row["old_s"] / row["new_s"]
        rows.append(row)
        print(json.dumps(row))
    return rows


# ---- (c) a raw file from a checkpoint, each run in its own process ----------------------
def raw_child(argv: list[str]) -> None:
    from recsz.cli import main as cli

    t = time.perf_counter()
    rc = cli(argv)
    s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rc": rc, "s": s, "peak_gb": peak / 1e9}))


def raw_rows(
    old: str | None, lines: int, repeats: int, work: Path, trained: list[str]
) -> list[dict]:
    sample = HERE.parents[1] / "shared" / "data" / "criteo_kaggle_head10k.tsv"
    if not lines or not sample.exists():
        print(f"raw file: skipped ({sample} absent or --raw-lines 0)")
        return []
    text = sample.read_text().splitlines(keepends=True)
    labeled, test = work / "eval.tsv", work / "test.txt"
    with labeled.open("w") as f, test.open("w") as g:
        for i in range(lines):
            f.write(text[i % len(text)])
            g.write(text[i % len(text)].split("\t", 1)[1])
    run = work / "run"
    train = ["train", "--steps", "10", "--batch-size", "256", "--synthetic-eval", "512",
             "--checkpoint-every", "10", "--no-progress", "--out", str(run), *trained]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    subprocess.run([sys.executable, "-m", "recsz.cli", *train], check=True, env=env,
                   capture_output=True)  # fmt: skip
    trees = {"new": SRC} | ({"old": Path(old) / "src"} if old else {})
    commands = {
        "evaluate": ["evaluate", str(run), "--eval-data", str(labeled)],
        "predict": ["predict", str(run), str(test), "--out", str(work / "p.npy")],
    }
    rows = []
    for what, argv in commands.items():
        row: dict = {"part": "raw", "what": what, "lines": lines, "trained": " ".join(trained)}
        has = (
            (lambda src: (src / "recsz" / "prediction.py").exists()) if what == "predict" else bool
        )
        runs = {n: src for n, src in trees.items() if has(src)}  # (`recsz predict`: 35th session)
        got: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(repeats):  # the trees taken in turn: the machine's drift hits both
            for name, src in runs.items():
                env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
                cmd = [sys.executable, __file__, "--raw-child", json.dumps(argv)]
                out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
                got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                assert got[name][-1]["rc"] == 0, (name, what, out.stderr[-2000:])
        for name, g in got.items():
            row[f"{name}_s"] = statistics.median(x["s"] for x in g)
            row[f"{name}_peak_gb"] = max(x["peak_gb"] for x in g)
        rows.append(row)
        print(json.dumps(row))
    return rows


def table(rows: list[dict]) -> str:
    out = []
    m = [r for r in rows if r["part"] == "metrics"]
    if m:
        out += [
            "| samples | scikit-learn (before) | recsz.metrics | ratio | extra host memory, "
            "before / now | abs. AUC diff. | abs. logloss diff. |",
            "|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['samples']:,} | {r['sklearn_s']:.2f} s | {r['recsz_s']:.2f} s | "
            f"**{r['sklearn_s'] / r['recsz_s']:.2f}x** | {r['sklearn_extra_gb']:.2f} / "
            f"{r['recsz_extra_gb']:.2f} GB | {r['auc_diff']:.1e} | {r['logloss_diff']:.1e} |"
            for r in m
        ]
    e = [r for r in rows if r["part"] == "evaluation"]
    if e:
        out += ["", "| preset | ranks | samples | eval batch | before | now | ratio | "
                "AUC before / now |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in e:
            before = f"{r['old_s']:.2f} s" if "old_s" in r else "-"
            ratio = f"**{r['speedup']:.2f}x**" if "speedup" in r else "-"
            aucs = f"{r.get('old_auc', float('nan')):.4f} / {r['new_auc']:.4f}"
            out.append(f"| {r['preset']} | {r['world']} | {r['samples']:,} | "
                       f"{r['eval_batch']:,} | {before} | {r['new_s']:.2f} s | {ratio} | "
                       f"{aucs} |")  # fmt: skip
    raw = [r for r in rows if r["part"] == "raw"]
    if raw:
        out += ["", "| command | model trained with | lines | before: s, peak memory | now: "
                "s, peak memory |", "|---|---|---|---|---|"]  # fmt: skip
        for r in raw:
            before = f"{r['old_s']:.1f} s, {r['old_peak_gb']:.2f} GB" if "old_s" in r else "-"
            out.append(f"| `recsz {r['what']}` | `{r.get('trained') or '(tiny)'}` | "
                       f"{r['lines']:,} | {before} | {r['new_s']:.1f} s, "
                       f"{r['new_peak_gb']:.2f} GB |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="a checkout of another revision, timed beside this one")
    ap.add_argument("--sizes", default="1e6,1e7,3e7", help="metrics: predictions ('' none)")
    ap.add_argument("--worlds", default="1,2", help="evaluation: ranks ('' none)")
    ap.add_argument("--presets", default="tiny,bench")
    ap.add_argument("--n-eval", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="evaluation: processes a tree, in turn")
    ap.add_argument("--eval-batches", default="16384", help="global evaluation batches")
    ap.add_argument("--raw-lines", type=float, default=1e6, help="(c): lines (0: none)")
    ap.add_argument("--raw-trained", default="", help="(c): the models scored, each its "
                    "training's flags (10 steps), ';' between them ('': tiny's)")  # fmt: skip
    ap.add_argument("--json-out", default=str(HERE / "results" / "eval.json"))
    ap.add_argument("--raw-child", help=argparse.SUPPRESS)
    ap.add_argument("--metrics-child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--eval-child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.metrics_child:
        metrics_child(a.metrics_child[0], int(a.metrics_child[1]))
        return 0
    if a.raw_child:
        raw_child(json.loads(a.raw_child))
        return 0
    if a.eval_child:
        preset, n, repeats, out, batch = a.eval_child
        eval_child(preset, int(n), int(repeats), out, int(batch))
        return 0
    sizes = [int(float(s)) for s in a.sizes.split(",") if s]
    worlds = [int(w) for w in a.worlds.split(",") if w]
    rows = metrics_rows(sizes, a.repeats)
    evals = [int(b) for b in a.eval_batches.split(",")]
    rows += eval_rows(a.old, worlds, a.presets.split(","), a.n_eval, a.repeats, evals, a.rounds)
    with tempfile.TemporaryDirectory() as work:
        for i, flags in enumerate(a.raw_trained.split(";")):
            (Path(work) / str(i)).mkdir()
            rows += raw_rows(a.old, int(a.raw_lines), a.repeats, Path(work) / str(i), flags.split())
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
