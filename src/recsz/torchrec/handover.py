"""What a compressed dist learns of its step beside the pooled embeddings, from the sharded
module (``sharder.py``): the ids its sharding's lookup took (``seen["lookup"]``, put there by
a hook on the lookup), and in TorchRec's per-batch sharding context how the sample owners
merged their bags (``recsz_merge``, ``rows.py``) and whether the step is TorchRec's
(``recsz_plain``: ``compress="auto"``'s switch sent it plain); and what it hands back to
TorchRec: the awaitable of the rows it received (:class:`Received`)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torchrec.distributed.types import Awaitable

from recsz.comm.overlap import tie_backward

if TYPE_CHECKING:
    from recsz.comm.exchange import PendingBytes
    from recsz.torchrec.dist import CompressedPooledEmbeddingDist, Context


def lookup_lengths(seen: dict[str, Any], f: int, n: int) -> torch.Tensor | None:
    """(n, f): ids a bag of the step's lookup (``seen["lookup"]``, which the sharder's hook
    hands over, taken here); None where it is missing or laid out otherwise."""
    lookup = seen.pop("lookup", None)
    if lookup is None or lookup.lengths().numel() != n * f:
        return None
    return lookup.lengths().view(f, n).t()


def weights_learn(seen: dict[str, Any]) -> bool:
    """Whether the step's lookup (``seen["lookup"]``) took per-id weights that learn
    (TorchRec's feature processors, whose parameters DDP reduces): the gradient's exchange
    then runs within the backward pass, not after it (:func:`recsz.comm.overlap.tie_backward`)."""
    lookup: Any = seen.get("lookup")
    weights = getattr(lookup, "weights_or_none", lambda: None)()
    return weights is not None and weights.requires_grad


def missing_ids(who: str, f: int, n: int) -> ValueError:
    """The error of a dist whose sample owners merged their bags but that lacks the ids."""
    return ValueError(
        f"{who}: the lookup's ids of this step are missing or not {f} features x {n} "
        "samples; the sample owners merged their bags against them"
    )


def theirs(owner: Any, local_embs: torch.Tensor, ctx: Any) -> Awaitable | None:
    """TorchRec's own dist (``owner.inner``) for a step that is not ours: one the sharded
    module's switch sends plain (``--compress auto``: ``ctx.recsz_plain``, the bags left
    unmerged), or where the batch varies per feature (uncompressed, with one warning an
    owner); None otherwise. The steps it carries are not ours to count: the policies' clock
    (``owner.step``) counts the compressed ones."""
    if ctx is None:
        return None
    if getattr(ctx, "recsz_plain", False):
        owner.seen.pop("lookup", None)  # its ids are not read
        return owner.inner(local_embs, ctx)
    if not ctx.variable_batch_per_feature:
        return None
    if not getattr(owner, "warned_variable_batch", False):
        msg = "recsz: variable batch per feature is sent uncompressed (TorchRec's dist)"
        warnings.warn(msg, stacklevel=3)
        owner.warned_variable_batch = True
    return owner.inner(local_embs, ctx)


class Received(Awaitable[torch.Tensor]):
    """The forward in flight; waiting decodes it into a tensor whose gradient is sent back
    while the rest of the backward pass runs (:func:`recsz.comm.overlap.tie_backward`;
    ``defer=False``: within it)."""

    def __init__(
        self,
        local_embs: torch.Tensor,
        owner: CompressedPooledEmbeddingDist,
        pending: PendingBytes,
        step: int,
        per_rank: list[int],
        ctx: Context,
        defer: bool,
    ) -> None:
        super().__init__()
        self.args = (local_embs, owner, pending, step, per_rank, ctx, defer)

    def _wait_impl(self) -> torch.Tensor:
        local_embs, owner, pending, step, per_rank, ctx, defer = self.args
        hold = local_embs.requires_grad and torch.is_grad_enabled()  # a backward follows
        received = owner.finish_forward(pending, per_rank, hold, ctx).to(local_embs.dtype)
        return tie_backward(
            received,
            local_embs,
            lambda grad: owner.start_backward(grad, step, ctx),
            lambda sent: owner.finish_backward(sent, per_rank, ctx).to(local_embs.dtype),
            defer,
        )
