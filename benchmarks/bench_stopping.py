"""What stopping on SIGTERM costs a run, and how long a preempted job takes to stop.

    python benchmarks/bench_stopping.py [--presets tiny,bench] [--calls N] [--no-held]
        [--json-out PATH]

1. Every step of a run with a directory, the ranks agree on whether any was sent SIGTERM
   (``recsz.stopping.Stopping.agreed``: an all-reduce started after the step and read
   after the next). Timed here on 2 gloo ranks with a 2 ms "step" between calls: the host
   time of each call (median and 90th percentile), the cost a step pays.
2. A 2-rank job of each preset (``recsz train --nproc 2 --preset P --out DIR``) sent SIGTERM
   once training runs: the seconds until the launcher has exited (the step under way, the
   agreement, the checkpoint written, the ranks gone), against the 30 s torchrun's agent
   waits before it kills its workers; the checkpoint's size; and the seconds the same
   command line then takes to go on from it (``--steps`` one more step).
3. A 2-rank ``tiny`` job whose rank 1 is stopped (SIGSTOP: a peer that neither answers nor
   closes its connection, as a host off the network) and then sent SIGTERM: the seconds until
   rank 0, held in a collective, has exited (``recsz.stopping.STUCK_S`` after the signal;
   before its watcher, torchrun's SIGKILL 30 s after it).
4. A 2-rank ``tiny`` job sent SIGTERM as its evaluation at step 3 (of 6, 400,000 held-out
   samples, no checkpoint there) begins: the seconds until it has exited, the step it saved,
   and how long that evaluation takes whole (the same command line again, which evaluates it
   first). ``--src`` runs the jobs from another revision's tree, for a before and after.

Prints a table and writes JSON (default benchmarks/results/stopping.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import write_results

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def _agree_worker(rank: int, port: int, calls: int, out: str) -> None:
    import torch.distributed as dist

    from recsz.stopping import Stopping

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    stop, spent = Stopping(2), []
    for _ in range(calls):
        time.sleep(0.002)  # a step
        t0 = time.perf_counter()
        stop.agreed()
        spent.append(time.perf_counter() - t0)
    stop.close(ok=True)
    dist.destroy_process_group()
    if rank == 0:
        spent.sort()
        Path(out).write_text(json.dumps({"median_us": spent[len(spent) // 2] * 1e6,
                                         "p90_us": spent[len(spent) * 9 // 10] * 1e6}))  # fmt: skip


def agreement_row(calls: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = str(Path(tmp) / "agree.json")
        sys.path[:0] = [str(HERE), str(SRC)]  # where the spawned ranks find this module
        try:
            mp.start_processes(_agree_worker, args=(port, calls, out), nprocs=2,
                               start_method="spawn")  # fmt: skip
        finally:
            del sys.path[:2]
        got = json.loads(Path(out).read_text())
    return {"part": "agreement", "calls": calls, **got}


def _training(
    preset: str, out: Path, steps: int = 1000000, rows: int = 1, *flags: str
) -> tuple[subprocess.Popen, list[str], dict]:
    """A 2-rank job of ``preset`` started, once its first ``rows`` metrics rows are written;
    its command line but for ``--steps``, and its environment."""
    flags = ("--preset", preset, "--nproc", "2", "--log-every", "1", "--no-progress",
             "--synthetic-eval", "4096", *flags, "--out", str(out))  # fmt: skip
    cmd = [sys.executable, "-m", "recsz.cli", "train", *flags]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    job = subprocess.Popen([*cmd, "--steps", str(steps)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    log = out / "metrics.jsonl"
    while job.poll() is None and not (log.exists() and len(log.read_bytes().splitlines()) >= rows):
        time.sleep(0.01)
    return job, cmd, env


def _stopped(job: subprocess.Popen, out: Path) -> tuple[float, dict]:
    """SIGTERM to a job writing ``out``: the seconds until it has exited (with SIGTERM's
    status, else an error) and the record of the checkpoint it wrote."""
    t0 = time.perf_counter()
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=600)
    stop_s = time.perf_counter() - t0
    if job.returncode != 128 + signal.SIGTERM:
        raise RuntimeError(f"{out.name}: the job ended with {job.returncode}: {err[-1500:]}")
    return stop_s, json.loads(next((out / "checkpoints").glob("*/meta.json")).read_text())


def preempted_row(preset: str, work: Path) -> dict:
    """A 2-rank job of ``preset`` sent SIGTERM once its first metrics row is written."""
    out = work / preset
    job, cmd, env = _training(preset, out)
    stop_s, meta = _stopped(job, out)
    ckpt = out / "checkpoints" / f"step-{meta['step']:09d}"
    t0 = time.perf_counter()  # the same command line again, one step further
    subprocess.run([*cmd, "--steps", str(meta["step"] + 1)], env=env, check=True,
                   capture_output=True)  # fmt: skip
    return {"part": "preempted", "preset": preset, "stopped_at_step": meta["step"],
            "stop_s": stop_s, "checkpoint_gb": sum(f.stat().st_size for f in
                                                   ckpt.iterdir()) / 1e9,
            "go_on_s": time.perf_counter() - t0}  # fmt: skip


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of a launched job's ranks: its agent's children, by their RANK."""
    parent = {}
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    agents = {p for p, pp in parent.items() if pp == launcher}
    ranks = {}
    for pid in (p for p, pp in parent.items() if pp in agents):
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        ranks.update({int(e[5:]): pid for e in env if e.startswith(b"RANK=")})
    return ranks


def _running(pid: int) -> bool:
    try:  # a zombie has exited
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def held_row(work: Path) -> dict:
    """A ``tiny`` job's rank 1 stopped, then SIGTERM: how long rank 0 lives on."""
    from recsz.stopping import STUCK_S

    job, _, _ = _training("tiny", work / "held")
    ranks = _workers(job.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    time.sleep(1.0)  # rank 0 waits on it in a collective
    t0 = time.perf_counter()
    job.send_signal(signal.SIGTERM)
    while _running(ranks[0]) and time.perf_counter() - t0 < 120:
        time.sleep(0.05)
    exit_s = time.perf_counter() - t0
    os.kill(ranks[1], signal.SIGKILL)  # (torchrun's agent would, 30 s after its SIGTERM)
    job.communicate(timeout=120)
    return {"part": "held", "preset": "tiny", "exit_s": exit_s, "stuck_s": STUCK_S}


def evaluating_row(work: Path) -> dict:
    """A ``tiny`` job sent SIGTERM as its evaluation at step 3 begins (step 2's row written:
    step 3 takes milliseconds, the evaluation seconds)."""
    out = work / "evaluating"
    job, cmd, env = _training("tiny", out, 6, 2, "--eval-every", "3", "--synthetic-eval",
                              "400000")  # fmt: skip
    stop_s, meta = _stopped(job, out)
    subprocess.run([*cmd, "--steps", "6"], env=env, check=True, capture_output=True)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    whole = next(r["eval_s"] for r in rows if r["step"] == 3 and "eval_s" in r)
    return {"part": "evaluating", "preset": "tiny", "stopped_at_step": meta["step"],
            "stop_s": stop_s, "eval_s": whole, "src": str(SRC)}  # fmt: skip


def table(rows: list[dict]) -> str:
    out = ["| what | measured |", "|---|---|"]
    for r in rows:
        if r["part"] == "agreement":
            us = f"median {r['median_us']:.0f} us, 90th percentile {r['p90_us']:.0f} us"
            out.append(f"| a step's agreement (2 gloo ranks, {r['calls']} calls) | {us} |")
        elif r["part"] == "evaluating":
            out.append(f"| `tiny`, 2 ranks, SIGTERM as its evaluation at step 3 begins (400,000 "
                       f"samples, {r['eval_s']:.1f} s whole) | stopped at step "
                       f"{r['stopped_at_step']} in {r['stop_s']:.1f} s |")  # fmt: skip
        elif r["part"] == "held":
            out.append(f"| `tiny`, 2 ranks, rank 1 stopped (SIGSTOP), then SIGTERM | rank 0, held "
                       f"in a collective, gone in {r['exit_s']:.1f} s (STUCK_S "
                       f"{r['stuck_s']:.0f} s; torchrun's SIGKILL: 30 s) |")  # fmt: skip
        else:
            out.append(f"| `{r['preset']}`, 2 ranks, SIGTERM at step {r['stopped_at_step']} | "
                       f"stopped, {r['checkpoint_gb']:.3f} GB checkpoint written, in "
                       f"{r['stop_s']:.1f} s (torchrun's grace: 30 s); the command again "
                       f"went on and ended a step later in {r['go_on_s']:.1f} s |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    global SRC
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,bench")
    ap.add_argument("--calls", type=int, default=2000, help="agreements timed")
    ap.add_argument("--held", action=argparse.BooleanOptionalAction, default=True,
                    help="a job whose rank 1 is stopped, then sent SIGTERM")  # fmt: skip
    ap.add_argument("--evaluating", action=argparse.BooleanOptionalAction, default=True,
                    help="a job sent SIGTERM as an evaluation begins")  # fmt: skip
    ap.add_argument("--src", default=str(SRC), help="the recsz source tree the jobs run")
    ap.add_argument("--json-out", default=str(HERE / "results" / "stopping.json"))
    a = ap.parse_args(argv)
    SRC = Path(a.src)
    rows = [agreement_row(a.calls)]
    print(json.dumps(rows[-1]))
    with tempfile.TemporaryDirectory() as work:
        for preset in [p for p in a.presets.split(",") if p]:
            rows.append(preempted_row(preset, Path(work)))
            print(json.dumps(rows[-1]))
        if a.held:
            rows.append(held_row(Path(work)))
            print(json.dumps(rows[-1]))
        if a.evaluating:
            rows.append(evaluating_row(Path(work)))
            print(json.dumps(rows[-1]))
    write_results(rows, a.json_out, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
