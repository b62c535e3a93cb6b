"""TorchRec's table-row-wise and grid output dists with their hop between hosts compressed.

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
reduce-scatter's backward (an all-gather within the host) takes them from there. Grid
sharding (``GridPooledEmbeddingDist``: a table's columns split over hosts, each column
shard table-row-wise within its host) takes the same two hops, and the same dist.

Bags of one content travel once between hosts, as in the table-wise dist: the sample owner
emptied every repeat before TorchRec's input dist, so a content's ids reach only its first
bag, and the host's reduced row of any other bag is zero. Which bags hold ids (what the
sender picks) is known to no one rank of the host, each seeing the ids of its rows only:
each rank's count of ids a bag rides along the reduce-scatter as one more column a
feature, summed with the partial sums (exact: small integers). Variable batch per feature
goes through TorchRec's dist, uncompressed, with a warning.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import nn
from torchrec.distributed.sharding.grid_sharding import GridPooledEmbeddingDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from recsz.config import TrainConfig
from recsz.torchrec.dist import CompressedPooledEmbeddingDist
from recsz.torchrec.handover import lookup_lengths, missing_ids, theirs, weights_learn


class CompressedTwRwDist(nn.Module):
    """Drop-in for TorchRec's ``TwRwPooledEmbeddingDist`` and ``GridPooledEmbeddingDist``
    (grid sharding: column shards over hosts, each table-row-wise within its host, the same
    two hops): TorchRec's reduce-scatter within the host, then :attr:`cross`, our
    compressed all-to-all between hosts.

    Args:
        inner: the dist TorchRec built for this sharding (its process groups and layout are
            read here; it serves variable batch per feature, uncompressed).
        config: codecs and bound policies (the fields of :class:`recsz.config.TrainConfig`).
    """

    def __init__(
        self, inner: TwRwPooledEmbeddingDist | GridPooledEmbeddingDist, config: TrainConfig
    ) -> None:
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
                # grid: the column shards' permutation, after the all-to-all
                callbacks=getattr(inner, "_callbacks", None),
            ),
            config,
        )
        self.rank = inner._rank
        #: the ids this sharding's lookup took in the step (the sharder's hook)
        self.seen: dict[str, Any] = {}

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Any = None) -> Awaitable:
        if (stock := theirs(self, local_embs, sharding_ctx)) is not None:
            return stock
        assert self.reduce_scatter is not None  # made in __init__
        local, hosts = self.intra_pg.size(), self.cross.world
        per_rank = list(getattr(sharding_ctx, "batch_size_per_rank", None) or [])
        cross_ctx = SimpleNamespace(
            variable_batch_per_feature=False,
            batch_size_per_rank=None,
            recsz_merge=getattr(sharding_ctx, "recsz_merge", None),
            recsz_learns=weights_learn(self.seen),
        )
        splits: dict[str, Any] = {}
        if len(set(per_rank)) > 1:
            # each local rank's samples from every host, in host order (TorchRec's order)
            by_cross, splits["input_splits"] = self.inner._preprocess_batch_size_per_rank(
                local, hosts, per_rank
            )
            cross_ctx.batch_size_per_rank = by_cross[self.rank % local]
        if cross_ctx.recsz_merge is None:  # every bag travels
            return self.cross(self.reduce_scatter(local_embs, **splits).wait(), cross_ctx)
        width, features, n = (
            local_embs.shape[1],
            len(self.cross.dims[self.cross.rank]),
            len(local_embs),
        )
        lengths = lookup_lengths(self.seen, features, n)
        if lengths is None:
            raise missing_ids(self.cross.who, features, n)
        # This rank's ids a bag ride along, summed with the partial sums: the host's
        counts = lengths.to(local_embs)
        reduced = self.reduce_scatter(torch.cat([local_embs, counts], 1), **splits).wait()
        self.cross.seen["lookup"] = _Lengths(reduced[:, width:].detach())
        return self.cross(reduced[:, :width], cross_ctx)


class _Lengths(NamedTuple):
    """What the cross dist reads of a lookup's input (:meth:`_filled`): ids a bag, here the
    host's (reduced rows, features), laid out as a KeyedJaggedTensor's lengths."""

    counts: torch.Tensor

    def lengths(self) -> torch.Tensor:
        return self.counts.t().reshape(-1)
