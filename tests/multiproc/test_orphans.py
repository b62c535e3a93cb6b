"""The launcher owns its ranks: however `recsz train --nproc 2`, torchrun's agent or a rank
dies, no process of the job is alive 10 s later."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
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


def _ctrl_c_heard() -> None:
    """In the launcher before exec: SIGINT's default, whatever this process has (a shell's
    background job ignores it, and recsz then leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_job(tmp_path: Path) -> tuple[subprocess.Popen, int, list[int]]:
    """A long 2-rank job; returns the launcher, its agent and the two workers once rank 0
    has printed its table owners (after a collective, so both ranks are up). A job that
    cannot start fails within its --dist-timeout and closes the pipe: no wait here hangs."""
    cmd = [sys.executable, "-m", "recsz.cli", "train", "--nproc", "2", "--steps", "100000",
           "--batch-size", "64", "--no-progress", "--synthetic-eval", "256",
           "--log-every", "100000", "--dist-timeout", "30", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, preexec_fn=_ctrl_c_heard,
    )  # fmt: skip
    assert launcher.stdout is not None
    seen = []
    for line in launcher.stdout:
        seen.append(line)
        if line.startswith("table owners"):
            break
    else:
        raise AssertionError("the job ended before starting:\n" + "".join(seen[-20:]))
    agents = children().get(launcher.pid, [])
    workers = [w for a in agents for w in children().get(a, [])]
    assert len(agents) == 1 and len(workers) == 2, (agents, workers)
    return launcher, agents[0], workers


def wait_gone(pids: list[int], quiet_s: float) -> list[int]:
    """Wait for the processes to end (pidfd: readable once a process has exited); give up
    when none has ended for ``quiet_s`` seconds. Returns the ones still running."""
    fds = {}
    for p in pids:
        try:
            fds[os.pidfd_open(p)] = p
        except ProcessLookupError:
            continue  # already gone
    try:
        while fds:
            ready, _, _ = select.select(list(fds), [], [], quiet_s)
            if not ready:
                break
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return [p for p in fds.values() if alive(p)]
    finally:
        for fd in fds:
            os.close(fd)


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
        # The bound: nothing of the job left 10 s after the kill.
        left = wait_gone(job, 10.0)
        assert not left, f"after {signal.Signals(sig).name} to the {victim}: {left} alive"
    finally:
        for p in job:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        launcher.communicate()
