"""Loading a checkpoint: the host memory a rank takes to restore its parts, and the seconds,
with this checkout's code and another revision's, side by side.

    python benchmarks/bench_load.py [--old DIR] [--flags "--preset bench --emb-optimizer adagrad"]
        [--repeats 3] [--json-out PATH]

A run of ``--flags`` trains 2 steps on one process and keeps its checkpoint. Then, each in a
process of its own, the trees taken in turn: its parts are built (for training, as
``--resume`` builds them; to score, as ``recsz evaluate`` does: the old tree builds them for
training) and the checkpoint loaded into them (``recsz.checkpoint.load``). Measured: the
load's seconds, and the peak of the process's anonymous memory (``RssAnon``, sampled every
millisecond) above what it held before the load, and its peak resident memory (``VmHWM``:
also the file's pages it read, which the system may drop); trained with ``--device cuda``,
also the GPU memory the load took above the model's (``torch.cuda.max_memory_allocated``).
Before the forty-second session a rank's file was read whole onto its device (a GPU's memory
for a CUDA run) beside the parts it is copied into; now it is memory-mapped, read as used.
Prints a table and writes JSON (default benchmarks/results/load.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from results_io import write_results

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def _status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def load_child(run: str, way: str) -> dict:
    """This process: the run's parts built (``way``: train or score) and its checkpoint
    loaded, timed, its anonymous memory sampled."""
    import inspect
    from dataclasses import replace

    import torch

    from recsz import checkpoint
    from recsz.config import TrainConfig
    from recsz.ranks import Ranks
    from recsz.step import build_parts

    d, meta = checkpoint.record(Path(run))  # type: ignore[misc]
    cfg = replace(TrainConfig.from_dict(meta["config"]), out=None, progress=False)
    ranks = Ranks.from_env(60.0, cfg.device)
    scores = "train" in inspect.signature(build_parts).parameters and way == "score"
    parts, _ = build_parts(cfg, ranks, train=False) if scores else build_parts(cfg, ranks)
    gpu = ranks.device.type == "cuda"
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    on_gpu = torch.cuda.memory_allocated() if gpu else 0
    before, peak, done = _status("RssAnon"), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.001)

    watcher = threading.Thread(target=sample)
    watcher.start()
    t = time.perf_counter()
    checkpoint.load(d, parts, cfg, ranks)
    if gpu:
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    done.set()
    watcher.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    gpu_gb = (torch.cuda.max_memory_allocated() - on_gpu) / 1e9 if gpu else None
    return {"s": s, "anon_gb": (peak[0] - before) / 1e9, "hwm_gb": _status("VmHWM") / 1e9,
            "file_gb": (d / "rank-0.pt").stat().st_size / 1e9, "gpu_gb": gpu_gb,
            "device": torch.cuda.get_device_name() if gpu else "cpu"}  # fmt: skip


def rows_for(old: str | None, flags: list[str], repeats: int, work: Path) -> list[dict]:
    run = work / "run"
    train = ["train", "--steps", "2", "--batch-size", "256", "--synthetic-eval", "256",
             "--checkpoint-every", "2", "--no-progress", "--out", str(run), *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "recsz.cli", *train], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"training the run to load failed: {done.stderr[-1500:]}")
    trees = {"new": SRC} | ({"old": Path(old) / "src"} if old else {})
    rows = []
    for way in ("train", "score"):
        got: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(repeats):  # the trees in turn: the machine's drift hits both
            for name, src in trees.items():
                env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
                cmd = [sys.executable, __file__, "--child", str(run), way]
                out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
                got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        first = got["new"][0]
        row: dict = {"way": way, "flags": " ".join(flags), "file_gb": first["file_gb"],
                     "device": first["device"]}  # fmt: skip
        for name, g in got.items():
            row[f"{name}_s"] = statistics.median(x["s"] for x in g)
            row[f"{name}_anon_gb"] = max(x["anon_gb"] for x in g)
            row[f"{name}_hwm_gb"] = max(x["hwm_gb"] for x in g)
            if first["gpu_gb"] is not None:  # the GPU memory the load took above the model
                row[f"{name}_gpu_gb"] = max(x["gpu_gb"] for x in g)
        rows.append(row)
        print(json.dumps(row))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| parts | model trained with | rank's file | before: s, anonymous peak, resident peak "
           "| now: s, anonymous peak, resident peak |", "|---|---|---|---|---|"]  # fmt: skip

    def cell(r: dict, name: str) -> str:
        if f"{name}_s" not in r:
            return "-"
        gpu = f", GPU +{r[f'{name}_gpu_gb']:.2f} GB" if f"{name}_gpu_gb" in r else ""
        return (
            f"{r[f'{name}_s']:.2f} s, {r[f'{name}_anon_gb']:.2f} GB, {r[f'{name}_hwm_gb']:.2f} GB"
            f"{gpu}"
        )

    for r in rows:
        out.append(f"| {r['way']} | `{r['flags'] or '(tiny)'}` ({r['device']}) | "
                   f"{r['file_gb']:.2f} GB | {cell(r, 'old')} | {cell(r, 'new')} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="a checkout of another revision, timed beside this one")
    ap.add_argument("--flags", default="", help="the run's training flags ('': tiny's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=str(HERE / "results" / "load.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(load_child(*a.child)))
        return 0
    with tempfile.TemporaryDirectory() as work:
        rows = rows_for(a.old, a.flags.split(), a.repeats, Path(work))
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
