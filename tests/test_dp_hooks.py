"""The MLP gradients' hooks without ranks: the error-bounded hook's bound, its error
feedback and its lossless case, on one rank (no collective)."""

from __future__ import annotations

import torch

from recsz.codecs import get_codec
from recsz.comm.dp_hooks import DPComm, EBState, _eb_exchange

PARAMS = [torch.nn.Parameter(torch.zeros(n)) for n in (600, 400, 300)]


class Bucket:
    """The parts of DDP's GradBucket the hook reads: a flat buffer over parameters."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g
        self.params = [PARAMS[0], PARAMS[1]] if g.numel() == 1000 else [PARAMS[2]]

    def buffer(self) -> torch.Tensor:
        return self.g

    def parameters(self) -> list[torch.Tensor]:
        return self.params


def residual(dp: DPComm) -> torch.Tensor:
    return torch.cat([dp.inner.residual[k] for k in sorted(dp.inner.residual)])


def eb_state(codec: str, eb: float = 0.01) -> DPComm:
    return DPComm("eb", 1, inner=EBState(get_codec(codec), eb))


def test_eb_hook_keeps_the_bound_and_feeds_back_the_error() -> None:
    dp = eb_state("hybrid", 0.05)
    g1 = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out1 = _eb_exchange(dp, Bucket(g1.clone())).value()
    eb = 0.05 * float(g1.max() - g1.min())
    assert float((out1 - g1).abs().max()) <= eb
    res = residual(dp)
    torch.testing.assert_close(res, g1 - out1, rtol=0, atol=0)  # what was lost is kept
    assert float(res.abs().max()) > 0
    # The next step sends gradient + residual: over two steps the sum of what was sent
    # equals the sum of the gradients up to the last residual only (no accumulation).
    g2 = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    out2 = _eb_exchange(dp, Bucket(g2.clone())).value()
    torch.testing.assert_close(out1 + out2 + residual(dp), g1 + g2, rtol=0, atol=1e-5)
    assert dp.bytes_sent < 0.5 * 2 * 1000 * 4


def test_eb_hook_with_a_lossless_codec_is_exact() -> None:
    dp = eb_state("zstd")
    g = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_eb_exchange(dp, Bucket(g.clone())).value(), g)
    assert float(residual(dp).abs().max()) == 0.0


def test_checkpoint_state_round_trip() -> None:
    dp = eb_state("hybrid")
    _eb_exchange(dp, Bucket(torch.randn(300)))
    again = eb_state("hybrid")
    again.load_state_dict(dp.state_dict())
    assert torch.equal(residual(again), residual(dp))
    assert again.bytes_sent == dp.bytes_sent
