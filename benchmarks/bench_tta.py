"""Time to a held-out AUC: ours against TorchRec's DMP on a shaped link, as MLPerf times
training (to a target quality, not for a number of steps).

    python benchmarks/bench_tta.py [--rates unshaped,1gbit,200mbit] [--seeds 0,1]
        [--target 0.82] [--max-steps 300] [--eval-every 10] [--configs ...] [--json-out PATH]

Every configuration trains the ``bench`` preset (``--preset``; 2 ranks, global batch 2048,
``--batch-size``; synthetic data, one seed's model and batches for all) and evaluates the
same held-out samples every ``--eval-every`` steps, stopping at the first evaluation that
reaches ``--target`` (at most ``--max-steps``). Time to the target is the training seconds
(the step loop's, without making batches or evaluating: both sides count them alike) at
which the held-out AUC crosses the target, linearly between the evaluations around it. So
it weighs what each step costs on the link with what each step learns: a lossy exchange
that saves seconds but learns less per step shows here, where samples/s alone would hide it.

A configuration ending in ``+torch-init`` is ours with PyTorch's MLP initialization
(``--mlp-init torch``), the one TorchRec's DLRM keeps: what our default (the reference
DLRM's) adds to the time, apart from the link. Links are shaped as in ``bench_train.py``
(a network namespace per rate, deleted afterwards).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from pathlib import Path

from bench_train import RATES, can_shape, flags_of, run_one, shaped, torchrec_available
from results_io import write_results

from recsz.plot import time_to

TORCH_INIT = "+torch-init"

#: Each side's fastest ways at these rates (bench_train.py's headline): ours uncompressed
#: and id-aware (lossless), the hybrid codec both ways with our hook on the MLPs (in float32
#: and in bfloat16), TorchRec's DMP in float32 and with its bf16 and MX4 comms (bf16 beside
#: torch's bf16 DDP hook and autocast: every saving TorchRec and torch offer at once).
DEFAULT = [
    "none",
    "none+ids+amp",
    "hybrid-dual+ids+dp-eb",
    "hybrid-dual+ids+dp-eb+amp",
    "hybrid-dual+ids+dp-eb+amp" + TORCH_INIT,
    "trdmp-fp32",
    "trdmp-bf16+amp",
    "trdmp-bf16+dp-bf16+amp",
    "trdmp-mx4",
]


def config_flags(config: str) -> tuple[str, ...]:
    if config.endswith(TORCH_INIT):
        return (*flags_of(config.removesuffix(TORCH_INIT)), "--mlp-init", "torch")
    return flags_of(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="unshaped,1gbit,200mbit", help=", ".join(RATES))
    ap.add_argument("--seeds", default="0,1", help="model init and data order, a run each")
    ap.add_argument("--target", type=float, default=0.82, help="held-out AUC to reach")
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=16384)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--configs", help=f"comma list (default: {', '.join(DEFAULT)})")
    ap.add_argument("--json-out", default="bench_out/tta.json")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # namespaces deleted
    rates = a.rates.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    configs = a.configs.split(",") if a.configs else DEFAULT
    if any(c.startswith("trdmp-") for c in configs) and not torchrec_available():
        print("[note] TorchRec not importable: skipping its DMP runs (make anchors)")
        configs = [c for c in configs if not c.startswith("trdmp-")]
    if (why := can_shape()) and any(RATES[r] for r in rates):
        print(f"[note] cannot shape the link ({why}); running unshaped only")
        rates = ["unshaped"]
    rows: list[dict] = []
    for rate in rates:
        with shaped(RATES[rate]) as prefix:
            for seed in seeds:
                common = [
                    *("--preset", a.preset, "--batch-size", str(a.batch_size)),
                    *("--seed", str(seed)),
                    *("--steps", str(a.max_steps), "--target-auc", str(a.target)),
                    *("--eval-every", str(a.eval_every), "--log-every", str(a.eval_every)),
                    *("--synthetic-eval", str(a.eval_samples), "--eval-batch-size", "4096"),
                    *("--prefetch", "0"),  # batches made in the loop, timed apart, as DMP's
                ]
                for cfg in configs:
                    flags = config_flags(cfg)
                    s, wall = run_one(prefix, 2, flags, common, timeout=1800)
                    t = time_to(s["curve"], a.target)
                    row = {
                        "rate": rate,
                        "seed": seed,
                        "config": cfg,
                        "target": a.target,
                        "time_to_target_s": t,
                        "steps": s["steps"],
                        "samples_per_s": s["samples_per_s"],
                        "final_auc": s["auc"],
                        "bytes_sent": s["bytes_sent"],
                        "wall_s": wall,
                        "curve": s["curve"],
                    }
                    rows.append(row)
                    said = "not reached" if t is None else f"{t:6.1f} s"
                    print(
                        f"{rate:9s} seed {seed} {cfg:34s} {said} to AUC {a.target} "
                        f"({s['steps']} steps, {s['samples_per_s']:7.0f} samples/s, "
                        f"AUC {s['auc']:.4f})",
                        flush=True,
                    )
    table = markdown(rows, configs, rates, seeds, a.target)
    write_results(rows, a.json_out, table)
    plot(rows, Path(a.json_out).with_suffix(".png"), rates, a.target)
    return 0


def markdown(
    rows: list[dict], configs: list[str], rates: list[str], seeds: list[int], target: float
) -> str:
    """Per rate and configuration: each seed's seconds to the target and their mean, and
    the mean against TorchRec's fastest and against ``none`` (each seed's ratio, averaged)."""

    times = {(r["rate"], r["config"], r["seed"]): r["time_to_target_s"] for r in rows}

    def ratio(rate: str, cfg: str, others: list[str]) -> str:
        """Mean over seeds of the fastest of ``others`` over ``cfg`` ('-' where either is
        missing for a seed)."""
        got = []
        for seed in seeds:
            theirs = [x for o in others if (x := times.get((rate, o, seed))) is not None]
            mine = times.get((rate, cfg, seed))
            if mine is None or not theirs:
                return "-"
            got.append(min(theirs) / mine)
        return f"{statistics.mean(got):.2f}x"

    # TorchRec's own comms (DMP with our sharder, trdmp-hybrid*, is ours)
    dmp = [c for c in configs if c.startswith("trdmp-") and "hybrid" not in c]
    head = (
        f"| rate | config | seconds to AUC {target} ({', '.join(f'seed {s}' for s in seeds)}) "
        "| mean s | TorchRec's fastest / this | none / this |\n|---|---|---|---|---|---|\n"
    )
    body = ""
    for rate in rates:
        for cfg in configs:
            each = [times.get((rate, cfg, s)) for s in seeds]
            said = ", ".join("-" if x is None else f"{x:.1f}" for x in each)
            mean = "-" if None in each else f"{statistics.mean(each):.1f}"  # type: ignore[type-var]
            vs_dmp = ratio(rate, cfg, dmp) if dmp else "-"
            vs_none = ratio(rate, cfg, ["none"]) if "none" in configs else "-"
            body += f"| {rate} | {cfg} | {said} | {mean} | {vs_dmp} | {vs_none} |\n"
    return head + body


def plot(rows: list[dict], path: Path, rates: list[str], target: float) -> None:
    """Held-out AUC against training seconds, a panel a rate, the first seed's runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    seed = rows[0]["seed"] if rows else 0
    for ax, rate in zip(axes[0], rates, strict=True):
        for r in rows:
            if r["rate"] == rate and r["seed"] == seed:
                style = "--" if r["config"].startswith("trdmp-") else "-"
                xs, ys = [p["train_s"] for p in r["curve"]], [p["auc"] for p in r["curve"]]
                ax.plot(xs, ys, style, marker=".", label=r["config"])
        ax.axhline(target, color="grey", linewidth=0.8)
        ax.set(title=f"{rate}, seed {seed}", xlabel="training seconds", ylabel="held-out AUC")
        ax.set_ylim(0.7, None)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
