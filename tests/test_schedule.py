"""The learning rates' warm-up and decay (recsz.model.schedule, --lr-warmup-steps,
--lr-decay-start, --lr-decay-steps, --lr-decay-power)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from recsz.config import parse_train_args
from recsz.model.rowopt import RowOptimizer
from recsz.model.schedule import LRSchedule, ScheduledRates
from recsz.model.ttrec import TTTables
from recsz.train import main


def test_the_factors_are_the_reference_dlrms() -> None:
    """Warm-up from 1/W, the whole rate until the decay, a square decay, then its last."""
    s = LRSchedule(warmup=4, decay_start=6, decay_steps=4)
    got = [s.factor(k) for k in range(12)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 0.5625, 0.25, 0.0625, 0.0625, 0.0625]
    assert LRSchedule().constant and all(LRSchedule().factor(k) == 1.0 for k in range(5))
    assert LRSchedule(decay_start=2, decay_steps=2, power=1.0).factor(3) == 0.5


@given(
    warmup=st.integers(0, 50),
    gap=st.integers(0, 50),
    decay=st.integers(0, 50),
    power=st.floats(0.5, 3.0),
)
def test_the_factor_rises_holds_and_falls_and_never_reaches_zero(
    warmup: int, gap: int, decay: int, power: float
) -> None:
    s = LRSchedule(warmup, warmup + gap, decay, power)
    f = [s.factor(k) for k in range(warmup + gap + decay + 5)]
    assert all(0 < x <= 1 for x in f)
    top = warmup + gap + (1 if decay else 0)  # the first step of the decay is still 1
    assert f[:top] == sorted(f[:top]) and f[top - 1 if top else 0] == 1.0
    assert f[top:] == sorted(f[top:], reverse=True)


def test_a_decay_before_the_warm_up_ends_is_refused() -> None:
    with pytest.raises(ValueError, match="before the warm-up"):
        LRSchedule(warmup=10, decay_start=5, decay_steps=3)
    with pytest.raises(ValueError, match="before the warm-up"):
        parse_train_args(["--lr-warmup-steps", "10", "--lr-decay-steps", "3"])
    with pytest.raises(ValueError, match="--lr-decay-power must be > 0"):
        parse_train_args(["--lr-decay-power", "0"])
    graph = ["--device", "cuda", "--cuda-graph", "--no-id-dedup", "--no-bwd-coalesce"]
    with pytest.raises(ValueError, match="cannot run with a learning-rate schedule"):
        parse_train_args([*graph, "--lr-warmup-steps", "3"])  # rates held in its kernels


def test_every_optimizer_takes_the_factor_of_its_own_rate() -> None:
    rows = RowOptimizer("rowwise_adagrad", 0.2)
    a = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    b = torch.optim.Adagrad(
        [
            {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.3},
            {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.05},
        ]
    )
    rates = ScheduledRates(LRSchedule(warmup=4), rows, [a, b])
    b.param_groups[0]["lr"] = 99.0  # as a checkpoint's state would (its step's rate)
    assert rates.at(1) == 0.5
    assert rows.lr == pytest.approx(0.1)
    assert [g["lr"] for o in (a, b) for g in o.param_groups] == pytest.approx([0.05, 0.15, 0.025])
    rates.at(10)
    assert rows.lr == 0.2 and [g["lr"] for g in b.param_groups] == [0.3, 0.05]


def test_tt_cores_optimizers_are_there_to_schedule() -> None:
    cfg = parse_train_args(["--tt-tables", "2"])
    spec = cfg.tt_spec()
    assert spec is not None
    tt = TTTables(cfg.model(), sorted(spec.tables), 0, RowOptimizer("sgd", 0.1), spec)
    assert len(tt.optimizers) == 2 * 3  # a core each
    assert all(o.param_groups[0]["lr"] == 0.1 for o in tt.optimizers)


BASE = ["--steps", "3", "--batch-size", "64", "--synthetic-eval", "512", "--no-progress",
        "--log-every", "1", "--emb-optimizer", "sgd", "--lr", "0.2",
        "--emb-lr", "0.08"]  # fmt: skip


def _run(out: Path, *extra: str) -> tuple[dict, list[dict]]:
    assert main([*BASE, "--out", str(out), *extra]) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), [r for r in rows if "loss" in r]


def test_a_constant_stretch_trains_as_the_rate_it_is_at(tmp_path: Path) -> None:
    """The first step of a 4-step warm-up trains as the plain rates times 1/4 do, the MLPs'
    and the tables' alike (bit for bit); before a decay starts, the whole rates train."""
    warm, rows = _run(tmp_path / "warm", "--steps", "1", "--lr-warmup-steps", "4")
    plain, _ = _run(tmp_path / "plain", "--steps", "1", "--lr", "0.05", "--emb-lr", "0.02")
    other, _ = _run(tmp_path / "other", "--steps", "1")
    assert rows[0]["lr_factor"] == 0.25
    assert warm["auc"] == plain["auc"] and warm["logloss"] == plain["logloss"]
    assert warm["logloss"] != other["logloss"]  # the rate matters here
    decay, rows = _run(tmp_path / "decay", "--lr-decay-start", "3", "--lr-decay-steps", "2")
    none, _ = _run(tmp_path / "none")
    assert [r["lr_factor"] for r in rows] == [1.0, 1.0, 1.0]
    assert decay["logloss"] == none["logloss"]


def test_a_resumed_run_trains_at_the_straight_runs_rates(tmp_path: Path) -> None:
    """Checkpointed inside the warm-up (the optimizers' saved states hold that step's
    rates), the resumed run goes on at the schedule's, as the straight one did."""
    sched = ["--steps", "8", "--lr-warmup-steps", "6", "--lr-decay-start", "6",
             "--lr-decay-steps", "4", "--dense-optimizer", "adagrad"]  # fmt: skip
    straight, rows = _run(tmp_path / "straight", *sched)
    split = tmp_path / "split"
    _run(split, *sched, "--steps", "3", "--checkpoint-every", "3")
    assert main([*BASE, *sched, "--resume", str(split)]) == 0
    resumed = json.loads((split / "summary.json").read_text())
    again = [json.loads(r) for r in (split / "metrics.jsonl").read_text().splitlines()]
    again = [r for r in again if "loss" in r]
    assert [r["lr_factor"] for r in again] == [r["lr_factor"] for r in rows]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in rows], abs=1e-7)
    assert resumed["auc"] == pytest.approx(straight["auc"], abs=1e-9)
