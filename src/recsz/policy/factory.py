"""Build the policy a training config asks for, per direction."""

from __future__ import annotations

from typing import TYPE_CHECKING

from recsz.codecs import get_codec
from recsz.policy.base import BoundPolicy, FixedBound

if TYPE_CHECKING:
    from recsz.config import TrainConfig


def make_policy(cfg: TrainConfig, direction: str, n_tables: int) -> BoundPolicy:
    """The bound policy of ``direction`` ("fwd" or "bwd"); none for unbounded codecs."""
    codec = get_codec(cfg.fwd_codec if direction == "fwd" else cfg.bwd_codec)
    if codec.threshold:
        from recsz.policy.dct import DCTThreshold

        return DCTThreshold(cfg.dct_keep, cfg.dct_refresh)
    if not codec.error_bounded or cfg.eb_policy == "none":
        return BoundPolicy()
    eb = cfg.fwd_eb if direction == "fwd" else cfg.bwd_eb
    if cfg.eb_policy == "fixed":
        return FixedBound(eb, cfg.eb_mode)
    from recsz.policy.adaptive import make_adaptive

    return make_adaptive(cfg, direction, n_tables)
