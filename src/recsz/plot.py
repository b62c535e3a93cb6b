"""`recsz plot RUN_DIR`: PNGs of a run's metrics (loss/AUC, per-table ratio and bound).
`recsz plot RUN_DIR RUN_DIR ...`: runs side by side: their loss and held-out AUC by step and
by training time (what compression buys is AUC sooner) in one PNG, and a table of each
run's final numbers and the options in which the runs differ."""

from __future__ import annotations

import argparse
import json
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


def compare_runs(runs: list[Path], out: Path) -> tuple[Path, str]:
    """Write ``out/compare.png`` (each run's training loss and held-out AUC by step, and
    its AUC by training seconds) and return it with a Markdown table of the runs' final
    numbers and the options that differ among them."""
    got = [(run, _rows(run)) for run in runs]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for run, rows in got:
        label = _label(run, runs)
        tr = [r for r in rows if "loss" in r]
        ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label=label)
        ev = [r for r in rows if "eval_auc" in r]
        ax[1].plot([r["step"] for r in ev], [r["eval_auc"] for r in ev], marker="o", label=label)
        # (the final evaluation's row has no time of its own: its step's training row's)
        at = {r["step"]: r["train_s"] for r in rows if "train_s" in r}
        ax[2].plot([at.get(r["step"], float("nan")) for r in ev], [r["eval_auc"] for r in ev],
                   marker="o", label=label)  # fmt: skip
    ax[0].set(xlabel="step", ylabel="training loss (BCE)", title="loss")
    ax[1].set(xlabel="step", ylabel="held-out AUC", title="AUC by step")
    ax[2].set(xlabel="training seconds", ylabel="held-out AUC", title="AUC by time")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    png = out / "compare.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    configs = [_config(run) for run, _ in got]
    keys = sorted({k for c in configs for k in c} - _NOT_COMPARED)
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
    lines = ["| run | steps | AUC | logloss | samples/s | fwd ratio | bwd ratio | MB sent | "
             "all-to-all s | codec s | options that differ |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (run, rows), config in zip(got, configs, strict=True):
        f = _final(run, rows)
        own = ", ".join(f"{k}={_shown(config.get(k))}" for k in differ) or "-"

        def num(key: str, form: str, f: dict[str, Any] = f) -> str:
            v = f.get(key)
            return "-" if v is None else format(v, form)

        a2a = (f.get("a2a_fwd_s") or 0.0) + (f.get("a2a_bwd_s") or 0.0)
        steps = f"{f.get('steps')}{' (unfinished)' if f.get('unfinished') else ''}"
        lines.append(f"| {_label(run, runs)} | {steps} | {num('auc', '.4f')} | "
                     f"{num('logloss', '.4f')} | {num('samples_per_s', ',.0f')} | "
                     f"{num('fwd_ratio', '.2f')}x | {num('bwd_ratio', '.2f')}x | "
                     f"{(f.get('bytes_sent') or 0) / 1e6:.2f} | {a2a:.2f} | "
                     f"{num('codec_s', '.2f')} | {own} |")  # fmt: skip
    return png, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="recsz plot", description=__doc__)
    ap.add_argument("run_dir", nargs="+", help="a run directory; several: compared")
    ap.add_argument("--out", default=".", help="several runs: where compare.png and "
                    "compare.md go (default: here)")  # fmt: skip
    a = ap.parse_args(argv)
    runs = [Path(r) for r in a.run_dir]
    if len(runs) == 1:
        for p in plot_run(runs[0]):
            print("wrote", p)
        return 0
    png, table = compare_runs(runs, Path(a.out))
    md = Path(a.out) / "compare.md"
    md.write_text(table + "\n")
    print(table)
    print("wrote", png)
    print("wrote", md)
    return 0
