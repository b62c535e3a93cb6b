"""DCT (Gupta et al. 2021): thresholds, error feedback, and the MP forward mask."""

from __future__ import annotations

import pytest
import torch

from recsz.codecs import get_codec
from recsz.comm.dct_dp import sparsify
from recsz.comm.direction import Direction
from recsz.comm.embedding import EmbeddingExchange, ShardPlan
from recsz.policy import BoundPolicy
from recsz.policy.dct import DCTThreshold, topk_threshold
from tests.reference import one_bound


def test_error_feedback_sent_plus_residual_is_the_accumulated_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    residual = torch.zeros(1000)
    total_grad = torch.zeros(1000)
    total_sent = torch.zeros(1000)
    thr = None
    for _step in range(5):
        grad = torch.randn(1000, generator=g)
        total_grad += grad
        acc = grad + residual
        thr = topk_threshold(acc, 0.05) if thr is None else thr
        idx, vals, residual = sparsify(acc, thr)
        total_sent.index_add_(0, idx, vals)
        torch.testing.assert_close(total_sent + residual, total_grad, rtol=0, atol=1e-5)
    assert 0 < idx.numel() < 1000


def test_topk_threshold_keeps_the_fraction() -> None:
    x = torch.arange(1, 1001, dtype=torch.float32)
    thr = topk_threshold(x, 0.01)
    assert (x.abs() >= thr).sum() == 10
    assert (x.abs() >= topk_threshold(x, 1.0)).all()


def test_threshold_refreshes_only_every_l_steps() -> None:
    p = DCTThreshold(keep=0.1, refresh=3)
    small, big = torch.ones(10, 10), torch.full((10, 10), 100.0)
    t0 = one_bound(p, 0, 0, small)
    assert one_bound(p, 0, 1, big) == t0 and one_bound(p, 0, 2, big) == t0
    assert one_bound(p, 0, 3, big) == pytest.approx(100.0)
    q = DCTThreshold(keep=0.1, refresh=3)
    q.load_state_dict(p.state_dict())
    assert one_bound(q, 0, 4, small) == pytest.approx(100.0)


def test_dct_codec_drops_below_threshold_and_keeps_the_rest_exactly() -> None:
    x = torch.tensor([[0.5, -2.0, 0.1], [3.0, 0.0, -0.9]])
    c = get_codec("dct")
    y = c.decode(c.encode(x, 1.0))
    assert torch.equal(y, torch.tensor([[0.0, -2.0, 0.0], [3.0, 0.0, 0.0]]))
    assert c.error_bounded and (y - x).abs().max() < 1.0


def test_mp_backward_uses_the_forward_mask() -> None:
    """Gradients reach the table only for the entries the forward pass delivered."""
    ex = EmbeddingExchange(
        ShardPlan([0, 0], 1),
        0,
        Direction("fwd", get_codec("dct"), DCTThreshold(0.25, 10)),
        Direction("bwd", get_codec("dct-mask"), BoundPolicy()),
    )
    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(64, 2, 4, generator=g).requires_grad_()
    ids = torch.arange(128).view(64, 2)  # all distinct: no id-aware reduction here
    emb = ex.start_forward(pooled, step=0, ids=ids).wait()
    kept = emb.detach() != 0
    assert 0 < kept.sum() < kept.numel()
    emb.sum().backward()
    assert torch.equal(pooled.grad != 0, kept)
    assert ex.stats.ratio("bwd") > 1.5
