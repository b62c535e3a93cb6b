"""Compressing only what crosses hosts (``--compress-scope``): 4 gloo ranks as 2 hosts of 2.

    python benchmarks/bench_hosts.py [--rates unshaped,1gbit] [--steps 30] [--repeats 3]
        [--configs none,hybrid-all,hybrid-between] [--quick] [--json-out PATH]

Each configuration trains the ``bench`` preset (global batch 2048, synthetic data) on two
torchrun agents of 2 ranks each, meeting at a rendezvous on this machine as two machines'
agents do (each its own node: ``GROUP_RANK``), the configurations in turn within each repeat:

- ``none``: uncompressed (id-aware traffic, lossless);
- ``hybrid-all``: bench_train's ``hybrid-dual+ids`` coding every block (``--compress-scope
  all``, what every run did before the option);
- ``hybrid-between``: the same, coding only the blocks between hosts (``--compress-scope
  auto``, which takes ``between-hosts`` here: the blocks within a host, the rank's own
  among them, go plain);
- ``hybrid-between+dp-eb`` and ``hybrid-between+dp-eb-hosts`` (``--configs``): the same with
  the MLP gradients through the eb hook, all-gathered or summed within hosts and coded
  across (``--dp-eb-collective hosts``); the JSON adds the all-reduce's seconds and MB.

A rate shapes the namespace's loopback (bench_train's ``shaped``): every hop alike, the hop
within a host too, where real hosts have NVLink or shared memory, so a shaped column charges
the plain blocks within a host the network's rate (against ``hybrid-between``); gloo on one
loopback cannot be given a fast hop within a host (a connection to any local address takes
that address as its source, so tc cannot tell the hops apart). The unshaped column measures
the codec's CPU time and the accuracy alone; ``MB between hosts`` is what crosses hosts
whatever the links are. Medians of ``--repeats`` (samples/s after the first steps); prints
a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_train import CONFIGS, RATES, can_shape, shaped  # noqa: E402
from results_io import write_results  # noqa: E402

HYBRID = CONFIGS["hybrid-dual+ids"]
VARIANTS = {
    "none": (),
    "hybrid-all": (*HYBRID, "--compress-scope", "all"),
    "hybrid-between": (*HYBRID, "--compress-scope", "auto"),
    # the MLP gradients too: the eb hook's all-gather, or summed within hosts and coded across
    "hybrid-between+dp-eb": (*HYBRID, "--dp-comm", "eb"),
    "hybrid-between+dp-eb-hosts": (*HYBRID, "--dp-comm", "eb", "--dp-eb-collective", "hosts"),
}
#: what runs unless --configs says otherwise
DEFAULT = ("none", "hybrid-all", "hybrid-between")


def run_hosts(prefix: list[str], flags: list[str], hosts: int, local: int) -> dict:
    """One training run on ``hosts`` torchrun agents of ``local`` ranks; its summary."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        cmd = [*prefix, sys.executable, "-m", "recsz.launcher", f"--nnodes={hosts}",
               f"--nproc-per-node={local}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "recsz.train", *flags,
               "--no-progress", "--out", out]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        agents = [
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for _ in range(hosts)
        ]
        said = [a.communicate(timeout=1200)[0].decode(errors="replace") for a in agents]
        if any(a.returncode for a in agents):
            raise RuntimeError(f"run failed ({' '.join(flags)}):\n{said[0][-3000:]}")
        return json.loads((Path(out) / "summary.json").read_text())


def row(rate: str, variant: str, runs: list[dict]) -> dict:
    def med(k: str) -> float:
        return statistics.median(r[k] for r in runs)

    return {
        "rate": rate,
        "config": variant,
        "ranks": "2 hosts x 2",
        "samples_per_s": med("samples_per_s_steady"),
        "codec_s": med("codec_s"),
        "a2a_s": med("a2a_fwd_s") + med("a2a_bwd_s"),
        "allreduce_s": med("allreduce_s"),
        "mb_allreduce": med("allreduce_bytes") / 1e6,
        "mb_allreduce_between": (
            med("allreduce_bytes_between_hosts") / 1e6
            if all("allreduce_bytes_between_hosts" in r for r in runs)
            else None
        ),
        "mb_wire": med("bytes_sent") / 1e6,
        "mb_between_hosts": med("bytes_between_hosts") / 1e6,
        "between_hosts_ratio": med("between_hosts_ratio"),
        "fwd_ratio": med("fwd_ratio"),
        "bwd_ratio": med("bwd_ratio"),
        "auc": med("auc"),
        "repeats": len(runs),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| link | config | samples/s | codec s | a2a s | MB on wire | MB between hosts | "
        "ratio between hosts | fwd ratio | bwd ratio | all-reduce s | all-reduce MB "
        "(between hosts) | AUC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | `{r['config']}` | {r['samples_per_s']:,.0f} | {r['codec_s']:.2f} | "
            f"{r['a2a_s']:.2f} | {r['mb_wire']:.1f} | {r['mb_between_hosts']:.1f} | "
            f"{r['between_hosts_ratio']:.1f}x | {r['fwd_ratio']:.1f}x | {r['bwd_ratio']:.1f}x | "
            f"{r['allreduce_s']:.2f} | {r['mb_allreduce']:.1f}"
            f"{_between(r['mb_allreduce_between'])} | {r['auc']:.4f} |"
        )
    return "\n".join(lines)


def _between(mb: float | None) -> str:
    return "" if mb is None else f" ({mb:.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="unshaped,1gbit")
    p.add_argument("--configs", default=",".join(DEFAULT), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny preset, 4 steps, one repeat")
    p.add_argument("--json-out", default=str(HERE / "results" / "hosts.json"))
    a = p.parse_args(argv)
    rates, variants = a.rates.split(","), a.configs.split(",")
    if a.quick:
        a.steps, a.repeats, rates = 4, 1, ["unshaped"]
    if (why := can_shape()) and any(RATES[r] for r in rates):
        print(f"[note] cannot shape the link ({why}); running unshaped only", file=sys.stderr)
        rates = ["unshaped"]
    preset, batch = ("tiny", 256) if a.quick else ("bench", 2048)
    common = ["--preset", preset, "--batch-size", str(batch), "--steps", str(a.steps),
              "--seed", str(a.seed), "--log-every", str(a.steps), "--synthetic-eval", "8192",
              "--eval-batch-size", "4096", "--prefetch", "0"]  # fmt: skip
    rows = []
    for rate in rates:
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        with shaped(RATES[rate]) as prefix:
            for _ in range(a.repeats):  # the configurations in turn: the machine's drift shared
                for v in variants:
                    runs[v].append(run_hosts(prefix, [*common, *VARIANTS[v]], 2, 2))
                    print(f"{rate} {v}: {runs[v][-1]['samples_per_s_steady']:.0f}/s", flush=True)
        rows += [row(rate, v, runs[v]) for v in variants]
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
