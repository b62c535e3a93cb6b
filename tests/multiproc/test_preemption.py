"""A job asked to stop (SIGTERM to `recsz train --nproc 2`, as a scheduler preempting it):
its ranks agree on a step, save a checkpoint there and exit with SIGTERM's status; the job's
command line again (a requeued job) goes on from there, and ends as one never stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recsz import checkpoint
from recsz.ranks import SEPARATE_STORES
from tests.multiproc.spawned import spawned
from tests.multiproc.test_orphans import start_job

pytestmark = pytest.mark.slow


def test_sigterm_saves_a_checkpoint_the_run_resumes_from(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher, _agent, _workers = start_job(run)
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, out[-2000:]
    said = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(said) == 1, out[-2000:]  # rank 0 says it once
    saved = checkpoint.complete(run)
    assert len(saved) == 1, saved  # complete: both ranks' files, one step
    meta = json.loads((saved[0] / "meta.json").read_text())
    step = meta["step"]
    assert f"step {step} " in said[0] and sorted(meta["files"]) == ["rank-0.pt", "rank-1.pt"]
    assert not (run / "summary.json").exists()  # not finished
    assert meta["config"]["nproc"] == 2  # the launched ranks recorded (`--resume RUN`'s)

    def train(*flags: str) -> dict:
        cmd = [sys.executable, "-m", "recsz.cli", "train", "--no-progress", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads((Path(flags[flags.index("--out") + 1]) / "summary.json").read_text())

    end = str(step + 3)
    job = ["--nproc", "2", "--batch-size", "64", "--synthetic-eval", "256", "--log-every",
           "100000"]  # fmt: skip
    # the job's command line again, as a scheduler requeues it (but for its steps)
    resumed = train(*job, "--steps", end, "--dist-timeout", "30", "--out", str(run))
    straight = train(*job, "--steps", end, "--out", str(tmp_path / "straight"))
    assert resumed["steps"] == straight["steps"] == step + 3
    for key in ("world_size", "auc", "logloss", "bytes_payload", "bytes_sent"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6), key


#: the step after which each of 3 ranks is sent SIGTERM (None: never), in turn
SKEWS = [(4, 4, 4), (2, 7, None), (None, None, 5), (0, 9, 3), (None, None, None)]


def skewed_worker(rank: int, store: str, out: str) -> None:
    from recsz.stopping import Stopping

    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
    try:
        stops = []
        for skew in SKEWS:
            stop, at = Stopping(3), None
            for step in range(12):
                if skew[rank] == step:
                    os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
                if stop.agreed():
                    at = step
                    break
            stop.close(ok=True)
            stops.append(at)
        torch.save({"stops": stops, "handler": signal.getsignal(signal.SIGTERM)},
                   Path(out) / f"rank{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_ranks_signalled_at_different_steps_stop_at_one() -> None:
    """Each rank's SIGTERM at its own step: every rank stops after the same step, the one
    after the first rank's signal (the notes combined a step late); none signalled, none
    stops; SIGTERM's handler is the default again after each."""
    got = spawned(skewed_worker, 3)
    want = [None if all(s is None for s in skew) else min(s for s in skew if s is not None) + 1
            for skew in SKEWS]  # fmt: skip
    for r in got:
        assert r["stops"] == want
        assert r["handler"] == signal.SIG_DFL


def test_a_restarted_job_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    """`--max-restarts 1`: rank 1 fails at step 5 (after the checkpoint at 4), torchrun starts
    both ranks again, and they resume from step 4 (the failure injected once): the run ends
    as a straight one, its log holding every step once. Failing before any checkpoint, the
    restart starts over."""
    base = ["--nproc", "2", "--steps", "8", "--batch-size", "64", "--synthetic-eval", "256",
            "--log-every", "1", "--no-progress"]  # fmt: skip

    def train(out: Path, *flags: str) -> dict:
        cmd = [sys.executable, "-m", "recsz.cli", "train", *base, "--out", str(out), *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((out / "summary.json").read_text()) | {"log": done.stderr}

    def steps(out: Path) -> list[int]:
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if "loss" in r]

    straight = train(tmp_path / "straight")
    for fail_at, every in (("1:5", "2"), ("1:1", "4")):
        out = tmp_path / f"failed-{fail_at.replace(':', '-')}"
        got = train(out, "--max-restarts", "1", "--inject-failure", fail_at,
                    "--checkpoint-every", every)  # fmt: skip
        assert "injected failure on rank 1" in got["log"]  # it failed once, then went on
        # said as the launcher says a failure: each rank's line, then the first one's
        # traceback once, not torchrun's report (each traceback again, the agent's own)
        assert "recsz: rank 1 failed first; its traceback:" in got["log"], got["log"]
        assert got["log"].count("Traceback (most recent call last)") == 1, got["log"]
        assert "ChildFailedError" not in got["log"] and "exitcode" not in got["log"]
        assert steps(out) == steps(tmp_path / "straight") == list(range(1, 9))
        for key in ("auc", "logloss", "bytes_payload", "bytes_sent", "steps"):
            assert got[key] == pytest.approx(straight[key], rel=1e-6), (fail_at, key)


def test_bad_input_ends_a_job_at_once_without_restarts(tmp_path: Path) -> None:
    """A rank that fails on bad input (a data file's line) notes it for the launcher, which
    starts no other attempt, however many restarts it may make (the same input would fail
    the same way), names the problem once, for all ranks, without a traceback or torchrun's
    line of the exit status, and exits with 2, as `recsz` does on one process; under
    `python -m recsz.launcher` in torchrun's place, torchrun's own restarts are not made
    either. (A failure of another kind is restarted: the test above.)"""
    line = "\t".join(["1", *["3"] * 13, *["68fd1e64"] * 26])
    data = tmp_path / "bad.tsv"
    data.write_text("\n".join([line] * 39 + ["1\tabc\tzz"] + [line] * 40) + "\n")
    cmd = [sys.executable, "-m", "recsz.cli", "train", "--nproc", "2", "--steps", "2",
           "--batch-size", "32", "--no-progress", "--data", str(data),
           "--max-restarts", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    said = f"CriteoFormatError: {data}:40: field 2 (I1): 'abc' is not an integer"
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("recsz: bad input, the job not started again") and said in last
    assert re.fullmatch(r"ranks? [01](, 1)?: ", last.split("way): ")[1].split(said)[0]), last
    # one attempt (no restart), said once
    assert done.stderr.count(said) == 1 and "starting its ranks again" not in done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    assert "exitcode" not in done.stderr, done.stderr
    # python -m recsz.launcher in torchrun's place, with torchrun's own --max-restarts:
    # one attempt too (plain torchrun's agent starts the ranks again, each saying its line)
    agent = [sys.executable, "-m", "recsz.launcher", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "2", "-m", "recsz.train", *cmd[cmd.index("--steps"):-2]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", SEPARATE_STORES: "1"}
    done = subprocess.run(agent, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert 1 <= done.stderr.count(said) <= 2, done.stderr[-3000:]  # each rank's, once
    assert "Traceback" not in done.stderr and "exitcode" not in done.stderr


def test_recsz_launcher_in_torchruns_place_says_a_failure_in_a_few_lines() -> None:
    """`python -m recsz.launcher` takes torchrun's flags (a node of a multi-node job, as the
    README's Slurm script runs it): a rank's failure is said by each rank's line, then the
    first one's traceback once, not torchrun's report (each traceback again, and the
    agent's own); the exit status is torchrun's, 1."""
    cmd = [sys.executable, "-m", "recsz.launcher", "--standalone", "--nproc-per-node", "2",
           "-m", "recsz.train", "--steps", "8", "--batch-size", "64", "--no-progress",
           "--synthetic-eval", "256", "--inject-failure", "1:2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "recsz: rank 1 failed: RuntimeError: injected failure on rank 1" in done.stderr
    assert "recsz: rank 1 failed first; its traceback:" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr[-3000:]
    assert "ChildFailedError" not in done.stderr and "exitcode" not in done.stderr


STUCK_RANK = """
import os, signal, sys, threading, time
import torch, torch.distributed as dist
from recsz import stopping
stopping.STUCK_S = 2.0
rank, store, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
if rank == 1:  # alive, its connection open, never in the collective: a host gone quiet
    time.sleep(120)
stop = stopping.Stopping(1 if mode == "slow steps" else 2, rank=0)
if mode == "slow steps":  # two steps 1.2 s apart: 3 x 1.2 s in one call is no hang
    stop.agreed(), time.sleep(1.2), stop.agreed()
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
if mode == "stuck":
    dist.all_reduce(torch.ones(1))  # waits for rank 1, in one call
else:
    if mode == "busy":  # for longer than STUCK_S, in many calls: alive, not stuck
        def work():  # (each call a frame of its own, as a step's are)
            return torch.ones(64).sum()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            work()
    elif mode == "writing":  # one long call of its own: a checkpoint's write
        with stop.busy():
            time.sleep(3)
    elif mode == "saved":  # one long call evaluating a step whose checkpoint is complete
        with stop.busy(saved=2):
            time.sleep(30)
    else:
        time.sleep(3)
    assert stop.asked
    print("went on", flush=True)
    os._exit(0)
"""


@pytest.mark.parametrize("mode", ["stuck", "busy", "writing", "slow steps", "saved"])
def test_a_rank_held_by_a_quiet_peer_exits_when_asked_to_stop(tmp_path: Path, mode: str) -> None:
    """SIGTERM to a rank whose collective waits on a peer that neither answers nor closes its
    connection (NCCL, a host off the network): a Python handler would never run, so the
    watcher names the call and exits with SIGTERM's status after STUCK_S (2 s here) instead of
    the launcher's SIGKILL 30 s later. A rank busy in many calls for longer, or writing a
    checkpoint in one, or in one call shorter than 3 of its steps, is left alone; one in a
    long call of an evaluation whose step's checkpoint is complete exits at once."""
    script = tmp_path / "rank.py"
    script.write_text(STUCK_RANK)
    store = str(tmp_path / "store")
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), store, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]  # fmt: skip
    try:
        out, err = ranks[0].communicate(timeout=60)
    finally:
        ranks[1].kill()
        ranks[1].communicate()
    if mode not in ("stuck", "saved"):
        assert ranks[0].returncode == 0 and out == "went on\n", err[-2000:]
        return
    assert ranks[0].returncode == 128 + signal.SIGTERM, err[-2000:]
    said = err.strip().splitlines()[-1]
    if mode == "saved":
        assert said == ("recsz: rank 0: asked to stop (SIGTERM) while it evaluates step 2, "
                        "whose checkpoint is complete: exiting now (the same command line "
                        "again evaluates it)"), said  # fmt: skip
        return
    assert said.startswith("recsz: rank 0: asked to stop (SIGTERM), but held 2 s in one call")
    assert "distributed_c10d.py" in said and "all_reduce" in said, said


@pytest.mark.usefixtures("ctrl_c_heard")
def test_ctrl_c_stops_a_job_at_a_checkpoint_and_again_at_once() -> None:
    """SIGINT (Ctrl-C) asks a run to stop as SIGTERM does, by its own status; SIGTERM's
    status wins where a rank saw both; SIGINT again within ECHO_S is the first passed on
    once more (torchrun's agent), later it is a second Ctrl-C: KeyboardInterrupt at once.
    Both handlers are the caller's again after close(). A SIGINT ignored as the process
    started (a shell's background job) stays ignored."""
    import time

    from recsz import stopping

    before = {sig: signal.getsignal(sig) for sig in stopping.SIGNALS}
    stop = stopping.Stopping(1)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, passed on
    assert stop.agreed() is True and stop.by == signal.SIGINT
    time.sleep(stopping.ECHO_S + 0.1)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # (the handler runs between two of the main thread's calls)
    stop.close(ok=True)
    stop = stopping.Stopping(1)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.agreed() is True and stop.by == signal.SIGTERM
    stop.close(ok=True)
    assert {sig: signal.getsignal(sig) for sig in stopping.SIGNALS} == before
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = stopping.Stopping(1)
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.agreed() is False and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    stop.close(ok=True)


def test_ctrl_c_to_a_launched_job_saves_its_checkpoint_quietly(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the launcher's process group): the ranks get it once,
    passed on by torchrun's agent (a session of its own), stop at one step with a checkpoint
    as on SIGTERM, and the job exits with 130, rank 0 saying where, no traceback (before:
    KeyboardInterrupt's on every rank and the agent's, ~117 lines, no checkpoint)."""
    run = tmp_path / "run"
    launcher, _agent, _workers = start_job(run)
    os.killpg(launcher.pid, signal.SIGINT)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGINT, out[-2000:]
    said = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(said) == 1 and "(SIGINT)" in said[0], out[-2000:]
    assert "Traceback" not in out and len(out.splitlines()) < 12, out[-3000:]
    assert "death signal" not in out, out[-3000:]  # (torchrun's agent's line: filtered)
    saved = checkpoint.complete(run)
    assert len(saved) == 1, saved
    assert f"step {json.loads((saved[0] / 'meta.json').read_text())['step']} " in said[0]


def test_the_watcher_ends_with_its_run() -> None:
    """close() restores SIGTERM's handler and the wakeup fd, and its thread ends."""
    from recsz.stopping import Stopping

    before = signal.getsignal(signal.SIGTERM)
    stop = Stopping(1)
    assert any(t.name == "recsz-sigterm" for t in threading.enumerate())
    assert stop.agreed() is False
    stop.close(ok=True)
    assert not any(t.name == "recsz-sigterm" for t in threading.enumerate())
    assert signal.getsignal(signal.SIGTERM) == before
    assert signal.set_wakeup_fd(-1) == -1  # none left set


def test_sigterm_during_an_evaluation_saves_its_step_on_every_rank(tmp_path: Path) -> None:
    """SIGTERM to a 2-rank job during an evaluation of a step without a checkpoint: the
    ranks agree after an evaluation batch, end it, save that step and exit with 143 (said
    once), not after it (or at torchrun's SIGKILL); the same command line again evaluates
    that step first and goes on."""
    import time

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "recsz.cli", "train", "--nproc", "2", "--steps", "4",
           "--batch-size", "64", "--eval-every", "3", "--checkpoint-every", "2",
           "--synthetic-eval", "400000", "--no-progress", "--out", str(run)]  # fmt: skip
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    meta = run / "checkpoints" / "step-000000002" / "meta.json"
    deadline = time.monotonic() + 120
    while not meta.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # after step 2's agreement: seen in step 3's evaluation at the earliest, and at the
    # latest, since step 4 follows it
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, err[-2000:]
    said = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(said) == 1 and "step 3 (SIGTERM) during its evaluation" in said[0], out[-2000:]
    assert [d.name for d in checkpoint.complete(run)] == ["step-000000002", "step-000000003"]
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "eval_auc" in r]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "the evaluation due at step 3 did not end before the run stopped" in again.stdout
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_auc" in r] == [3, 4]


def test_a_second_job_on_a_run_being_written_is_refused(tmp_path: Path) -> None:
    """A 2-rank job started on a run another job is writing (a requeued job beside one still
    running, a command typed twice; here a process holding the run's lock as that job's rank
    0 does): refused, naming the holder, in the launcher's one line, before it writes anything."""
    run = tmp_path / "run"
    hold = ("import sys, time; from pathlib import Path; from recsz.rundir import Held; "
            "h = Held(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")  # fmt: skip
    with subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE,
                          text=True) as holder:  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            cmd = [sys.executable, "-m", "recsz.cli", "train", "--nproc", "2", "--steps", "4",
                   "--batch-size", "64", "--no-progress", "--out", str(run)]  # fmt: skip
            second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        finally:
            holder.kill()
    said = f"is being written by another job (pid {holder.pid} on "
    assert second.returncode == 2 and second.stderr.count(said) == 1, second.stderr[-3000:]
    assert re.search(r"^recsz: bad input: ranks? [01](, 1)?: ValueError: --out ", second.stderr,
                     re.M), second.stderr[-3000:]  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == [".writer"]  # nothing written


#: A stand-in for Slurm's srun on one machine: its command once a node (SLURM_NNODES, each
#: task's SLURM_PROCID and SLURM_NODEID set), a signal it gets passed on to every task (as
#: Slurm's --signal reaches every task), its status the tasks' largest.
SRUN = """import os, signal, subprocess, sys
tasks = [subprocess.Popen(sys.argv[1:], env={**os.environ, "SLURM_PROCID": str(i),
         "SLURM_NODEID": str(i)}) for i in range(int(os.environ["SLURM_NNODES"]))]
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, _f: [t.send_signal(s) for t in tasks])
sys.exit(max(t.wait() for t in tasks))
"""
#: ... and for `scontrol show hostnames NODELIST`: this machine, once a node.
SCONTROL = """import os
print("\\n".join(["127.0.0.1"] * int(os.environ["SLURM_NNODES"])))
"""


def test_a_two_node_job_is_preempted_and_goes_on_under_slurm(tmp_path: Path) -> None:
    """examples/slurm.sbatch (the README's Slurm job) on one machine, srun and scontrol
    stood in for: two nodes of one rank each, each node's `python -m recsz.launcher`
    meeting the other at a c10d rendezvous, both writing one run directory (a shared
    filesystem). SIGTERM to every task (Slurm's ``--signal=TERM``): one checkpoint, the job
    exits 143; the same script again (a requeued job: the same rendezvous id) goes on from
    it to the end, as a straight 2-rank run (which --profile measures: profiling changes
    nothing that trains)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_ / name).write_text(f"#!{sys.executable}\n{text}")
    (bin_ / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    run = tmp_path / "run"
    job = ["--batch-size", "64", "--no-progress", "--synthetic-eval", "256", "--log-every",
           "100000", "--dist-timeout", "30"]  # fmt: skip
    script = Path(__file__).resolve().parents[2] / "examples" / "slurm.sbatch"

    def slurm_job(steps: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "SLURM_NNODES": "2",
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "RUN": str(run),
               "GPUS_PER_NODE": "1", "PORT": str(port),
               "TRAIN": " ".join([*job, "--steps", str(steps)])}  # fmt: skip
        return subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)  # fmt: skip

    first, said = slurm_job(100000), []
    started = threading.Event()

    def read() -> None:
        for line in first.stdout:  # type: ignore[union-attr]
            said.append(line)
            if line.startswith("table owners"):  # (rank 0's node, after a collective)
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started.wait(timeout=120)
    srun = next(p for p in [first.pid, *_children(first.pid)] if "/srun" in _cmdline(p))
    os.kill(srun, signal.SIGTERM)  # (passed on to every task, as Slurm signals them all)
    first.wait(timeout=60)
    reader.join(timeout=10)
    first.stdout.close()  # type: ignore[union-attr]
    log = "".join(said)
    assert started.is_set() and first.returncode == 143, log[-3000:]
    saved = checkpoint.complete(run)
    assert len(saved) == 1 and log.count("stopped at step") == 1, log[-3000:]
    step = json.loads((saved[0] / "meta.json").read_text())["step"]

    again = slurm_job(step + 3)
    out = again.communicate(timeout=180)[0]
    assert again.returncode == 0, out[-3000:]
    assert out.count(f"checkpoint at step {step}: going on") == 1, out[-3000:]
    cmd = [sys.executable, "-m", "recsz.cli", "train", "--nproc", "2", *job, "--steps",
           str(step + 3), "--out", str(tmp_path / "straight"), "--profile", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # (profiled, as a check of --profile on 2 ranks: each rank's numbers and trace)
    profiles = json.loads((tmp_path / "straight" / "profile.json").read_text())["ranks"]
    assert [p["steps"] for p in profiles] == [2, 2], profiles
    assert all((tmp_path / "straight" / "profile" / f"rank-{r}.json.gz").exists() for r in (0, 1))
    assert "recsz: profile of steps" in done.stdout + done.stderr
    resumed, straight = (json.loads((d / "summary.json").read_text())
                         for d in (run, tmp_path / "straight"))  # fmt: skip
    assert resumed["steps"] == straight["steps"] == step + 3
    for key in ("world_size", "auc", "logloss", "bytes_payload", "bytes_sent"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6), key


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(k) for k in kids.read_text().split()] if kids.exists() else []


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
