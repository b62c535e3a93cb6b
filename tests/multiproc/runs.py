"""What the distributed runs' tests share: a run of `recsz train` (tiny preset, 20 steps,
SGD on the tables: Adagrad divides each row's gradient by its own magnitude, which turns
float-rounding differences in near-zero gradients into visible updates, so it can only
match to ~1e-3, measured, not to float tolerance) and what its files hold."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from recsz.model import get_preset
from recsz.train import main

SIZES = get_preset("tiny").model.table_sizes


BASE = [
    "--steps",
    "20",
    "--batch-size",
    "64",
    "--log-every",
    "1",
    "--synthetic-eval",
    "512",
    "--no-progress",
    "--checkpoint-every",
    "20",
    "--seed",
    "5",
    "--emb-optimizer",
    "sgd",
]


def run(out: Path, *extra: str, nproc: int = 1) -> dict:
    rc = main([*BASE, "--out", str(out), "--nproc", str(nproc), *extra])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())


def run_on_hosts(out: Path, *extra: str, hosts: int = 2, nproc: int = 2) -> dict:
    """`recsz train` on ``hosts`` torchrun agents of ``nproc`` ranks each, meeting at a
    rendezvous on this machine, as agents on ``hosts`` machines do."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "recsz.launcher", f"--nnodes={hosts}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "recsz.train",
           *BASE, "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, env=env) for _ in range(hosts)]
    try:
        assert [a.wait(timeout=300) for a in agents] == [0] * hosts
    finally:
        for a in agents:
            a.kill()
    return json.loads((out / "summary.json").read_text())


def losses(out: Path) -> list[float]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def tables(out: Path, step: int = 20, shards: int = 1) -> dict[int, torch.Tensor]:
    """Every table's final weights (each column shard's), gathered from all ranks'
    checkpoint files."""
    d = out / "checkpoints" / f"step-{step:09d}"
    got: dict[int, torch.Tensor] = {}
    for f in sorted(d.glob("rank-*.pt")):
        s = torch.load(f, weights_only=False)
        sizes = [SIZES[t // shards] for t in s["tables"]]
        got.update(zip(s["tables"], s["sparse"]["weight"].split(sizes), strict=True))
    return got


def dense(out: Path, step: int = 20) -> dict[str, torch.Tensor]:
    d = out / "checkpoints" / f"step-{step:09d}"
    return torch.load(d / "rank-0.pt", weights_only=False)["dense"]


def assert_same_model(a: Path, b: Path, tol: float) -> None:
    ta, tb = tables(a), tables(b)
    assert sorted(ta) == sorted(tb) == list(range(26))
    for t in ta:
        torch.testing.assert_close(ta[t], tb[t], rtol=0, atol=tol, msg=f"table {t}")
    da, db = dense(a), dense(b)
    for k in da:
        torch.testing.assert_close(da[k], db[k], rtol=0, atol=tol, msg=k)


def one_and_two_ranks(tmp_path: Path, *flags: str) -> tuple[dict, dict]:
    """The summaries of one process and of 2 ranks with a lossless codec, whose losses
    must agree step by step."""
    one = run(tmp_path / "one", *flags)
    two = run(tmp_path / "two", *flags, "--fwd-codec", "zstd", "--bwd-codec", "zstd", nproc=2)
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "two")), torch.tensor(losses(tmp_path / "one")),
        rtol=0, atol=1e-5,
    )  # fmt: skip
    return one, two
