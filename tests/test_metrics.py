"""The held-out numbers (recsz.metrics) against scikit-learn's, ties and edge cases included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, roc_auc_score

from recsz.metrics import LOGLOSS_CLIP, binary_metrics


def sklearn_numbers(p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """What the trainer computed before: scikit-learn on float64 copies; the NE (the
    logloss over the logloss of predicting the click rate alone, by scikit-learn too) and
    the calibration by their definitions."""
    pd, yd = p.astype(np.float64), y.astype(np.float64)
    both = len(np.unique(yd)) == 2
    auc = float(roc_auc_score(yd, pd)) if both else float("nan")
    clipped = np.clip(pd, LOGLOSS_CLIP, 1 - LOGLOSS_CLIP)
    logloss = float(log_loss(yd, clipped, labels=[0.0, 1.0]))
    ctr = float(yd.mean())
    rate_alone = float(log_loss(yd, np.full_like(yd, ctr), labels=[0.0, 1.0])) if both else 0.0
    return {
        "auc": auc,
        "logloss": logloss,
        "accuracy": float(((pd > 0.5) == (yd > 0.5)).mean()),
        "ne": logloss / rate_alone if both else float("nan"),
        "calibration": float(pd.sum() / yd.sum()) if yd.sum() > 0 else float("nan"),
        "ctr": ctr,
    }


def check(p: np.ndarray, y: np.ndarray) -> None:
    got = binary_metrics(torch.from_numpy(p), torch.from_numpy(y))
    want = sklearn_numbers(p, y)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    levels=st.sampled_from([2, 3, 17, 0]),  # 0: continuous scores; else scores on a grid
    click_rate=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    extremes=st.booleans(),
)
def test_the_numbers_equal_scikit_learns(
    n: int, levels: int, click_rate: float, seed: int, extremes: bool
) -> None:
    """Any scores (runs of equal ones, exactly 0 and 1, one class, one sample) and labels:
    the AUC (ties counted a half), logloss (clipped) and accuracy scikit-learn gives, and
    the NE and calibration by their definitions."""
    g = np.random.default_rng(seed)
    p = g.random(n).astype(np.float32)
    if levels:
        p = (np.floor(p * levels) / (levels - 1 if levels > 1 else 1)).astype(np.float32)
    if extremes:
        p[g.random(n) < 0.2] = 0.0
        p[g.random(n) < 0.2] = 1.0
    y = (g.random(n) < click_rate).astype(np.float32)
    check(p, y)


def test_a_large_set_with_many_ties_equals_scikit_learn() -> None:
    g = np.random.default_rng(0)
    y = (g.random(200_000) < 0.25).astype(np.float32)
    z = g.normal(size=y.size) + y
    p = (np.round(1 / (1 + np.exp(-z)), 3)).astype(np.float32)  # ~1000 distinct scores
    check(p, y)


def test_the_auc_is_the_share_of_pairs_ordered_right() -> None:
    """By its definition, on a hand-made case: of 2 x 3 (positive, negative) pairs, 4 are
    ordered right and 2 tie, so 5/6."""
    p = torch.tensor([0.1, 0.4, 0.4, 0.8, 0.4])
    y = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])
    assert binary_metrics(p, y)["auc"] == pytest.approx(5 / 6, abs=1e-15)


def test_one_class_or_nan_predictions_give_nan_not_a_number_that_means_nothing() -> None:
    ones = torch.ones(5)
    assert math.isnan(binary_metrics(torch.rand(5), ones)["auc"])
    p = torch.tensor([0.2, float("nan"), 0.7])
    got = binary_metrics(p, torch.tensor([0.0, 1.0, 1.0]))
    assert got.pop("ctr") == pytest.approx(2 / 3)  # the labels' rate is still known
    assert all(math.isnan(v) for v in got.values()), got
    none = binary_metrics(torch.rand(4), torch.zeros(4))  # no click
    assert math.isnan(none["ne"]) and math.isnan(none["calibration"]) and none["ctr"] == 0
    # the run's summary and recsz evaluate say why the AUC is NaN there, not after a NaN model
    from recsz.report import one_class

    assert one_class({**none, "eval_samples": 4}) == (
        "(undefined: the 4 held-out samples hold no click)"
    )
    assert one_class({**binary_metrics(torch.rand(5), ones), "eval_samples": 5}).endswith(
        "hold only clicks)"
    )
    assert one_class({**got, "ctr": 2 / 3, "eval_samples": 3}) == ""


def test_predicting_the_click_rate_is_ne_one_and_calibrated() -> None:
    """The definition's anchors: a model that predicts the set's click rate for every
    sample has NE 1 and calibration 1; one that predicts twice the rate, calibration 2."""
    y = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    got = binary_metrics(torch.full((8,), 0.25), y)
    assert got["ne"] == pytest.approx(1.0, rel=1e-12) and got["calibration"] == pytest.approx(1)
    assert binary_metrics(torch.full((8,), 0.5), y)["calibration"] == pytest.approx(2.0)


def test_bad_shapes_and_an_empty_set_are_refused() -> None:
    with pytest.raises(ValueError, match="must be"):
        binary_metrics(torch.rand(4), torch.rand(5))
    with pytest.raises(ValueError, match="must be"):
        binary_metrics(torch.rand(2, 2), torch.rand(2, 2))
    with pytest.raises(ValueError, match="no samples"):
        binary_metrics(torch.empty(0), torch.empty(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_numbers_are_the_cpus() -> None:
    g = torch.Generator().manual_seed(3)
    y = (torch.rand(1 << 20, generator=g) < 0.25).float()
    p = torch.sigmoid(torch.randn(1 << 20, generator=g) + y).mul(1e4).round().div(1e4)
    cpu, gpu = binary_metrics(p, y), binary_metrics(p.cuda(), y.cuda())
    assert cpu["auc"] == gpu["auc"]  # integer counts: exactly
    assert gpu["logloss"] == pytest.approx(cpu["logloss"], rel=1e-12)
    assert gpu["accuracy"] == cpu["accuracy"]
    for k in ("ne", "calibration", "ctr"):
        assert gpu[k] == pytest.approx(cpu[k], rel=1e-12), k
