"""One training step, taken apart: where the time goes, per stage, and the one-process
speed and accuracy against the reference DLRM's published settings.

    python benchmarks/bench_step.py [--json-out PATH] [--steps N]

(a) ``tiny`` preset, one process, codec ``none``, batch 32, one pass of plain SGD at lr 0.1
    over the real 10k Criteo sample (the setting the reference DLRM, facebookresearch/dlrm
    ``dlrm_s_pytorch.py``, was measured at: 0.53-0.72 s for its 249 steps, mean AUC 0.678
    over 3 seeds), 3 seeds: seconds in the training loop and AUC.
(b) ``bench`` preset (Terabyte dims), one process, batch 2048: the torch profiler's CPU time
    per stage (lookup, exchange encode / decode, table update, the rest of forward and
    backward, the dense optimizer), averaged over the profiled steps; with the MLPs in
    float32 and in bfloat16 (``--dense-dtype bf16``), and on MLPerf's multi-hot bags
    (``--multi-hot mlperf --emb-lr 0.01``), side by side; freed host memory kept as the
    trainer keeps it; the steps timed once more without the profiler.
(c) One process, codec ``none``, the step with the trainer's traffic (fixed-size: nothing
    leaves a lone rank) against id-aware traffic (what it took before the fifty-eighth
    session), alternated: ``tiny`` at batch 32 and 2048, ``bench`` at 2048.
Prints the tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from recsz import profiling
from recsz.config import parse_train_args
from recsz.data.source import make_source
from recsz.model import get_preset
from recsz.ranks import Ranks, keep_freed_memory
from recsz.step import build_parts, train_step
from recsz.train import main as train_main

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REAL = SHARED / "criteo_kaggle_head10k.tsv"


def one_process(seeds: list[int]) -> list[dict]:
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as out:
            argv = [
                "--preset", "tiny", "--data", str(REAL), "--batch-size", "32",
                "--emb-optimizer", "sgd", "--emb-lr", "0.1", "--lr", "0.1",
                "--seed", str(seed), "--no-progress", "--out", out,
            ]  # fmt: skip
            t = time.perf_counter()
            train_main(argv)
            wall = time.perf_counter() - t
            s = json.loads((Path(out) / "summary.json").read_text())
        rows.append(
            {
                "seed": seed,
                "steps": s["steps"],
                "train_s": s["train_s"],
                "train_plus_data_s": s["train_s"] + s["data_s"],
                "process_s": wall,
                "auc": s["auc"],
            }
        )
    return rows


def stages(steps: int, dense_dtype: str = "fp32", flags: tuple[str, ...] = ()) -> dict[str, float]:
    """Milliseconds per step of each stage, one process, bench preset."""
    argv = ["--preset", "bench", "--prefetch", "0", "--dense-dtype", dense_dtype, *flags]
    cfg = parse_train_args(argv)
    ranks = Ranks.from_env(60.0, "cpu")
    parts, _ = build_parts(cfg, ranks)
    src = make_source("synthetic", get_preset("bench").model.table_sizes, 0)
    bsz = cfg.resolved("batch_size")
    batches = [src.train_batch(s, bsz) for s in range(steps + 3)]  # the same steps twice
    for s in range(3):
        train_step(parts, batches[s], s, ranks)
    t = time.perf_counter()
    for s in range(3, steps + 3):  # the wall clock, without the profiler's own work
        train_step(parts, batches[s], s, ranks)
    bare_ms = (time.perf_counter() - t) / steps * 1e3
    t = time.perf_counter()
    profiling.quiet_kineto()  # (as recsz train --profile)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(3, steps + 3):
            train_step(parts, batches[s], s, ranks)
    got = profiling.summarize(prof, steps, time.perf_counter() - t, 3)  # (recsz --profile's)
    out = {k: v for k, v in got["host_ms"].items() if k != "data wait"}  # (batches made)
    out["step (profiled)"] = got["wall_ms"]
    out["step without the profiler"] = bare_ms
    ranks.close(True)
    return out


def lone_rank(preset: str, bsz: int, reps: int, steps: int = 6) -> dict[str, list[float]]:
    """Milliseconds a step of one process with ``none`` both ways: the trainer's traffic
    (fixed-size: nothing leaves a lone rank, since the fifty-eighth session) against the
    id-aware traffic it took before (the same parts, their exchange switched back),
    alternated ``reps`` times, each over ``steps`` steps after 2."""
    cfg = parse_train_args(["--preset", preset, "--prefetch", "0", "--batch-size", str(bsz)])
    ranks = Ranks.from_env(60.0, "cpu")
    ways = {"fixed-size": build_parts(cfg, ranks)[0], "id-aware": build_parts(cfg, ranks)[0]}
    ex = ways["id-aware"].exchange
    assert not ex.id_dedup, "a lone rank's `none` takes fixed-size traffic"
    ex.id_dedup = ex.coalesce = True  # (as build_parts made it before)
    ex.sparse_grad = ways["id-aware"].sparse.takes_sparse_grad
    src = make_source("synthetic", get_preset(preset).model.table_sizes, 0)
    batches = [src.train_batch(s, bsz) for s in range(steps + 2)]
    ms: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(reps):
        for way, parts in ways.items():
            for s in range(2):
                train_step(parts, batches[s], s, ranks)
            t = time.perf_counter()
            for s in range(2, steps + 2):
                train_step(parts, batches[s], s, ranks)
            ms[way].append((time.perf_counter() - t) / steps * 1e3)
    ranks.close(True)
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default="bench_out/step.json")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps of (b)")
    ap.add_argument("--reps", type=int, default=5, help="alternations of (c)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of a torchrun job here
    keep_freed_memory()  # as the trainer does (--host-memory keep)
    result: dict = {"threads": 1}
    if REAL.exists():
        rows = one_process([0, 1, 2])
        result["one_process_tiny"] = rows
        print("\n(a) tiny, 1 process, codec none, batch 32, SGD lr 0.1, real 10k sample")
        print("| seed | steps | train s | train + data s | AUC |\n|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['seed']} | {r['steps']} | {r['train_s']:.2f} | "
                f"{r['train_plus_data_s']:.2f} | {r['auc']:.4f} |"
            )
        aucs = [r["auc"] for r in rows]
        print(f"mean AUC {statistics.mean(aucs):.4f} (reference DLRM: 0.678, 0.53-0.72 s)")
    else:
        print(f"[skip] (a): {REAL} not found", file=sys.stderr)
    st, bf = stages(a.steps), stages(a.steps, "bf16")
    mh = stages(a.steps, "fp32", ("--multi-hot", "mlperf", "--emb-lr", "0.01"))
    result["stages_ms_bench_1proc"] = st
    result["stages_ms_bench_1proc_bf16"] = bf
    result["stages_ms_bench_1proc_multihot"] = mh
    print("\n(b) bench preset, 1 process, batch 2048: CPU ms per step, MLPs in fp32 / bf16; "
          "fp32 on MLPerf's multi-hot bags")  # fmt: skip
    print("| stage | fp32 ms | share | bf16 ms | share | bags ms | share |")
    print("|---|---|---|---|---|---|---|")
    for k in st:
        cells = [f"{d[k]:.1f} | {d[k] / d['step (profiled)']:.0%}" for d in (st, bf, mh)]
        print(f"| {k} | {' | '.join(cells)} |")
    print("\n(c) one process, codec none: ms a step, fixed-size traffic (the trainer's now) "
          "against id-aware (before), alternated")  # fmt: skip
    print("| preset, batch | fixed-size | id-aware | id-aware / fixed |\n|---|---|---|---|")
    result["lone_rank_ms"] = []
    for preset, bsz in (("tiny", 32), ("tiny", 2048), ("bench", 2048)):
        ms = lone_rank(preset, bsz, a.reps)
        fixed, ids = statistics.median(ms["fixed-size"]), statistics.median(ms["id-aware"])
        result["lone_rank_ms"].append({"preset": preset, "batch": bsz, **ms})
        print(f"| {preset}, {bsz} | {fixed:.2f} | {ids:.2f} | {ids / fixed:.2f}x |")
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
