"""A job asked to stop (SIGTERM to `recsz train --nproc 2`, as a scheduler preempting it):
its ranks agree on a step, save a checkpoint there and exit with SIGTERM's status; resumed
(on the ranks the job recorded), the run ends as one never stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recsz import checkpoint
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

    def train(*flags: str) -> dict:
        cmd = [sys.executable, "-m", "recsz.cli", "train", "--no-progress", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        out = Path(flags[flags.index("--out") + 1]) if "--out" in flags else run
        return json.loads((out / "summary.json").read_text())

    end = str(step + 3)
    resumed = train("--resume", str(run), "--steps", end)  # on the job's 2 ranks, as recorded
    job = ["--batch-size", "64", "--synthetic-eval", "256", "--log-every", "100000"]
    straight = train("--nproc", "2", "--steps", end, *job, "--out", str(tmp_path / "straight"))
    assert resumed["steps"] == straight["steps"] == step + 3
    for key in ("world_size", "auc", "logloss", "bytes_payload", "bytes_sent"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6), key
