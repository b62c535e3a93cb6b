"""Runs stopped and resumed across ranks (on as many ranks or on others, their codecs'
and hooks' state with them), and jobs that stop at once: a failing rank, diverging
losses, ranks started with other configurations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsz import checkpoint
from recsz.train import main
from tests.multiproc.runs import (
    BASE,
    SIZES,
    assert_same_model,
    losses,
    run,
)

pytestmark = pytest.mark.slow


def test_failing_rank_stops_the_job_fast(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "recsz.cli",
        "train",
        *BASE,
        "--steps",
        "50",
        "--nproc",
        "2",
        "--inject-failure",
        "1:3",
        "--dist-timeout",
        "30",
        "--out",
        str(tmp_path),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # a hang guard
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "injected failure on rank 1 at step 3" in out
    # rank 0 was stopped (its peer gone, or torchrun's signal), not left to its
    # collective's timeout
    assert "timed out" not in out.lower() and "timeout" not in out.lower().replace(
        "dist-timeout", ""
    ), out[-3000:]


def test_diverging_ranks_all_stop_at_the_same_row(tmp_path: Path) -> None:
    """Every rank reads every rank's loss in the row's one gather, so all stop together
    (no rank left waiting in a collective: a hang would run into the timeout), naming both
    ranks."""
    cmd = [sys.executable, "-m", "recsz.cli", "train", *BASE, "--nproc", "2", "--lr", "1e30",
           "--dist-timeout", "30", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "the loss is not finite on rank(s) [0, 1] by step 2" in p.stdout + p.stderr


def test_resume_equals_straight_run(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    hybrid = ("--fwd-codec", "hybrid", "--bwd-codec", "hybrid")
    run(straight, *hybrid, nproc=2)
    split = tmp_path / "split"
    run(split, *hybrid, "--steps", "10", "--checkpoint-every", "10", nproc=2)
    run(split, *hybrid, "--resume", str(split), nproc=2)
    assert_same_model(straight, split, 1e-6)

    # The resumed run reports the whole run: its log has each training step once, as the
    # straight run's, and its summary counts the bytes of every step.
    def logged(d: Path) -> list[int]:  # the training rows (evaluations add rows of their own)
        rows = [json.loads(r) for r in (d / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if "loss" in r]

    assert logged(split) == logged(straight) == list(range(1, 21))
    a, b = (json.loads((d / "summary.json").read_text()) for d in (split, straight))
    for k in ("bytes_raw", "bytes_payload", "bytes_sent", "fwd_ratio", "bwd_ratio"):
        assert a[k] == b[k], k
    torch.testing.assert_close(
        torch.tensor(losses(split)[-10:]), torch.tensor(losses(straight)[-10:]), rtol=0, atol=1e-6
    )


def test_resume_on_another_number_of_ranks(single: Path, tmp_path: Path) -> None:
    """A checkpoint of 2 ranks resumed on one process, and one of one process resumed on 2
    ranks (a lossless codec): the tables move to the ranks the new plan gives them, and
    each run ends where the one-process run does (every step's loss, every table, the
    MLPs), its summary counting every step's bytes once."""
    zstd = ("--fwd-codec", "zstd", "--bwd-codec", "zstd")
    straight = run(tmp_path / "straight", *zstd)  # one process, its bytes
    for first, then in ((2, 1), (1, 2)):
        d = tmp_path / f"{first}-then-{then}"
        run(d, *zstd, "--steps", "10", "--checkpoint-every", "10", nproc=first)
        resumed = run(d, *zstd, "--resume", str(d), nproc=then)
        assert resumed["world_size"] == then
        torch.testing.assert_close(
            torch.tensor(losses(d)), torch.tensor(losses(single)), rtol=0, atol=1e-5
        )
        assert_same_model(single, d, 1e-5)
        assert resumed["bytes_raw"] == straight["bytes_raw"]  # (ratios: zstd's by chunk)


def test_a_resharded_resume_keeps_what_the_bound_policies_learnt(tmp_path: Path) -> None:
    """2 ranks with the dual-level bounds, resumed on one process: the forward policy holds
    each table's class and index as its old owner learnt them, the backward's those of old
    rank 0, and none probes anew (classes after the window, unchanged 2 steps later)."""
    flags = ("--fwd-codec", "hybrid", "--bwd-codec", "hybrid", "--eb-policy", "dual",
             "--hindex-probe-steps", "4")  # fmt: skip
    run(tmp_path, *flags, "--steps", "8", "--checkpoint-every", "8", nproc=2)
    run(tmp_path, *flags, "--resume", str(tmp_path), "--steps", "10")

    def policies(step: int, rank: int) -> dict:
        f = tmp_path / "checkpoints" / f"step-{step:09d}" / f"rank-{rank}.pt"
        return torch.load(f, weights_only=False)

    old = [policies(8, r) for r in (0, 1)]
    new = policies(10, 0)["policies"]
    for key in ("classes", "index"):
        fwd = {t: o["policies"]["fwd"][key][t] for o in old for t in o["tables"]}
        assert new["fwd"][key] == fwd and len(fwd) == len(SIZES), key
        assert new["bwd"][key] == old[0]["policies"]["bwd"][key], key
    assert new["fwd"]["again"] is None and new["bwd"]["again"] is None


def test_resume_checks_every_file_of_another_number_of_ranks(tmp_path: Path) -> None:
    """A checkpoint said to be written by 2 ranks, resumed on one: the file it lacks is
    named (every rank's file is read when the tables are resharded)."""
    run(tmp_path, "--steps", "2", "--checkpoint-every", "2")
    meta = next((tmp_path / "checkpoints").glob("step-*/meta.json"))
    m = json.loads(meta.read_text())
    m["world_size"] = 2  # as if 2 ranks had written it
    m["checksum"] = checkpoint.record_digest(m)
    meta.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"step-000000002/rank-1\.pt: missing"):
        main([*BASE, "--resume", str(tmp_path)])


def test_resume_refuses_other_config(tmp_path: Path) -> None:
    run(tmp_path, "--steps", "2", "--checkpoint-every", "2")
    with pytest.raises(ValueError, match=r"another configuration \(lr"):
        main([*BASE, "--resume", str(tmp_path), "--lr", "0.5"])


def test_incomplete_checkpoint_is_ignored(tmp_path: Path) -> None:
    run(tmp_path, "--steps", "4", "--checkpoint-every", "2")
    (tmp_path / "checkpoints" / "step-000000004" / "meta.json").unlink()  # crash mid-write
    from recsz import checkpoint

    assert checkpoint.complete(tmp_path)[-1].name == "step-000000002"


def test_ranks_with_different_configs_refuse_to_start(tmp_path: Path) -> None:
    """Two ranks started by hand (as a multi-node launcher would) with different --lr."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, lr in ((0, "0.1"), (1, "0.2")):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "recsz.train", *BASE, "--lr", lr, "--dist-timeout", "30"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert any("ranks [1] were started with a configuration that differs" in o for o in outs)


@pytest.mark.parametrize("mode", ["eb", "dct", "rsag"])
def test_resume_keeps_the_hooks_error_feedback(tmp_path: Path, mode: str) -> None:
    """A run split by a checkpoint ends where a straight one does: the hook's residuals
    travel in the checkpoint, per parameter (DDP's buckets are laid out anew)."""
    flags = ["--dp-comm", mode, "--powersgd-warmup", "3", "--nproc", "2"]
    if mode == "rsag":
        flags = ["--dp-comm", "eb", "--dp-eb-collective", "rsag", "--nproc", "2"]
    straight = tmp_path / "straight"
    run(straight, *flags[:-2], nproc=2)
    split = tmp_path / "split"
    main([*BASE, "--steps", "10", "--checkpoint-every", "10", "--out", str(split), *flags])
    assert main([*BASE, "--resume", str(split), *flags]) == 0
    assert losses(split)[-10:] == losses(straight)[-10:]
    assert_same_model(straight, split, 0.0)
