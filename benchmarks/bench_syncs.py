"""Host reads a training step makes on a GPU, counted on the CPU: how often a GPU rank
waits for its host (each read drains the GPU's queue; a step without any can run ahead
and be replayed as a CUDA graph).

    python benchmarks/bench_syncs.py [--json-out PATH] [--worlds 1,2,4]

The GPU's code path runs on the CPU (``RECSZ_DEVICE_PATH_ON_CPU=1``, Triton's interpreter)
with :mod:`tests.hostreads` counting, per rank and step, the value reads and value-sized
outputs of tensors that would live on the GPU (gloo ranks on this machine; ``tiny``
preset, global batch 64, dual bounds both ways outside their probe window), and the
launches a step (torch operations that would launch GPU work, Triton kernels, uploads: each
some microseconds of host time on a GPU, whose sum bounds how busy a host-bound GPU can
be). Rows: the trainer's default id-aware traffic and fixed-size traffic (``--no-id-dedup
--no-bwd-coalesce``), each with the hybrid codec and with ``none``; id-aware traffic
with its distinct ids found slice by slice (how the exchange did it before one pass did
every slice); and hybrid with the MLP gradients' eb hook (``--dp-comm eb``, world > 1).
And the format-3 coder's plans made a step (each host work, an upload and a launch: made
where the shapes or, decoding, the layouts change). Counts are exact and
machine-independent; no time is measured.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import socket
import statistics
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_io import write_results  # noqa: E402

WARM, STEPS = 3, 3  # steps before counting (kernels built, constants uploaded), counted
#: --quick (the tests): a probe window of one step, then 2 steps before counting and 1 counted
QUICK = (["--hindex-probe-steps", "1"], 2, 1)

CASES = {  # name -> (argv, distinct ids slice by slice)
    "hybrid, id-aware": (["--fwd-codec", "hybrid", "--bwd-codec", "hybrid"], False),
    "hybrid, id-aware, slice by slice": (["--fwd-codec", "hybrid", "--bwd-codec", "hybrid"], True),
    "none, id-aware": ([], False),
    "hybrid, fixed-size": (
        ["--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--no-id-dedup", "--no-bwd-coalesce"],
        False,
    ),
    "none, fixed-size": (["--no-id-dedup", "--no-bwd-coalesce"], False),
    "none, id-aware, TT tables": (["--tt-tables", "3"], False),  # TT-Rec's 3 largest
    "none, id-aware, TT tables, bags": (["--tt-tables", "3", "--multi-hot", "2"], False),
    "none, id-aware, TT tables, caches": (["--tt-tables", "3", "--tt-cache-rows", "64"], False),
    "none, id-aware, TT tables, caches filled every step": (
        ["--tt-tables", "3", "--tt-cache-rows", "64", "--tt-cache-interval", "1"], False),
    "hybrid, fixed-size, eb hook": (  # the MLP gradients error-bounded too (--dp-comm eb)
        ["--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--no-id-dedup", "--no-bwd-coalesce",
         "--dp-comm", "eb"],
        False,
    ),
}  # fmt: skip


def rank_main(rank: int, world: int, port: int, case: str, quick: bool, out: Any) -> None:
    """One rank's counts, put on ``out``: (rank, reads a step, uploads a step, where,
    launches a step, the most frequent launches, plans made a step)."""
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from recsz.comm import ids

    at_once = ids.distinct_slices
    if CASES[case][1]:  # slice by slice
        ids.distinct_slices = lambda cols: [ids.distinct_pairs(c) for c in cols]
    try:
        argv, warm, steps = QUICK if quick else ([], WARM, STEPS)
        out.put((rank, *_counted([*CASES[case][0], *argv], warm, steps)))
    finally:
        ids.distinct_slices = at_once


def _counted(
    argv: list[str], warm: int, steps: int
) -> tuple[float, float, str, float, dict[str, float], float]:
    from recsz.codecs import blockplan
    from recsz.config import parse_train_args
    from recsz.data.source import make_source
    from recsz.model import get_preset
    from recsz.ranks import Ranks
    from recsz.step import build_parts, train_step
    from tests.hostreads import counting, mark

    cfg = parse_train_args(["--preset", "tiny", "--eb-policy", "dual", *argv])
    ranks = Ranks.from_env(120.0)
    parts = build_parts(cfg, ranks)[0]
    src = make_source("synthetic", get_preset("tiny").model.table_sizes, 0)
    state = [*parts.sparse.state_dict().values(), *parts.dense.state_dict().values()]
    state += [*parts.sparse.parameters(), *parts.dense.parameters()]
    reads, uploads, where, launches, plans = [], [], "", [], []
    kinds: collections.Counter[str] = collections.Counter()
    first = cfg.hindex_probe_steps + 1  # after the probe window and its classification
    built = [0]  # the format-3 coder's plans made (host work, an upload, a launch each)
    build = blockplan.build
    blockplan.build = lambda *a, **kw: built.__setitem__(0, built[0] + 1) or build(*a, **kw)
    with counting(state) as c:
        for k in range(first + warm + steps):
            b = src.train_batch(k, 64)
            mark([b.dense, b.ids, b.labels])
            built[0] = 0
            train_step(parts, b, k, ranks)
            made = collections.Counter(c.launches)
            n, up, at = c.take()
            if k >= first + warm:
                reads.append(n)
                uploads.append(up)
                where = at
                launches.append(sum(made.values()))
                kinds.update(made)
                plans.append(built[0])
    blockplan.build = build
    ranks.close(True)
    top = {name: n / steps for name, n in kinds.most_common(12)}
    mean = statistics.mean
    return mean(reads), mean(uploads), where, mean(launches), top, mean(plans)


def count(world: int, case: str, quick: bool = False) -> dict:
    """The most reads and uploads a step of any rank (world 1: in this process)."""
    if world == 1:
        q: Any = queue.SimpleQueue()
        rank_main(0, 1, 0, case, quick, q)
        per_rank = [q.get()]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = mp.get_context("spawn").Queue()
        mp.start_processes(
            rank_main, (world, port, case, quick, q), nprocs=world, start_method="spawn"
        )
        per_rank = sorted(q.get() for _ in range(world))
    return {
        "case": case,
        "world": world,
        "reads_per_step": max(p[1] for p in per_rank),
        "uploads_per_step": max(p[2] for p in per_rank),
        "where_rank0": per_rank[0][3],
        "launches_per_step": max(p[4] for p in per_rank),
        "top_launches_rank0": per_rank[0][5],
        "plans_per_step": max(p[6] for p in per_rank),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/syncs.json"))
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--cases", default=";".join(CASES), help=f"';'-separated, of {list(CASES)}")
    ap.add_argument("--quick", action="store_true", help="a probe window of 1 step, 3 steps")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
        raise SystemExit("bench_syncs: set TRITON_INTERPRET=1 before Triton is imported")
    worlds = [int(w) for w in args.worlds.split(",")]
    cases = [c.strip() for c in args.cases.split(";")]
    if unknown := [c for c in cases if c not in CASES]:
        raise SystemExit(f"bench_syncs: unknown cases {unknown}; known: {list(CASES)}")
    # the GPU's path for these counts only: a caller's environment is left as it was
    with mock.patch.dict(os.environ, RECSZ_DEVICE_PATH_ON_CPU="1", TRITON_INTERPRET="1"):
        rows = [count(w, case, args.quick) for case in cases for w in worlds]
    head = "| traffic | " + " | ".join(f"world {w}" for w in worlds) + " |"
    lines = [head, "|---" * (len(worlds) + 1) + "|"]
    for case in cases:
        got = {r["world"]: r for r in rows if r["case"] == case}
        cells = [
            f"{got[w]['reads_per_step']:g} / {got[w]['launches_per_step']:g} / "
            f"{got[w]['plans_per_step']:g}"
            for w in worlds
        ]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    table = (
        "Host reads / launches (torch operations that launch GPU work, Triton kernels, "
        "uploads) / format-3 plans made (host work and an upload each) per step and rank "
        "(the most of any rank), GPU path on the CPU\n\n"
    )
    write_results(rows, args.json_out, table + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
