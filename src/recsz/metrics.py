"""The held-out numbers of predicted click probabilities: exact ROC AUC, logloss,
accuracy, normalized entropy and calibration, computed where the predictions are (a GPU's
memory or the host's) with one sort and no read of the host until the numbers.

The AUC is exact, ties included: the probability that a positive scores above a negative,
equal scores counting a half, which is what scikit-learn's ``roc_auc_score`` computes (the
area under the curve through every distinct threshold); its numerator is a sum of integer
counts, so it is exact up to the one final division. The logloss is scikit-learn's
``log_loss`` of probabilities clipped to [1e-7, 1 - 1e-7]. Both are tested against
scikit-learn; on the CPU this takes 2.2-3x less time than scikit-learn did
(benchmarks/README.md, "Evaluation"), and on a GPU the predictions never leave it.

The normalized entropy (NE, the measure of He et al. 2014 that TorchRec's ``NEMetric``
reports for click models) is the logloss over the entropy of the set's click rate: what a
model knows beyond the rate, 1 for a model that predicts the rate alone, lower is better;
the calibration is the predicted clicks over the clicks (the mean prediction over the
rate), 1 where the model predicts as many clicks as there are.
"""

from __future__ import annotations

import torch

#: Probabilities are clipped to [LOGLOSS_CLIP, 1 - LOGLOSS_CLIP] for the logloss.
LOGLOSS_CLIP = 1e-7


#: What :func:`binary_metrics` gives, in this order.
NUMBERS = ("auc", "logloss", "accuracy", "ne", "calibration", "ctr")


def binary_metrics(p: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """``auc``, ``logloss``, ``accuracy``, ``ne`` (normalized entropy), ``calibration`` and
    ``ctr`` (the click rate) of probabilities ``p`` against labels ``y`` (0 or 1), both of
    shape (N,) on one device. The AUC and NE are NaN where ``y`` holds one class only
    (undefined), the calibration where it holds no click; all but the rate are NaN where a
    probability is NaN (a diverged model) rather than numbers that mean nothing."""
    if p.dim() != 1 or p.shape != y.shape:
        raise ValueError(f"predictions {tuple(p.shape)} and labels {tuple(y.shape)} must be (N,)")
    if p.numel() == 0:
        raise ValueError("no samples to evaluate")
    pos = y > 0.5
    q = p.double().clamp(LOGLOSS_CLIP, 1 - LOGLOSS_CLIP)
    logloss = -torch.where(pos, q.log(), (-q).log1p()).mean()
    accuracy = ((p > 0.5) == pos).double().mean()
    clicks = pos.double().sum()
    ctr = clicks / p.numel()
    entropy = -(torch.xlogy(ctr, ctr) + torch.xlogy(1 - ctr, 1 - ctr))  # 0: one class
    nan = torch.full((), float("nan"), dtype=torch.float64, device=p.device)
    ne = torch.where(entropy > 0, logloss / entropy, nan)
    calibration = torch.where(clicks > 0, p.double().sum() / clicks, nan)
    out = torch.stack([_auc(p, pos), logloss, accuracy, ne, calibration])
    out = torch.cat([out.where(~torch.isnan(p).any(), nan), ctr[None]])
    return dict(zip(NUMBERS, out.tolist(), strict=True))  # the one host read


def _auc(p: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Exact AUC as a float64 scalar on ``p``'s device (NaN with one class). Sorted by
    score, a positive at i in a run of equal scores [start, stop) is above the negatives
    before ``start`` and ties with those in the run: twice its share is
    neg[start] + neg[stop] (neg[k]: negatives among the first k), an integer."""
    n = p.numel()
    scores, order = torch.sort(p)
    neg = ~pos[order]
    below = torch.zeros(n + 1, dtype=torch.int64, device=p.device)
    torch.cumsum(neg, 0, out=below[1:])
    i = torch.arange(n, device=p.device)
    first = torch.ones(n, dtype=torch.bool, device=p.device)  # where a run of equal scores starts
    first[1:] = scores[1:] != scores[:-1]
    start = torch.cummax(torch.where(first, i, 0), 0).values
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    stop = torch.where(last, i + 1, n).flip(0).cummin(0).values.flip(0)
    twice = ((below[start] + below[stop]) * ~neg).sum()
    negatives = below[n]
    positives = n - negatives
    return twice.double() / (2.0 * positives.double() * negatives.double())
