"""TorchRec's table-row-wise output dist with its hop between hosts compressed.

A table-row-wise table (``TwRwPooledEmbeddingDist``; TorchRec's planner's choice for large
tables on several hosts) has its rows split over the ranks of one host. Its output dist
reduce-scatters the host's partial sums within the host (the fast link: NVLink on a GPU
node), then sends each sample owner its rows by an all-to-all between hosts, among the
ranks of one local rank (the slow link). :class:`CompressedTwRwDist` keeps TorchRec's
reduce-scatter (its quantized comms too, where given) and sends the all-to-all between
hosts through our table-wise dist (:class:`CompressedPooledEmbeddingDist`, on TorchRec's
cross-host process group, a host's features standing for a rank's): the partial sums
are added exactly within the host, so every element of what a sample owner receives is
within its bound of the pooled sum, and the gradients come back under theirs; TorchRec's
reduce-scatter's backward (an all-gather within the host) takes them from there.

Bags of one content are not merged for these tables (every bag travels): a host's bags
come through the reduce-scatter, whose rows the sample owners' merges do not follow.
Variable batch per feature goes through TorchRec's dist, uncompressed, with a warning.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from recsz.config import TrainConfig
from recsz.torchrec.dist import CompressedPooledEmbeddingDist


class CompressedTwRwDist(nn.Module):
    """Drop-in for TorchRec's ``TwRwPooledEmbeddingDist``: TorchRec's reduce-scatter within
    the host, then :attr:`cross`, our compressed all-to-all between hosts.

    Args:
        inner: the dist TorchRec built for this sharding (its process groups and layout are
            read here; it serves variable batch per feature, uncompressed).
        config: codecs and bound policies (the fields of :class:`recsz.config.TrainConfig`).
    """

    def __init__(self, inner: TwRwPooledEmbeddingDist, config: TrainConfig) -> None:
        super().__init__()
        self.inner = inner
        # TorchRec's private fields (stable since 0.x), read here only.
        self.intra_pg, cross_pg = inner._intra_pg, inner._cross_pg
        inner._create_output_dist_modules()  # TorchRec's reduce-scatter within the host
        self.reduce_scatter = inner._intra_dist
        #: the all-to-all between hosts, compressed: a host's features in a rank's place
        self.cross = CompressedPooledEmbeddingDist(
            TwPooledEmbeddingDist(
                pg=cross_pg,
                dim_sum_per_rank=inner._dim_sum_per_node,
                emb_dim_per_rank_per_feature=inner._emb_dim_per_node_per_feature,
                device=inner._device,
            ),
            config,
        )
        self.rank = inner._rank
        self._warned = False

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Any = None) -> Awaitable:
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            if not self._warned:
                warnings.warn(
                    "recsz: variable batch per feature is sent uncompressed (TorchRec's dist)",
                    stacklevel=2,
                )
                self._warned = True
            return self.inner(local_embs, sharding_ctx)
        assert self.reduce_scatter is not None  # made in __init__
        local, hosts = self.intra_pg.size(), self.cross.world
        per_rank = list(getattr(sharding_ctx, "batch_size_per_rank", None) or [])
        cross_ctx = None
        if len(set(per_rank)) > 1:
            # each local rank's samples from every host, in host order (TorchRec's order)
            by_cross, sums = self.inner._preprocess_batch_size_per_rank(local, hosts, per_rank)
            reduced = self.reduce_scatter(local_embs, input_splits=sums).wait()
            cross_ctx = SimpleNamespace(
                variable_batch_per_feature=False,
                batch_size_per_rank=by_cross[self.rank % local],
            )
        else:
            reduced = self.reduce_scatter(local_embs).wait()
        return self.cross(reduced, cross_ctx)
