"""The trainer's runs of a GPU check (`gpu_check.sh`), one after another in one process.

Every run is `recsz train` on one GPU at batch 8192 (the bench preset), in the order of what
the open issues ask first: the trainer issue's target (the fixed-size, sync-free step,
eagerly and as CUDA graphs, `none` and `hybrid`), then the default id-aware traffic, then
each feature that has never run on a GPU. One process: the imports, the CUDA context and
the coder's compiled kernels are paid once, not once a run (about 5 s each here).

Each run's summary (or its error, or "skipped" where the deadline would pass) is appended
to ``OUT/train.jsonl`` as it ends, so a check cut short keeps what ran (the runs' own
directories go to ``--runs``: what OUT holds comes back from the device, 8 files at most).
A run that leaves the GPU unusable (an illegal address poisons the process's CUDA context)
ends the process with :data:`RESTART`; `gpu_check.sh` then starts it again for the runs not
yet recorded.

    python benchmarks/gpu_train.py OUT --deadline EPOCH_S [--only NAME,...] [--dry]
    python benchmarks/gpu_train.py OUT --table     # the runs OUT holds, side by side

``--dry``: the same runs, tiny, on the CPU (tests; runs that need a GPU record their error).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from recsz.config import parse_train_args
from recsz.train import run

#: exit status when the CUDA context is gone: start a new process for the rest
RESTART = 3
FIXED = ["--no-id-dedup", "--no-bwd-coalesce"]  # fixed-size traffic: no host sync a step
MULTI_HOT = ["--multi-hot", "mlperf", "--emb-lr", "0.01"]  # MLPerf's bags, 214 ids a sample
#: the runs profiled (`--profile`, 10 steps): the trainer issue's GPU busy and where the
#: step's time goes, per stage, `none` and `hybrid`, fixed-size and id-aware traffic
PROFILED = ("none_fixed", "hybrid_fixed", "none", "hybrid")
#: seconds a run needs at least (start, 40 steps, its evaluation); none starts with less left
RUN_S = 20


def runs() -> list[tuple[str, list[str]]]:
    """(name, flags beside the common ones), the most wanted first."""
    table: list[tuple[str, list[str]]] = []
    for graph in ([], ["--cuda-graph"]):
        for codec in ("none", "hybrid"):
            table.append((f"{codec}_fixed" + "_graph" * bool(graph), [codec, *FIXED, *graph]))
    table += [("none", ["none"]), ("hybrid", ["hybrid"])]
    table += [
        ("hybrid_compile", ["hybrid", "--compile"]),
        ("none_bf16", ["none", "--dense-dtype", "bf16"]),
        ("hybrid_bf16", ["hybrid", "--dense-dtype", "bf16"]),
        ("none_multi_hot", ["none", *MULTI_HOT]),
        ("hybrid_multi_hot", ["hybrid", *MULTI_HOT]),
        ("hybrid_multi_hot_mlperf_draws", ["hybrid", *MULTI_HOT, "--multi-hot-draws", "mlperf"]),
        ("none_dcn", ["none", "--interaction", "dcn"]),
        ("hybrid_dcn", ["hybrid", "--interaction", "dcn"]),
        ("hybrid_compress_auto", ["hybrid", "--compress", "auto"]),
        ("hybrid_table_fp16", ["hybrid", "--table-dtype", "fp16"]),
        ("hybrid_column_shards_4", ["hybrid", "--column-shards", "4"]),
    ]
    # one evaluation of 2^20 held-out samples at two evaluation batches (4096 was the
    # CPU's fastest; a GPU pays its launches a batch)
    table += [(f"eval_batch_{b}", ["none", "--eval-batch-size", str(b)]) for b in (4096, 65536)]
    return table


def flags(name: str, rest: list[str], out: Path, dry: bool) -> list[str]:
    """The whole command line of one run."""
    codec, extra = rest[0], rest[1:]
    steps = 1 if name.startswith("eval_") else 100 if "fixed" in name else 40
    n_eval = 1 << 20 if name in ("none", "hybrid") or name.startswith("eval_") else 8192
    common = ["--device", "cuda", "--preset", "bench", "--batch-size", "8192"]
    if dry:  # the driver's own logic on the CPU, tiny
        common = ["--device", "cpu", "--preset", "tiny", "--batch-size", "256"]
        steps, n_eval = min(steps, 4), 512
        extra = [e if e != "65536" else "512" for e in extra]
    return [*common, "--steps", str(steps), "--fwd-codec", codec, "--bwd-codec", codec,
            "--eb-policy", "dual", "--synthetic-eval", str(n_eval), "--no-progress",
            "--out", str(out / name), *extra,
            *(["--profile", "10" if not dry else "1"] if name in PROFILED else [])]  # fmt: skip


def cuda_broken() -> bool:
    """Whether this process's CUDA context can no longer run anything."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:
        return True
    return False


def done(log: Path) -> set[str]:
    """The runs a log already holds (a restarted process leaves them)."""
    if not log.exists():
        return set()
    return {json.loads(line)["name"] for line in log.read_text().splitlines() if line.strip()}


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """What a run's line keeps of its summary (the per-table rows and the config stay out:
    the flags say the config)."""
    return {k: v for k, v in summary.items() if k not in ("per_table", "config")}


def table(log: Path) -> str:
    """The runs side by side (steady samples/s after the first steps)."""
    lines = []
    for line in log.read_text().splitlines():
        r = json.loads(line)
        s = r.get("summary")
        if s is None:
            why = r.get("skipped") or r.get("error", "")
            lines.append(f"{r['name']:32s} {'-':>10s}            {why[:120]}")
            continue
        lines.append(
            f"{r['name']:32s} {s.get('samples_per_s_steady', float('nan')):>10.0f} samples/s "
            f"replays {s.get('graph_replays', 0):>3} AUC {s.get('auc', float('nan')):.4f} "
            f"eval {s.get('eval_samples', 0)} in {s.get('eval_s', float('nan')):.2f} s "
            f"({r['seconds']:.0f} s)"
        )
        if p := r.get("profile"):  # (profiled: ms a step, the host's and the GPU's)
            stages = ", ".join(f"{k.split(' (')[0]} {v:.2f}/{p.get('gpu_ms', {}).get(k, 0):.2f}"
                               for k, v in p["host_ms"].items())  # fmt: skip
            busy, launches = p.get("gpu_busy", float("nan")), p.get("kernels_per_step", 0)
            lines.append(f"{'':32s} profile: wall {p['wall_ms']:.2f} ms, GPU busy {busy:.2f}, "
                         f"kernels {launches:.0f}; host/GPU ms: {stages}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--deadline", type=float, default=float("inf"), help="time.time() to end by")
    ap.add_argument("--only", help="these runs (names, comma-separated)")
    ap.add_argument("--dry", action="store_true", help="tiny, on the CPU")
    ap.add_argument("--table", action="store_true", help="only print the runs OUT holds")
    runs_dir = Path(tempfile.gettempdir()) / "recsz_gpu"
    why = "the runs' directories (not OUT: a device call returns 8 files)"
    ap.add_argument("--runs", type=Path, default=runs_dir, help=why)
    args = ap.parse_args(argv)
    log = args.out / "train.jsonl"
    if args.table:
        print(table(log) if log.exists() else f"gpu_train: no runs in {args.out}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = runs()
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {n for n, _ in wanted}
        if unknown:
            ap.error(f"no such runs: {sorted(unknown)}; the runs: {[n for n, _ in wanted]}")
        wanted = [r for r in wanted if r[0] in names]
    seen = done(log)
    for name, rest in wanted:
        if name in seen:
            continue
        argv_run = flags(name, rest, args.runs, args.dry)
        entry: dict[str, Any] = {"name": name, "flags": argv_run}
        start = time.time()
        if args.deadline - start < RUN_S:
            entry["skipped"] = f"the check's budget: {args.deadline - start:.0f} s left"
        else:
            try:
                entry["summary"] = row(run(parse_train_args(argv_run)))
                if (prof := args.runs / name / "profile.json").exists():
                    entry["profile"] = json.loads(prof.read_text())["ranks"][0]
            except (Exception, SystemExit) as e:
                entry["error"] = f"{type(e).__name__}: {e}"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        entry["seconds"] = time.time() - start
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print(f"gpu_train: {name} {'ok' if 'summary' in entry else 'not run'} "
              f"in {entry['seconds']:.1f} s", flush=True)  # fmt: skip
        if "error" in entry and cuda_broken():
            print(f"gpu_train: the CUDA context is gone after {name}; restart", flush=True)
            return RESTART
    print(table(log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
