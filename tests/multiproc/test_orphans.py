"""The launcher owns its ranks: however `recsz train --nproc 2`, torchrun's agent or a rank
dies, no process of the job is alive 10 s later."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def children() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    tree, found, todo = children(), [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def start_job(tmp_path: Path) -> tuple[subprocess.Popen, int, list[int]]:
    """A long 2-rank job; returns the launcher, its agent and the two workers once up."""
    cmd = [sys.executable, "-m", "recsz.cli", "train", "--nproc", "2", "--steps", "100000",
           "--batch-size", "64", "--no-progress", "--synthetic-eval", "256",
           "--out", str(tmp_path)]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        agents = children().get(launcher.pid, [])
        workers = [w for a in agents for w in children().get(a, [])]
        if agents and len(workers) >= 2 and (tmp_path / "metrics.jsonl").exists():
            return launcher, agents[0], workers
        time.sleep(0.3)
    launcher.kill()
    raise AssertionError("the job did not start within 60 s")


@pytest.mark.parametrize(
    "victim, sig",
    [
        ("launcher", signal.SIGTERM),
        ("launcher", signal.SIGINT),
        ("launcher", signal.SIGKILL),
        ("agent", signal.SIGKILL),
        ("rank", signal.SIGKILL),
    ],
)
def test_no_rank_outlives_its_launcher(tmp_path: Path, victim: str, sig: int) -> None:
    launcher, agent, workers = start_job(tmp_path)
    job = [launcher.pid, agent, *workers, *descendants(launcher.pid)]
    try:
        os.kill({"launcher": launcher.pid, "agent": agent, "rank": workers[0]}[victim], sig)
        deadline = time.time() + 10
        while time.time() < deadline and any(alive(p) for p in job):
            time.sleep(0.2)
            launcher.poll()  # reap the launcher when it exits
        left = [p for p in job if alive(p)]
        assert not left, f"after {signal.Signals(sig).name} to the {victim}: {left} alive"
    finally:
        for p in job:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        launcher.wait(timeout=10)
