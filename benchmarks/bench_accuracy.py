"""Accuracy study: the same model and data under each error-bound policy.

    python benchmarks/bench_accuracy.py [--quick] [--json-out PATH]
    python benchmarks/bench_accuracy.py --hooks [--synthetic] [--sweep] [--json-out PATH]
    python benchmarks/bench_accuracy.py --a2a [--synthetic] [--seeds N] [--json-out PATH]
    ... [--train-flags '--interaction dcn']   (more flags for every run)

Trains the ``tiny`` DLRM in one process (the codec runs on the same all-to-all path as in
distributed runs, looping back to itself) with:
- ``none``: uncompressed;
- ``fixed``: hybrid codec, one relative bound 0.03 for every table;
- ``table``: hybrid, table classes from the homogenization index (0.01 / 0.03 / 0.05);
- ``dual``: table classes times the iteration decay (the published method);
each forward only (``fwd``, the published setting) and forward + backward (``fwd+bwd``);
- ``dct-mp``: DCT's hard threshold on the all-to-all (5% kept), masked gradients backward.

Data: (a) the synthetic generator, >= 1,000,000 training samples (100,000 with --quick);
(b) the real 10k Criteo sample, one pass, 3 seeds. Prints one table, writes JSON rows
with ``data, policy, direction, seed, auc, logloss, auc_delta, fwd_ratio, bwd_ratio``.

``--hooks``: the MLP gradients' exchanges on 2 ranks instead (:func:`plan_hooks`), each at
its default or, with ``--sweep``, at several settings (bytes against AUC). ``--a2a``: the
all-to-all's bounds instead (:func:`plan_a2a`), with the MLP gradients through ``eb``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from recsz.train import main as train_main

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass(frozen=True)
class Run:
    data: str
    policy: str
    direction: str
    seed: int
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    data: str
    policy: str
    direction: str
    seed: int
    auc: float
    logloss: float
    auc_delta: float
    fwd_ratio: float | None
    bwd_ratio: float | None
    seconds: float
    allreduce_bytes: int | None = None  # --hooks: the MLP gradients' bytes, all ranks


POLICIES = {
    "none": (),
    "fixed": ("--eb-policy", "fixed", "--fwd-eb", "0.03", "--bwd-eb", "0.03"),
    "table": ("--eb-policy", "table"),
    "dual": ("--eb-policy", "dual"),
    # DCT-MP (one process: no data-parallel all-reduce to threshold), 5% of entries kept.
    "dct-mp": ("--fwd-codec", "dct", "--bwd-codec", "dct-mask", "--dct-keep", "0.05"),
}


def plan(quick: bool, extra_policies: dict[str, tuple[str, ...]]) -> list[Run]:
    runs = []
    synth_steps = 100 if quick else 1000  # x batch 1024 samples
    synth = (
        "--data",
        "synthetic",
        "--batch-size",
        "1024",
        "--steps",
        str(synth_steps),
        "--synthetic-eval",
        "20000",
    )
    real_file = SHARED / "criteo_kaggle_head10k.tsv"
    datasets = [("synthetic", synth, [0])]
    if real_file.exists():
        datasets.append(("real10k", ("--data", str(real_file)), [0, 1, 2]))
    else:
        print(f"[skip] real data: {real_file} not found", file=sys.stderr)
    policies = {**POLICIES, **extra_policies}
    for data, dflags, seeds in datasets:
        for seed in seeds:
            for name, pflags in policies.items():
                dirs = (
                    [("-", ())]
                    if name == "none" or name.startswith("dct")
                    else [
                        ("fwd", ("--fwd-codec", "hybrid")),
                        ("fwd+bwd", ("--fwd-codec", "hybrid", "--bwd-codec", "hybrid")),
                    ]
                )
                for dname, cflags in dirs:
                    runs.append(
                        Run(
                            data,
                            name,
                            dname,
                            seed,
                            (*dflags, *pflags, *cflags, "--seed", str(seed)),
                        )
                    )
    return runs


#: --hooks --sweep: each hook at several settings, for the bytes-against-AUC curves.
SWEEP = {
    "eb": ("--dp-eb", ("0.003", "0.01", "0.03", "0.1")),
    "powersgd": ("--powersgd-rank", ("1", "2", "4")),
    "dct": ("--dct-keep", ("0.003", "0.01", "0.03")),
}


def _two_ranks(synthetic: bool, seeds: int) -> list[tuple[str, int, tuple[str, ...]]]:
    """The 2-rank studies' (data name, seed, flags) per seed: 1,024,000 synthetic samples or
    the real sample, one pass (none where the real sample is missing)."""
    real_file = SHARED / "criteo_kaggle_head10k.tsv"
    if synthetic:
        name = "synthetic"
        data: tuple[str, ...] = ("--data", "synthetic", "--batch-size", "1024", "--steps", "1000")
    elif real_file.exists():
        name, data = "real10k", ("--data", str(real_file))
    else:
        print(f"[skip] real data: {real_file} not found", file=sys.stderr)
        return []
    return [(name, seed, (*data, "--nproc", "2", "--seed", str(seed))) for seed in range(seeds)]


_DUAL_BOTH = ("--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--eb-policy", "dual")


def plan_hooks(synthetic: bool, sweep: bool = False, seeds: int = 3) -> list[Run]:
    """--hooks: the MLP gradients' exchanges (--dp-comm) on 2 ranks, with the hybrid codec
    and dual bounds both ways on the all-to-all, on the real sample (or with --synthetic on
    1,024,000 synthetic samples); "none" is uncompressed everywhere. With ``sweep``, the
    settings of :data:`SWEEP` (direction ``dp-MODE@VALUE``) instead of each hook's
    default."""
    runs = []
    for name, seed, base in _two_ranks(synthetic, seeds):
        runs.append(Run(name, "none", "dp-allreduce", seed, base))
        for m in ("allreduce", "fp16", "bf16", "powersgd", "dct", "eb"):
            flags = (*base, *_DUAL_BOTH, "--dp-comm", m)
            if not sweep or m not in SWEEP:
                runs.append(Run(name, "dual", f"dp-{m}", seed, flags))
                continue
            opt, values = SWEEP[m]
            for v in values:
                runs.append(Run(name, "dual", f"dp-{m}@{v}", seed, (*flags, opt, v)))
    return runs


def _classes(scale: float, bwd: float | None = None) -> tuple[str, ...]:
    """The class bounds: the published ones times ``scale`` (the backward's times ``bwd``
    where given)."""

    def eb(k: float) -> str:
        return ",".join(f"{k * b:.3g}" for b in (0.01, 0.03, 0.05))

    return ("--fwd-class-eb", eb(scale), "--bwd-class-eb", eb(scale if bwd is None else bwd))


#: --a2a: the all-to-all's settings: policy "dual" at the published method's class bounds
#: (0.01, 0.03, 0.05) times a scale (/3 is the default since the eleventh session), or forward
#: only at the published bounds (the published setting), each with the MLP gradients via eb.
A2A = {
    "dual": (*_DUAL_BOTH, *_classes(1)),
    "dual/3": (*_DUAL_BOTH, *_classes(1 / 3)),
    "dual/10": (*_DUAL_BOTH, *_classes(1 / 10)),
    # the default forward, the gradients a tenth of it (the sequence sharder's default)
    "dual/3+bwd/10": (*_DUAL_BOTH, *_classes(1 / 3, 1 / 30)),
    "dual-fwd": ("--fwd-codec", "hybrid", "--eb-policy", "dual", *_classes(1)[:2]),
    # the fastest configuration on slow links: the defaults with the MLPs in bfloat16
    "dual/3+amp": (*_DUAL_BOTH, *_classes(1 / 3), "--dense-dtype", "bf16"),
}


def plan_a2a(synthetic: bool, seeds: int = 5) -> list[Run]:
    """--a2a: how much of the uncompressed run's AUC each all-to-all setting of :data:`A2A`
    keeps, with the MLP gradients through ``--dp-comm eb`` (2 ranks, id-aware traffic);
    "none" is uncompressed everywhere, first for each seed."""
    runs = []
    for name, seed, base in _two_ranks(synthetic, seeds):
        runs.append(Run(name, "none", "-", seed, base))
        for a2a, flags in A2A.items():
            runs.append(Run(name, a2a, "dp-eb", seed, (*base, *flags, "--dp-comm", "eb")))
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out", default="bench_out/accuracy.json")
    ap.add_argument("--hooks", action="store_true", help="only the --dp-comm study (2 ranks)")
    ap.add_argument("--synthetic", action="store_true", help="--hooks on 1M synthetic samples")
    ap.add_argument("--sweep", action="store_true", help="--hooks: each hook at several settings")
    ap.add_argument("--a2a", action="store_true", help="only the all-to-all bounds study (2 ranks)")
    ap.add_argument("--seeds", type=int, default=None, help="--hooks/--a2a: seeds (3 / 5)")
    ap.add_argument(
        "--only",
        default="",
        help="comma list: keep these settings (the direction column, e.g. dp-eb@0.03, or "
        "with --a2a the policy column, e.g. dual/3) and each seed's uncompressed run",
    )
    ap.add_argument(
        "--versus",
        default="",
        help="comma list of A:B settings (as --only names them): their paired AUC difference "
        "A - B over the seeds",
    )
    ap.add_argument(
        "--train-flags",
        default="",
        help="more recsz train flags, every run (e.g. '--interaction dcn')",
    )
    a = ap.parse_args(argv)
    results: list[Result] = []
    base: dict[tuple[str, int], float] = {}
    if a.a2a:
        runs = plan_a2a(a.synthetic, a.seeds or 5)
    elif a.hooks:
        runs = plan_hooks(a.synthetic, a.sweep, a.seeds or 3)
    else:
        runs = plan(a.quick, {})
    if a.only:
        keep = set(a.only.split(","))
        runs = [r for r in runs if r.policy == "none" or keep & {r.direction, r.policy}]
    versus = [tuple(v.split(":")) for v in a.versus.split(",") if v]
    planned = {x for r in runs if r.policy != "none" for x in (r.direction, r.policy)}
    if bad := [v for v in versus if len(v) != 2 or not set(v) <= planned]:
        ap.error(f"--versus {bad}: want A:B pairs of planned settings ({sorted(planned)})")
    for run in runs:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            train_main([*run.flags, *shlex.split(a.train_flags), "--no-progress", "--out", tmp])
            secs = time.perf_counter() - t
            s = json.loads((Path(tmp) / "summary.json").read_text())
        if run.policy == "none":
            base[(run.data, run.seed)] = s["auc"]
        r = Result(
            run.data,
            run.policy,
            run.direction,
            run.seed,
            s["auc"],
            s["logloss"],
            s["auc"] - base.get((run.data, run.seed), float("nan")),
            _num(s["fwd_ratio"]),
            _num(s["bwd_ratio"]),
            secs,
            s.get("allreduce_bytes"),
        )
        results.append(r)
        print(
            f"{r.data:9s} seed {r.seed} {r.policy:6s} {r.direction:7s} AUC {r.auc:.4f} "
            f"(delta {r.auc_delta:+.4f}) logloss {r.logloss:.4f} fwd {_fmt(r.fwd_ratio)} "
            f"bwd {_fmt(r.bwd_ratio)}  {r.seconds:.0f}s",
            flush=True,
        )
    print_paired(results, versus)
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"wrote {out}")
    return 0


def print_paired(results: list[Result], versus: list[tuple[str, ...]]) -> None:
    """Per setting, the AUC difference against the uncompressed run of the same seed
    (mean, sd, standard error); per ``versus`` pair of settings (A, B), the same of A - B."""
    auc: dict[tuple[str, str], dict[int, float]] = {}  # (data, setting) -> seed -> AUC
    loss: dict[tuple[str, str], dict[int, float]] = {}  # ... -> log loss
    for r in results:
        setting = "none" if r.policy == "none" else f"{r.policy} {r.direction}"
        auc.setdefault((r.data, setting), {})[r.seed] = r.auc
        loss.setdefault((r.data, setting), {})[r.seed] = r.logloss

    def named(data: str, x: str) -> str:  # x: a direction (--hooks) or a policy (--a2a)
        return next((k for d, k in auc if d == data and x in k.split(" ", 1)), "")

    pairs = [(data, k, "none") for data, k in auc if k != "none"]
    datasets = sorted({d for d, _ in auc})
    pairs += [(d, named(d, x), named(d, y)) for x, y in versus for d in datasets]
    print("| setting | data | seeds | paired ΔAUC mean | sd | standard error "
          "| paired Δ log loss mean | sd |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for data, x, y in pairs:
        a, b = auc.get((data, x), {}), auc.get((data, y), {})
        diff = [a[seed] - b[seed] for seed in sorted(a) if seed in b]
        if len(diff) < 2:
            continue
        la, lb = loss[(data, x)], loss[(data, y)]
        dl = [la[seed] - lb[seed] for seed in sorted(la) if seed in lb]
        sd = statistics.stdev(diff)
        name = x if y == "none" else f"{x} - {y}"
        print(f"| {name} | {data} | {len(diff)} | {statistics.fmean(diff):+.4f} | {sd:.4f} | "
              f"{sd / len(diff) ** 0.5:.4f} | {statistics.fmean(dl):+.4f} | "
              f"{statistics.stdev(dl):.4f} |")  # fmt: skip


def _num(x: float) -> float | None:
    return None if x != x else x  # NaN (nothing sent) -> null in JSON


def _fmt(x: float | None) -> str:
    return "   -  " if x is None else f"{x:6.2f}x"


if __name__ == "__main__":
    sys.exit(main())
