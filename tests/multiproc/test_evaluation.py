"""Evaluation across ranks: each rank makes its part of every held-out batch, predicts its
samples, and rank 0 computes the numbers over all of them. With predictions that are a
known function of each sample, the numbers on 3 ranks (a set and batches that do not
divide by 3) equal scikit-learn's over the whole set made at once."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from recsz import evaluation as evaluation_module
from recsz.data.source import make_source
from recsz.model import get_preset
from recsz.ranks import Ranks

pytestmark = pytest.mark.slow
SIZES = get_preset("tiny").model.table_sizes
N_EVAL, BATCH = 1001, 100  # at 3 ranks: batches of 102, the last of 83 (28, 28, 27)
TABLES = {0: (0, 5), 1: (1, 2, 3), 2: (4,)}  # each rank's tables; (0, 5): not its own


def logits_of(dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A prediction made from a sample's own values: the synthetic data's hidden teacher."""
    teacher = make_source("synthetic", SIZES, seed=4).gen  # type: ignore[attr-defined]
    return torch.from_numpy(teacher.logits(dense.numpy(), ids.numpy())).float()


def evaluated(rank: int, world: int) -> dict[str, object]:
    """recsz.evaluation.evaluate on this rank (its predictions kept), its model replaced
    by :func:`logits_of`, which reads its own samples' values only (what its part fills
    in full)."""

    def forward(parts: object, dense: torch.Tensor, ids: torch.Tensor, step: int) -> torch.Tensor:
        b = len(dense)
        return logits_of(dense, ids[rank * b : (rank + 1) * b])

    source = make_source("synthetic", SIZES, seed=4, synthetic_eval=N_EVAL)
    tables = TABLES[rank] if world == 3 else tuple(range(26))
    parts = SimpleNamespace(
        sparse=SimpleNamespace(tables=list(tables), shards=1),
        exchange=SimpleNamespace(train=lambda on: None),
    )
    cfg = SimpleNamespace(eval_batch_size=BATCH, prefetch=2, progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation_module, "forward", forward)
        ranks = Ranks(rank, world)
        return evaluation_module.evaluate(parts, source, cfg, 0, ranks, predictions=True)  # type: ignore[arg-type]


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
    torch.save(evaluated(rank, 3), Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def whole_set() -> tuple[np.ndarray, np.ndarray]:
    """Every sample's prediction and label, the set made at once (every value of each)."""
    source = make_source("synthetic", SIZES, seed=4, synthetic_eval=N_EVAL)
    (whole,) = source.eval_batches(N_EVAL)
    return torch.sigmoid(logits_of(whole.dense, whole.ids)).numpy(), whole.labels.numpy()


def reference() -> dict[str, float]:
    """scikit-learn over the whole set, made at once."""
    p, y = (a.astype(np.float64) for a in whole_set())
    return {
        "auc": float(roc_auc_score(y, p)),
        "logloss": float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7), labels=[0.0, 1.0])),
        "accuracy": float(((p > 0.5) == (y > 0.5)).mean()),
    }


def test_three_ranks_evaluate_the_whole_set_as_one_process_does() -> None:
    from tests.multiproc.spawned import spawned

    want = reference()
    assert want["auc"] > 0.7  # the predictions say something of the labels
    one = evaluated(0, 1)
    three = spawned(_worker, 3)
    for got in (one, *three):
        assert got["eval_samples"] == N_EVAL  # no padding counted, no sample lost
        assert got["eval_s"] > 0
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6), (key, got)
    assert all(r[k] == three[0][k] for r in three for k in want)  # every rank the same
    assert not math.isnan(three[0]["auc"])
    # Rank 0 holds every prediction and label, in the set's order (gathered rank by rank).
    p, y = whole_set()
    for got in (one, three[0]):
        kept = got["predictions"].numpy()  # type: ignore[attr-defined]
        np.testing.assert_array_equal(kept[:, 1], y)
        np.testing.assert_allclose(kept[:, 0], p, rtol=0, atol=1e-6)
    assert all("predictions" not in r for r in three[1:])
