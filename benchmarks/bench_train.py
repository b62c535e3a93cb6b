"""End-to-end training speed on a bandwidth-limited link, every configuration side by side.

    python benchmarks/bench_train.py [--quick] [--json-out PATH] [--rates ...] [--worlds 2,4]

Each rate runs inside a fresh network namespace whose loopback is shaped with
``tc qdisc add dev lo root tbf rate RATE burst 128kb latency 100ms``; the ranks talk over
that loopback only, and the namespace is deleted afterwards (also on failure or Ctrl-C).
Table-row-wise configurations (``+twrw``: 2 hosts) keep the traffic within a host on an
address of that loopback which tc leaves unshaped (``--host-link fast``, the default).
Without root or without ``ip``/``tc`` it says so and runs unshaped only.

Same model (``bench`` preset: Terabyte dims, tables hashed to 50k rows), data (synthetic),
seed, global batch and step count for every configuration. Speedup is samples/s over the
``none`` run of the same rate and world size, measured in the same invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from recsz.codecs.anchors import fbgemm_available
from recsz.plot import auc_curve
from recsz.report import read_metrics

RATES = {"unshaped": None, "10gbit": "10gbit", "1gbit": "1gbit", "200mbit": "200mbit"}

# name -> train flags. TorchRec's precisions are our codecs of the same formats; like
# TorchRec they send every sample's vector (no id-aware traffic), and so does "none".
_PLAIN = ("--no-id-dedup", "--no-bwd-coalesce")
_DUAL = ("--fwd-codec", "hybrid", "--eb-policy", "dual", "--hindex-probe-steps", "2")
CONFIGS: dict[str, tuple[str, ...]] = {
    "none": _PLAIN,
    "fp16": (*_PLAIN, "--fwd-codec", "fp16", "--bwd-codec", "fp16"),
    "bf16": (*_PLAIN, "--fwd-codec", "bf16", "--bwd-codec", "bf16"),
    "fp8": (*_PLAIN, "--fwd-codec", "fp8", "--bwd-codec", "fp8"),
    "int8": (*_PLAIN, "--fwd-codec", "int8", "--bwd-codec", "int8"),
    "zstd": (*_PLAIN, "--fwd-codec", "zstd", "--bwd-codec", "zstd"),
    # fbgemm's own quantized-comm codecs, as TorchRec uses them (anchors extra).
    "tr-fp16": (*_PLAIN, "--fwd-codec", "tr-fp16", "--bwd-codec", "tr-fp16"),
    "tr-bf16": (*_PLAIN, "--fwd-codec", "tr-bf16", "--bwd-codec", "tr-bf16"),
    "tr-fp8": (*_PLAIN, "--fwd-codec", "tr-fp8", "--bwd-codec", "tr-fp8"),
    "tr-mx4": (*_PLAIN, "--fwd-codec", "tr-mx4", "--bwd-codec", "tr-mx4"),
    "dct": (
        *_PLAIN,
        "--fwd-codec",
        "dct",
        "--bwd-codec",
        "dct-mask",
        "--dct-keep",
        "0.05",
        "--dp-comm",
        "dct",
    ),
    "hybrid-fixed-fwd": (*_PLAIN, "--fwd-codec", "hybrid", "--eb-policy", "fixed"),
    "hybrid-dual-fwd": (*_PLAIN, *_DUAL),
    "hybrid-dual-fwd+bwd": (*_PLAIN, *_DUAL, "--bwd-codec", "hybrid"),
    "hybrid-dual+ids": (*_DUAL, "--bwd-codec", "hybrid", "--id-dedup", "--bwd-coalesce"),
    # --compress auto: the plain exchange (none) where trials find it faster
    "hybrid-dual+ids+auto": (
        *(*_DUAL, "--bwd-codec", "hybrid", "--id-dedup", "--bwd-coalesce"),
        *("--compress", "auto"),
    ),
    # The MLP gradients too (--dp-comm): torch's fp16/bf16/PowerSGD hooks, DCT-DP, ours.
    **{
        f"hybrid-dual+ids+dp-{m}": (*_DUAL, "--bwd-codec", "hybrid", "--dp-comm", m)
        for m in ("fp16", "bf16", "powersgd", "dct", "eb")
    },
    "hybrid-dual+ids+dp-eb+auto": (
        *(*_DUAL, "--bwd-codec", "hybrid", "--dp-comm", "eb"),
        *("--compress", "auto"),
    ),
    # --dp-comm eb's two collectives (allgather is the default).
    **{
        f"hybrid-dual+ids+dp-eb-{c}": (
            *_DUAL,
            "--bwd-codec",
            "hybrid",
            "--dp-comm",
            "eb",
            "--dp-eb-collective",
            c,
        )
        for c in ("allgather", "rsag")
    },
    # TorchRec's own DistributedModelParallel (benchmarks/torchrec_dmp.py), table-wise,
    # with its quantized comms: the anchor as a practitioner would run it.
    "trdmp-fp32": ("--dmp", "fp32"),
    "trdmp-fp16": ("--dmp", "fp16"),
    "trdmp-bf16": ("--dmp", "bf16"),
    "trdmp-mx4": ("--dmp", "mx4"),
    "trdmp-hybrid": ("--dmp", "hybrid"),  # TorchRec's DMP with recsz's sharder
    "trdmp-hybrid+auto": ("--dmp", "hybrid", "--sharder-opts", '{"compress": "auto"}'),
    # ... and the dense part's DDP hook (recsz.torchrec.dense_comm): torch's bf16 cast
    # beside TorchRec's bf16 comms, our error-bounded one beside our sharder
    "trdmp-bf16+dp-bf16": ("--dmp", "bf16", "--dp-comm", "bf16"),
    "trdmp-hybrid+dp-eb": ("--dmp", "hybrid", "--dp-comm", "eb"),
    "trdmp-hybrid+dp-eb+auto": (
        *("--dmp", "hybrid", "--dp-comm", "eb"),
        *("--sharder-opts", '{"compress": "auto"}'),
    ),
    # The MLPs and interaction in bfloat16 (torch.autocast), ours and DMP's alike.
    "none+amp": (*_PLAIN, "--dense-dtype", "bf16"),
    # The trainer's defaults with no codec: id-aware traffic (lossless), no TorchRec peer.
    "none+ids": ("--id-dedup", "--bwd-coalesce"),
    # the MLPs' gradients compressed, the embeddings' exchange not: is a choice per part
    # (not one for the whole step, as --compress auto's) ever worth having?
    "none+ids+dp-eb": ("--id-dedup", "--bwd-coalesce", "--dp-comm", "eb"),
    "none+ids+amp": ("--id-dedup", "--bwd-coalesce", "--dense-dtype", "bf16"),
    "hybrid-dual+ids+amp": (*_DUAL, "--bwd-codec", "hybrid", "--dense-dtype", "bf16"),
    "hybrid-dual+ids+dp-eb+amp": (
        *_DUAL,
        "--bwd-codec",
        "hybrid",
        "--dp-comm",
        "eb",
        "--dense-dtype",
        "bf16",
    ),
    # ... where trials find it faster (--compress auto), the MLPs in bfloat16 either way
    "hybrid-dual+ids+dp-eb+amp+auto": (
        *(*_DUAL, "--bwd-codec", "hybrid", "--dp-comm", "eb", "--dense-dtype", "bf16"),
        *("--compress", "auto"),
    ),
    "trdmp-fp32+amp": ("--dmp", "fp32", "--autocast"),
    "trdmp-bf16+amp": ("--dmp", "bf16", "--autocast"),
    # each side's every saving at once: the exchange's, the dense part's hook, autocast
    "trdmp-bf16+dp-bf16+amp": ("--dmp", "bf16", "--dp-comm", "bf16", "--autocast"),
    "trdmp-hybrid+dp-eb+amp": ("--dmp", "hybrid", "--dp-comm", "eb", "--autocast"),
    # Row-wise tables (each table's rows over all ranks: a reduce-scatter of partial sums;
    # TorchRec's takes no MX4 or FP8 there, it sends FP16 / BF16 instead).
    **{f"trdmp-{p}+rw": ("--dmp", p, "--sharding", "rw") for p in ("fp32", "bf16", "hybrid")},
    "trdmp-bf16+rw+dp-bf16": ("--dmp", "bf16", "--sharding", "rw", "--dp-comm", "bf16"),
    "trdmp-hybrid+rw+dp-eb": ("--dmp", "hybrid", "--sharding", "rw", "--dp-comm", "eb"),
    # Table-row-wise tables over 2 hosts (a reduce-scatter within a host, an all-to-all
    # between hosts; our sharder compresses the latter): world sizes of 4 and up.
    **{f"trdmp-{p}+twrw": ("--dmp", p, "--sharding", "twrw") for p in ("fp32", "bf16", "hybrid")},
    "trdmp-bf16+twrw+dp-bf16": ("--dmp", "bf16", "--sharding", "twrw", "--dp-comm", "bf16"),
    "trdmp-hybrid+twrw+dp-eb": ("--dmp", "hybrid", "--sharding", "twrw", "--dp-comm", "eb"),
    # ... with TorchRec's bf16 comms on the hop within a host, which ours leave alone
    "trdmp-hybrid+twrw-bf16+dp-eb": (
        *("--dmp", "hybrid", "--sharding", "twrw"),
        *("--intra", "bf16", "--dp-comm", "eb"),
    ),
}
#: Any config of ours with this suffix runs with glibc's malloc as it comes (``--host-memory
#: return``): what keeping freed host memory wins.
RETURN_MEMORY = "+return-memory"


def flags_of(config: str) -> tuple[str, ...]:
    if config.endswith(RETURN_MEMORY):
        return (*CONFIGS[config.removesuffix(RETURN_MEMORY)], "--host-memory", "return")
    return CONFIGS[config]


#: --quick runs these (one of each kind) so that it stays under 10 minutes here.
QUICK = [
    "none",
    "bf16",
    "fp8",
    "zstd",
    "tr-bf16",
    "tr-mx4",
    "trdmp-bf16",
    "trdmp-mx4",
    "trdmp-hybrid",
    "dct",
    "hybrid-dual-fwd",
    "hybrid-dual+ids",
    "hybrid-dual+ids+dp-dct",
]

#: Options of ours that the DMP runner takes too.
DMP_OPTS = (
    "--preset",
    "--steps",
    "--batch-size",
    "--seed",
    "--synthetic-eval",
    "--eval-batch-size",
    "--multi-hot",
    "--multi-hot-draws",
    "--emb-lr",
    "--interaction",
    "--eval-every",
    "--target-auc",
    "--table-rows",
    "--dense-features",
)


def torchrec_available() -> bool:
    import warnings

    try:
        with warnings.catch_warnings():  # its import warns (deprecations), harmlessly
            warnings.simplefilter("ignore")
            import torchrec.distributed  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class Row:
    rate: str
    config: str
    world_size: int
    steps: int
    samples_per_s: float
    speedup: float
    auc: float
    auc_delta: float
    bytes_sent: int
    fwd_ratio: float | None
    bwd_ratio: float | None
    a2a_fwd_s: float
    a2a_bwd_s: float
    allreduce_s: float
    codec_s: float
    compute_s: float
    wall_s: float
    allreduce_bytes: int | None = None  # the MLP gradients' bytes (TorchRec runs: unknown)
    compressed_steps: int | None = None  # --compress auto: the steps its switch compressed


def can_shape() -> str | None:
    """None if namespaces can be shaped here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2)"
    return None


#: Where ``--host-link fast`` puts the traffic within a host (table-row-wise's reduce-scatter):
#: an address of the namespace's loopback, labelled so that gloo can be given it by name
#: (``GLOO_SOCKET_IFNAME``), which tc leaves unshaped.
HOST_ADDR, HOST_IF = "10.213.0.1", "lo:host"


@contextlib.contextmanager
def shaped(rate: str | None, fast_hosts: bool = False) -> Iterator[list[str]]:
    """A command prefix that runs inside a namespace with loopback shaped to ``rate``;
    ``fast_hosts``: but for the traffic of :data:`HOST_ADDR` (the ranks find its name in
    ``RECSZ_HOST_LINK``), as within a host, where NVLink beats any network."""
    if rate is None:
        yield []
        return
    ns = f"recsz-bench-{os.getpid()}"

    def run(*cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True)

    tbf = ("tbf", "rate", rate, "burst", "128kb", "latency", "100ms")
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        run("ip", "link", "set", "lo", "up")
        if not fast_hosts:
            run("tc", "qdisc", "add", "dev", "lo", "root", *tbf)
            yield ["ip", "netns", "exec", ns]
            return
        run("ip", "addr", "add", f"{HOST_ADDR}/32", "dev", "lo", "label", HOST_IF)
        # two classes that do not limit, everything in the second, shaped by the same tbf,
        # but what goes to HOST_ADDR (htb: the one classful qdisc this kernel has)
        run("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "20")
        for c in ("1:10", "1:20"):
            run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", c, "htb",
                "rate", "100gbit", "quantum", "200000")  # fmt: skip
        run("tc", "qdisc", "add", "dev", "lo", "parent", "1:20", "handle", "20:", *tbf)
        run("tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
            "u32", "match", "ip", "dst", f"{HOST_ADDR}/32", "flowid", "1:10")  # fmt: skip
        yield ["ip", "netns", "exec", ns, "env", f"RECSZ_HOST_LINK={HOST_IF}"]
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, stderr=subprocess.DEVNULL)


def run_one(
    prefix: list[str], world: int, flags: tuple[str, ...], common: list[str], timeout: float
) -> tuple[dict, float]:
    if flags[0] == "--dmp":  # TorchRec's DMP: same steps, batch, seed and eval set
        opts = dict(zip(common[::2], common[1::2], strict=True))
        program = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(Path(__file__).with_name("torchrec_dmp.py")),
            "--precision",
            flags[1],
            *flags[2:],
            *(f for k in DMP_OPTS if k in opts for f in (k, opts[k])),
        ]
    else:
        program = ["-m", "recsz.cli", "train", "--nproc", str(world), *common, *flags]
        program += ["--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*prefix, sys.executable, *program, "--out", tmp]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            raise RuntimeError(
                f"run failed ({' '.join(flags)}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
            )
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        if "curve" not in summary:  # ours: the held-out AUC of each evaluation (--eval-every)
            summary["curve"] = auc_curve(read_metrics(Path(tmp) / "metrics.jsonl"))
        return summary, wall


def plot(rows: list[Row], path: Path, batch: int = 2048) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in RATES if any(x.rate == r for x in rows)]
    world = max(x.world_size for x in rows)
    fig, ax = plt.subplots(1, 2, figsize=(14, 5))
    for i, cfg in enumerate(CONFIGS):
        ys = [
            next(
                (
                    x.speedup
                    for x in rows
                    if x.rate == r and x.config == cfg and x.world_size == world
                ),
                float("nan"),
            )
            for r in rates
        ]
        style = {"marker": "os^D"[(i // 10) % 4], "linestyle": "-" if i < 10 else "--"}
        ax[0].plot(rates, ys, label=cfg, **style)
    ax[0].set(
        xlabel="link rate",
        ylabel=f"speedup vs none ({world} ranks)",
        title="samples/s relative to uncompressed",
    )
    ax[0].legend(fontsize=6, ncol=2)
    slow = rates[-1]
    sel = [x for x in rows if x.rate == slow and x.world_size == world]
    parts = ["compute_s", "a2a_fwd_s", "a2a_bwd_s", "allreduce_s", "codec_s"]
    bottom = [0.0] * len(sel)
    for part in parts:
        vals = [getattr(x, part) / x.steps for x in sel]
        vals = [0.0 if v != v else v for v in vals]  # NaN: no breakdown (TorchRec's DMP)
        ax[1].bar([x.config for x in sel], vals, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    # Runs without a breakdown (TorchRec's DMP) show their whole step time.
    total = [batch / x.samples_per_s if x.compute_s != x.compute_s else 0.0 for x in sel]
    ax[1].bar([x.config for x in sel], total, color="grey", label="step (no breakdown)")
    ax[1].set(ylabel="seconds per step", title=f"time per step at {slow}, {world} ranks")
    ax[1].tick_params(axis="x", rotation=60, labelsize=7)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(rows: list[Row]) -> str:
    head = (
        "| rate | ranks | config | samples/s | speedup | a2a fwd s | a2a bwd s | all-reduce s "
        "| codec s | MB on wire | fwd ratio | bwd ratio | AUC | ΔAUC | compressed steps |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r.rate} | {r.world_size} | {r.config} | {r.samples_per_s:.0f} | {r.speedup:.2f}x "
        f"| {r.a2a_fwd_s:.2f} | {r.a2a_bwd_s:.2f} | {r.allreduce_s:.2f} | {r.codec_s:.2f} "
        f"| {r.bytes_sent / 1e6:.1f} | {_f(r.fwd_ratio)} | {_f(r.bwd_ratio)} | {r.auc:.4f} "
        f"| {r.auc_delta:+.4f} | {_steps(r)} |\n"
        for r in rows
    )
    return head + body


def _compressed_steps(summary: dict) -> int | None:
    """--compress auto's compressed steps (None: every step as configured)."""
    switch = summary.get("compress") or {}
    return switch["steps"]["compressed"] if switch.get("mode") == "auto" else None


def _steps(r: Row) -> str:
    return "all" if r.compressed_steps is None else f"{r.compressed_steps}/{r.steps}"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def _num(x: float) -> float | None:
    return None if x != x else float(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, 1gbit and 200mbit, 8 steps, one configuration of each kind",
    )
    ap.add_argument("--json-out", default="bench_out/train.json")
    ap.add_argument("--rates", help="comma list of " + ", ".join(RATES))
    ap.add_argument("--worlds", help="comma list of world sizes")
    ap.add_argument("--steps", type=int)
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per configuration; the median is kept"
    )
    ap.add_argument(
        "--configs",
        help=f"comma list of {', '.join(CONFIGS)}; ours also with {RETURN_MEMORY}",
    )
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order")
    ap.add_argument(
        "--multi-hot", default="", help="recsz train's --multi-hot, for every run (DMP's too)"
    )
    ap.add_argument(
        "--multi-hot-draws",
        default="hash",
        help="recsz train's --multi-hot-draws, for every run (DMP's bags the same)",
    )
    ap.add_argument("--emb-lr", help="the tables' learning rate, every run (default: preset's)")
    ap.add_argument(
        "--interaction",
        default="dot",
        help="recsz train's --interaction, every run (dcn: TorchRec's DLRM_DCN for DMP's)",
    )
    ap.add_argument(
        "--table-rows", help="recsz train's --table-rows, every run (DMP's tables the same)"
    )
    ap.add_argument(
        "--dense-features", help="recsz train's --dense-features, every run (DMP's the same)"
    )
    ap.add_argument("--train-flags", default="", help="more recsz train flags, our runs only")
    ap.add_argument(
        "--host-link",
        default="fast",
        choices=["fast", "shaped"],
        help="twrw configs' traffic within a host (2 hosts of world / 2 ranks): left "
        "unshaped, as NVLink, or shaped like the rest",
    )
    a = ap.parse_args(argv)
    # SIGTERM (e.g. a job runner's kill) unwinds like Ctrl-C, so namespaces get deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rates = a.rates.split(",") if a.rates else ["1gbit", "200mbit"] if a.quick else list(RATES)
    worlds = [int(w) for w in a.worlds.split(",")] if a.worlds else [2] if a.quick else [2, 4]
    steps = a.steps or (8 if a.quick else 30)
    configs = a.configs.split(",") if a.configs else QUICK if a.quick else list(CONFIGS)
    if not fbgemm_available():
        print(
            "[note] fbgemm-gpu-cpu not installed: skipping TorchRec's tr-* codecs "
            "(pip install 'recsz[anchors]')",
            file=sys.stderr,
        )
        configs = [c for c in configs if not c.startswith("tr-")]
    if any(c.startswith("trdmp-") for c in configs) and not torchrec_available():
        print(
            "[note] TorchRec not importable: skipping its DMP runs (make anchors)",
            file=sys.stderr,
        )
        configs = [c for c in configs if not c.startswith("trdmp-")]
    why = can_shape()
    if why and any(RATES[r] for r in rates):
        print(f"[note] cannot shape the link ({why}); running unshaped only", file=sys.stderr)
        rates = ["unshaped"]
    common = [
        "--preset",
        a.preset,
        "--batch-size",
        str(a.batch_size),
        "--steps",
        str(steps),
        "--seed",
        str(a.seed),
        "--log-every",
        str(steps),
        "--synthetic-eval",
        "8192",
        "--eval-batch-size",
        "4096",
        # Batches made in the loop and timed apart, as the DMP runner does: on a machine
        # whose cores the ranks fill, a prefetch thread would take its time from training.
        "--prefetch",
        "0",
        *(("--multi-hot", a.multi_hot) if a.multi_hot else ()),
        *(("--multi-hot-draws", a.multi_hot_draws) if a.multi_hot_draws != "hash" else ()),
        *(("--emb-lr", a.emb_lr) if a.emb_lr else ()),
        *(("--interaction", a.interaction) if a.interaction != "dot" else ()),
        *(("--table-rows", a.table_rows) if a.table_rows else ()),
        *(("--dense-features", a.dense_features) if a.dense_features else ()),
    ]
    print(
        f"machine: {os.cpu_count()} cores (ranks share them: compute is slow, the link is "
        f"what differs between rates)",
        flush=True,
    )
    rows: list[Row] = []
    for rate in rates:
        fast_hosts = a.host_link == "fast" and any("+twrw" in c for c in configs)
        with shaped(RATES[rate], fast_hosts) as prefix:
            for world in worlds:
                base: dict | None = None
                for cfg in configs:
                    flags = flags_of(cfg)
                    if flags[0] != "--dmp":
                        flags = (*flags, *shlex.split(a.train_flags))
                    runs = [
                        run_one(prefix, world, flags, common, timeout=900) for _ in range(a.repeats)
                    ]
                    # The median run by samples/s (the machine is shared and noisy).
                    s, wall = sorted(runs, key=lambda r: r[0]["samples_per_s"])[len(runs) // 2]
                    if base is None or cfg == "none":
                        base = s  # speedups are relative to "none" (else the first config)
                    ref = base
                    r = Row(
                        rate,
                        cfg,
                        world,
                        s["steps"],
                        s["samples_per_s"],
                        s["samples_per_s"] / ref["samples_per_s"],
                        s["auc"],
                        s["auc"] - ref["auc"],
                        s["bytes_sent"],
                        _num(s["fwd_ratio"]),
                        _num(s["bwd_ratio"]),
                        s["a2a_fwd_s"],
                        s["a2a_bwd_s"],
                        s["allreduce_s"],
                        s["codec_s"],
                        s["compute_s"],
                        wall,
                        s.get("allreduce_bytes"),
                        _compressed_steps(s),
                    )
                    rows.append(r)
                    print(
                        f"{rate:9s} W={world} {cfg:20s} {r.samples_per_s:8.0f} samples/s "
                        f"{r.speedup:5.2f}x  wire {r.bytes_sent / 1e6:8.1f} MB  "
                        f"fwd {_f(r.fwd_ratio):>6s} bwd {_f(r.bwd_ratio):>6s}  "
                        f"AUC {r.auc:.4f} ({r.auc_delta:+.4f})  compressed {_steps(r)}",
                        flush=True,
                    )
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    out.with_suffix(".md").write_text(markdown(rows))
    plot(rows, out.with_suffix(".png"), a.batch_size)
    print("\n" + markdown(rows))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
