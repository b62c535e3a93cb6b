"""What a checkpoint costs the training loop: written in the background against at once.

    python benchmarks/bench_checkpoint.py [--preset kaggle] [--steps 20] [--every 5]
        [--batch-size 2048] [--repeats 2] [--device cpu|cuda] [--json-out ...]

One process trains ``--steps`` steps of synthetic data on ``--device``, a checkpoint every
``--every`` steps (and a metrics row, where the background write completes). "background":
the GPU's default (the state copied to host memory, a thread writes and digests it); "at
once": the CPU's default, the live state written and digested before training goes on (with
one SHA-256 of the whole file instead of the pieces', what every checkpoint did before).
Per way: the seconds the loop spent in the checkpoint's calls (copy, or write and digest;
then the completion: waiting for the thread, the record), the wall seconds of the run, and
the rank file's size. Then the file's digest both ways: one SHA-256 read through, and the
pieces' on this host's cores. Ways alternate within each repeat. Prints a table and writes
JSON.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

from recsz import checkpoint, checkpointwrite, hostmemory  # noqa: E402
from recsz.train import main as train  # noqa: E402

WAYS = ("background", "at once")


def one_run(way: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train with checkpoints ``way``; the loop's seconds inside the saver's calls."""
    spent = {"save": 0.0, "complete": 0.0}
    saver = checkpointwrite.Saver
    real = {name: getattr(saver, name) for name in spent}

    def timed(name: str) -> Any:
        def call(self: Any, *a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real[name](self, *a)
            finally:
                spent[name] += time.perf_counter() - t0

        return call

    available, default = hostmemory.available, checkpointwrite.in_background
    try:
        for name in spent:
            setattr(saver, name, timed(name))
        checkpointwrite.in_background = lambda device: way == "background"
        hostmemory.available = lambda: 1 << 50  # (the copy fits)
        t0 = time.perf_counter()
        every = str(args.every)
        train(["--device", args.device, "--preset", args.preset, "--steps", str(args.steps),
               "--batch-size",
               str(args.batch_size), "--checkpoint-every", every, "--log-every", every,
               "--synthetic-eval", "4096", "--no-progress", "--out", str(out)])  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        for name, f in real.items():
            setattr(saver, name, f)
        hostmemory.available, checkpointwrite.in_background = available, default
    f = checkpoint.complete(out)[-1] / "rank-0.pt"
    n = args.steps // args.every
    return {"way": way, "checkpoints": n, "file_gb": f.stat().st_size / 1e9, "wall_s": wall,
            "stall_s": (spent["save"] + spent["complete"]) / n, "save_s": spent["save"] / n,
            "complete_s": spent["complete"] / n, "file": f}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json-out", default=str(HERE / "results" / "checkpoint.json"))
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for way in WAYS:
                out = Path(tmp) / f"{way.replace(' ', '_')}-{rep}"
                row = one_run(way, args, out)
                f = row.pop("file")
                t0 = time.perf_counter()
                checkpoint.digest(f, None)
                one = time.perf_counter() - t0
                t0 = time.perf_counter()
                checkpoint.digest(f)
                row.update(repeat=rep, digest_one_s=one, digest_pieces_s=time.perf_counter() - t0)
                rows.append(row)
                shutil.rmtree(out)
    lines = ["| way | repeat | file GB | loop's seconds a checkpoint (copy or write / "
             "completion) | run's wall s | digest: one SHA-256 / pieces (s) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['way']} | {r['repeat']} | {r['file_gb']:.2f} | {r['stall_s']:.2f} "
            f"({r['save_s']:.2f} / {r['complete_s']:.2f}) | {r['wall_s']:.1f} | "
            f"{r['digest_one_s']:.2f} / {r['digest_pieces_s']:.2f} |"
        )
    head = (f"{args.preset} preset, {args.steps} steps of {args.batch_size}, a checkpoint "
            f"and a metrics row every {args.every}\n\n")  # fmt: skip
    write_results(rows, args.json_out, head + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
