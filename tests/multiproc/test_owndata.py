"""A model of other tables and dense inputs than Criteo's on 2 gloo ranks: the same run as
one process (a lossless codec, SGD tables), on TorchRec-layout days of its shape, and its
checkpoint evaluated on them by any number of ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recsz.cli import main as recsz
from recsz.train import main
from tests.test_owndata import DENSE, ROWS, write_days

pytestmark = pytest.mark.slow

FLAGS = ["--table-rows", "3x300,5000,40", "--dense-features", str(DENSE), "--steps", "12",
         "--batch-size", "64", "--log-every", "1", "--no-progress", "--checkpoint-every", "12",
         "--emb-optimizer", "sgd", "--fwd-codec", "zstd", "--bwd-codec", "lz4"]  # fmt: skip


def model(out: Path) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """Every table's weights (gathered from the ranks' checkpoint files) and the MLPs'."""
    d = out / "checkpoints" / "step-000000012"
    got: dict[int, torch.Tensor] = {}
    for f in sorted(d.glob("rank-*.pt")):
        s = torch.load(f, weights_only=False)
        sizes = [ROWS[t] for t in s["tables"]]
        got.update(zip(s["tables"], s["sparse"]["weight"].split(sizes), strict=True))
    return got, torch.load(d / "rank-0.pt", weights_only=False)["dense"]


def test_two_ranks_train_another_shape_as_one_process(tmp_path: Path) -> None:
    days = write_days(tmp_path / "days", ROWS, DENSE)
    runs = {n: tmp_path / f"n{n}" for n in (1, 2)}
    for n, out in runs.items():
        assert main([*FLAGS, "--data", str(days), "--out", str(out), "--nproc", str(n)]) == 0
    rows = {n: [json.loads(r) for r in (o / "metrics.jsonl").read_text().splitlines()]
            for n, o in runs.items()}  # fmt: skip
    loss = {n: torch.tensor([r["loss"] for r in rs if "loss" in r]) for n, rs in rows.items()}
    assert len(loss[1]) == 12
    torch.testing.assert_close(loss[2], loss[1], rtol=0, atol=1e-5)
    (t1, d1), (t2, d2) = model(runs[1]), model(runs[2])
    assert sorted(t1) == sorted(t2) == list(range(len(ROWS)))
    for t in t1:
        torch.testing.assert_close(t2[t], t1[t], rtol=0, atol=1e-5, msg=f"table {t}")
    for k in d1:
        torch.testing.assert_close(d2[k], d1[k], rtol=0, atol=1e-5, msg=k)
    # Its checkpoint evaluated on the days (all of them held out) by 2 ranks and by one.
    said = {}
    for n in (1, 2):
        j = tmp_path / f"eval{n}.json"
        assert recsz(["evaluate", str(runs[2]), "--eval-data", str(days), "--nproc", str(n),
                      "--json", str(j)]) == 0  # fmt: skip
        said[n] = json.loads(j.read_text())
    assert said[1]["eval_samples"] == said[2]["eval_samples"] == 4000
    assert said[1]["auc"] == pytest.approx(said[2]["auc"], abs=1e-6)
    # and scored without their labels (`recsz predict DIR`) by 2 ranks as by one
    for f in days.glob("day_*_labels.npy"):
        f.unlink()
    preds = {n: tmp_path / f"p{n}.npy" for n in (1, 2)}
    for n, p in preds.items():
        assert recsz(["predict", str(runs[2]), str(days), "--nproc", str(n), "--out", str(p)]) == 0
    p1, p2 = (np.load(p) for p in preds.values())
    assert p1.shape == (4000,)
    np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-6)


def test_ranks_without_tables_take_their_part_in_the_backward(tmp_path: Path) -> None:
    """Three ranks, two tables: the rank that holds none still sends its samples' gradients
    back (its peers waited for them, then read its next forward's bytes as them: "checksum
    mismatch", or a collective's timeout), and the run is one process's."""
    flags = ["--table-rows", "300,5000", "--steps", "6", "--batch-size", "48", "--log-every",
             "1", "--no-progress", "--emb-optimizer", "sgd", "--bwd-codec", "zstd",
             "--synthetic-eval", "256", "--dist-timeout", "60"]  # fmt: skip
    losses = {}
    for n in (1, 3):
        out = tmp_path / f"n{n}"
        assert main([*flags, "--out", str(out), "--nproc", str(n)]) == 0
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        losses[n] = torch.tensor([r["loss"] for r in rows if "loss" in r])
    assert len(losses[1]) == 6
    torch.testing.assert_close(losses[3], losses[1], rtol=0, atol=1e-5)
