"""`recsz plot RUN_DIR`: PNGs of a run's metrics (loss/AUC, per-table ratio and bound)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="recsz plot", description=__doc__)
    ap.add_argument("run_dir")
    a = ap.parse_args(argv)
    for p in plot_run(Path(a.run_dir)):
        print("wrote", p)
    return 0
