"""`recsz plot RUN_DIR`: PNGs of a run's metrics (loss/AUC, per-table ratio and bound).
`recsz plot RUN_DIR RUN_DIR ...`: runs side by side: their loss and held-out AUC by step and
by training time (what compression buys is AUC sooner) in one PNG, and a table of each
run's final numbers and the options in which the runs differ."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt

from recsz.config import NOT_RESUMED
from recsz.report import read_metrics


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (is this a run directory?)")
    return read_metrics(path)


def plot_run(run: Path) -> list[Path]:
    """Write training.png and tables_fwd.png / tables_bwd.png into the run directory."""
    rows = _rows(run)
    written = []
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    tr = [r for r in rows if "loss" in r]
    ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr])
    ax[0].set(xlabel="step", ylabel="training loss (BCE)", title="loss")
    ev = [r for r in rows if "eval_auc" in r]
    ax[1].plot([r["step"] for r in ev], [r["eval_auc"] for r in ev], marker="o")
    ax[1].set(xlabel="step", ylabel="held-out AUC", title="AUC")
    fig.tight_layout()
    out = run / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    written.append(out)
    tab = [r for r in rows if "tables" in r]
    for d in ("fwd", "bwd"):
        series: dict[str, tuple[list[int], list[float], list[float]]] = {}
        for r in tab:
            for t, v in r["tables"].items():
                if v.get(f"{d}_ratio") is None:
                    continue
                s = series.setdefault(t, ([], [], []))
                s[0].append(r["step"])
                s[1].append(v[f"{d}_ratio"])
                s[2].append(v.get(f"{d}_eb") or float("nan"))
        if not series:
            continue
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for t, (steps, ratio, eb) in sorted(series.items(), key=lambda kv: int(kv[0])):
            ax[0].plot(steps, ratio, label=f"C{int(t) + 1}")
            ax[1].plot(steps, eb, label=f"C{int(t) + 1}")
        ax[0].set(xlabel="step", ylabel="cumulative ratio", title=f"{d}: ratio per table")
        ax[1].set(
            xlabel="step",
            ylabel="absolute bound",
            yscale="log",
            title=f"{d}: error bound per table",
        )
        ax[1].legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1, 0.5))
        fig.tight_layout()
        out = run / f"tables_{d}.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


#: What a comparison leaves out of the options that differ: what a resumed run never takes
#: from its run (where it reads and writes, what it measured), how a run showed progress and
#: kept checkpoints.
_NOT_COMPARED = {*NOT_RESUMED, "progress", "max_restarts", "keep_checkpoints"}


def _label(run: Path, runs: list[Path]) -> str:
    """A run's name in a comparison: its directory's, or its path where names repeat."""
    names = [r.name for r in runs]
    return run.name if names.count(run.name) == 1 else str(run)


def _final(run: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's final numbers: its summary.json's, or (a run under way or cut short) its
    last metrics row's and its last evaluation's."""
    path = run / "summary.json"
    if path.exists():
        return json.loads(path.read_text())
    last = rows[-1] if rows else {}
    ev: dict[str, Any] = next((r for r in reversed(rows) if "eval_auc" in r), {})
    return {**last, "auc": ev.get("eval_auc"), "logloss": ev.get("eval_logloss"),
            "steps": last.get("step"), "unfinished": True}  # fmt: skip


def _config(run: Path) -> dict[str, Any]:
    path = run / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _shown(v: Any) -> str:
    """An option's value in a comparison; None (the preset's or recsz's default) as such."""
    return "default" if v is None else str(v)


def auc_curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's evaluations (its metrics rows): each one's step, the training seconds up to
    it (the step loop's, without batch waits or evaluations; the final evaluation's row has
    none of its own: its step's training row's, NaN where no row of that step has them) and
    held-out AUC."""
    at = {r["step"]: r["train_s"] for r in rows if "train_s" in r}
    return [{"step": r["step"], "train_s": at.get(r["step"], math.nan), "auc": r["eval_auc"]}
            for r in rows if "eval_auc" in r]  # fmt: skip


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """The training seconds at which ``curve`` (:func:`auc_curve`) first reaches the AUC
    ``target``, linear between the evaluation below it and the first at or above it (that
    one's seconds where none is below); None where none reaches it. Evaluations without
    seconds are passed over."""
    below: dict[str, Any] | None = None
    for point in curve:
        if math.isnan(point["train_s"]):
            continue
        if point["auc"] >= target:
            if below is None or point["auc"] == below["auc"]:
                return float(point["train_s"])
            f = (target - below["auc"]) / (point["auc"] - below["auc"])
            return float(below["train_s"] + f * (point["train_s"] - below["train_s"]))
        below = point
    return None


def compare_runs(runs: list[Path], out: Path, target: float | None = None) -> tuple[Path, str]:
    """Write ``out/compare.png`` (each run's training loss and held-out AUC by step, and
    its AUC by training seconds) and return it with a Markdown table of the runs' final
    numbers and the options that differ among them; ``target``: each run's training seconds
    to that held-out AUC too (:func:`time_to`), as MLPerf times training."""
    got = [(run, _rows(run)) for run in runs]
    curves = [auc_curve(rows) for _, rows in got]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for (run, rows), ev in zip(got, curves, strict=True):
        label = _label(run, runs)
        tr = [r for r in rows if "loss" in r]
        ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label=label)
        ax[1].plot([p["step"] for p in ev], [p["auc"] for p in ev], marker="o", label=label)
        ax[2].plot([p["train_s"] for p in ev], [p["auc"] for p in ev], marker="o", label=label)
    ax[0].set(xlabel="step", ylabel="training loss (BCE)", title="loss")
    ax[1].set(xlabel="step", ylabel="held-out AUC", title="AUC by step")
    ax[2].set(xlabel="training seconds", ylabel="held-out AUC", title="AUC by time")
    if target is not None:
        for a in ax[1:]:
            a.axhline(target, color="grey", linewidth=0.8)
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    png = out / "compare.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    configs = [_config(run) for run, _ in got]
    keys = sorted({k for c in configs for k in c} - _NOT_COMPARED)
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
    to = [] if target is None else [f"s to AUC {target}"]
    lines = ["| " + " | ".join(["run", "steps", "AUC", "logloss", *to, "samples/s", "fwd ratio",
             "bwd ratio", "MB sent", "all-to-all s", "codec s", "options that differ"]) + " |",
             "|---" * (11 + len(to)) + "|"]  # fmt: skip
    for (run, rows), config, ev in zip(got, configs, curves, strict=True):
        f = _final(run, rows)
        own = ", ".join(f"{k}={_shown(config.get(k))}" for k in differ) or "-"
        reach = ""
        if target is not None:
            t = time_to(ev, target)
            reach = f"{'not reached' if t is None else f'{t:.2f}'} | "

        def num(key: str, form: str, f: dict[str, Any] = f) -> str:
            v = f.get(key)
            return "-" if v is None else format(v, form)

        a2a = (f.get("a2a_fwd_s") or 0.0) + (f.get("a2a_bwd_s") or 0.0)
        steps = f"{f.get('steps')}{' (unfinished)' if f.get('unfinished') else ''}"
        lines.append(f"| {_label(run, runs)} | {steps} | {num('auc', '.4f')} | "
                     f"{num('logloss', '.4f')} | {reach}{num('samples_per_s', ',.0f')} | "
                     f"{num('fwd_ratio', '.2f')}x | {num('bwd_ratio', '.2f')}x | "
                     f"{(f.get('bytes_sent') or 0) / 1e6:.2f} | {a2a:.2f} | "
                     f"{num('codec_s', '.2f')} | {own} |")  # fmt: skip
    return png, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="recsz plot", description=__doc__)
    ap.add_argument("run_dir", nargs="+", help="a run directory; several: compared")
    ap.add_argument("--out", default=".", help="several runs: where compare.png and "
                    "compare.md go (default: here)")  # fmt: skip
    ap.add_argument("--target", type=float, metavar="AUC", help="several runs: each one's "
                    "training seconds to this held-out AUC too (--eval-every's evaluations, "
                    "linear between them)")  # fmt: skip
    a = ap.parse_args(argv)
    runs = [Path(r) for r in a.run_dir]
    if len(runs) == 1:
        if a.target is not None:
            ap.error("--target compares runs: give two or more")
        for p in plot_run(runs[0]):
            print("wrote", p)
        return 0
    png, table = compare_runs(runs, Path(a.out), a.target)
    md = Path(a.out) / "compare.md"
    md.write_text(table + "\n")
    print(table)
    print("wrote", png)
    print("wrote", md)
    return 0
