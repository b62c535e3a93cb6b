"""A run's model built to score (`recsz evaluate`, `predict`, `export`:
``build_parts(train=False)``): no optimizer and no optimizer state, for every kind of
table, loaded from a training run's checkpoint, and scoring as the training did."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from recsz import checkpoint
from recsz.config import TrainConfig
from recsz.evaluation import restored
from recsz.evaluation import run as evaluate_run
from recsz.ranks import Ranks
from recsz.step import build_parts
from recsz.train import main

BASE = ["--steps", "4", "--batch-size", "64", "--checkpoint-every", "4", "--no-progress",
        "--synthetic-eval", "512"]  # fmt: skip
KINDS = {
    "adagrad": (),  # the tiny preset's: exact Adagrad, a state as large as the rows
    "rowwise-fp16": ("--emb-optimizer", "rowwise_adagrad", "--table-dtype", "fp16"),
    "sgd-bags-warmup": ("--emb-optimizer", "sgd", "--multi-hot", "3", "--lr-warmup-steps", "2"),
    "columns": ("--column-shards", "2", "--dense-optimizer", "adagrad"),
    "fiited": ("--fiited-budget", "0.5", "--fiited-interval", "2", "--fiited-chunk", "4"),
    "tt-cache": ("--tt-tables", "2", "--tt-cache-rows", "16", "--tt-cache-interval", "2"),
    "tt-replicated": ("--tt-tables", "2", "--tt-placement", "replicated",
                      "--emb-optimizer", "rowwise_adagrad"),
}  # fmt: skip


def state_bytes(module: torch.nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in module.state_dict().values()
        if isinstance(t, torch.Tensor)
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_model_built_to_score_holds_no_optimizer_and_scores_as_training_did(
    kind: str, tmp_path: Path
) -> None:
    """Trained 4 steps (a checkpoint at the last), the run's model restored to score gives
    the run's own final numbers; it holds no optimizer (the MLPs', the TT cores'), no
    table parameter wants a gradient, and its tables hold less than the training's parts
    by the row optimizers' state alone (exact Adagrad: as much as the rows)."""
    run = tmp_path / "run"
    assert main([*BASE, "--out", str(run), *KINDS[kind]]) == 0
    want = json.loads((run / "summary.json").read_text())
    got = evaluate_run([str(run)])
    for k in ("auc", "logloss", "accuracy"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    d, meta = checkpoint.record(run) or (None, None)
    assert d is not None and meta is not None
    with restored(Namespace(run=str(run), device="cpu"), ("device",)) as r:
        scoring = r.parts
        assert r.step == 4 and scoring.dense_opt is None and scoring.rates is None
        local = scoring.dense_module.local  # replicated TT tables (None: none)
        assert not scoring.sparse.tt.optimizers and (local is None or not local.optimizers)
        assert not any(p.requires_grad for p in scoring.sparse.parameters())
        cfg = TrainConfig.from_dict({**meta["config"], "out": None, "progress": False})
        training, _ = build_parts(cfg, Ranks.from_env(60.0))
        checkpoint.load(d, training, cfg, Ranks.from_env(60.0))
        saved = torch.load(d / "rank-0.pt", weights_only=False)["sparse"]
        kept = state_bytes(training.sparse)
        assert kept == sum(t.numel() * t.element_size() for t in saved.values()
                           if isinstance(t, torch.Tensor))  # fmt: skip
        row_state = sum(
            t.numel() * t.element_size()
            for k, t in training.sparse.state_dict().items()
            if k.endswith(("optimizer_state", "store.state", "cache.state"))
        )
        assert state_bytes(scoring.sparse) == kept - row_state
        if kind == "adagrad":
            assert row_state == training.sparse.weight.numel() * 4 > 0
        for a, b in zip(scoring.sparse.parameters(), training.sparse.parameters(), strict=True):
            assert torch.equal(a, b)
        assert scoring.dense_module.state_dict().keys() == training.dense_module.state_dict().keys()


def test_parts_built_to_score_are_not_trained_or_saved() -> None:
    """A training step or a checkpoint of parts built to score is refused, not run on
    missing optimizers."""
    from recsz.checkpointwrite import rank_state
    from recsz.data.source import make_source
    from recsz.step import train_step

    cfg = TrainConfig(steps=1)
    ranks = Ranks.from_env(60.0)
    parts, _ = build_parts(cfg, ranks, train=False)
    batch = make_source("synthetic", cfg.model().table_sizes, 0).train_batch(0, 8)
    with pytest.raises(AssertionError, match="built to score"):
        train_step(parts, batch, 0, ranks)
    with pytest.raises(AssertionError, match="built to score"):
        rank_state(parts, ranks, {})
