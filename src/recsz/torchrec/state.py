"""The compressed dists' state in a checkpoint: what :class:`CompressedEBCSharder`'s modules
write into ``dmp.state_dict()`` (``get_extra_state``) and read back.

Each dist's step count (the bound decay's clock and the probe windows'), its bound
policies' state (the classes the homogenization index chose, a window's counts) and its
byte counters; this rank's, marked with it. One JSON blob: a checkpointer that flattens
nested state (``torch.distributed.checkpoint``) sees one value of one shape on every rank.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from recsz.torchrec.dist import CompressedPooledEmbeddingDist

#: the version of what :func:`dump` writes
VERSION = 1


def dump(dists: list[CompressedPooledEmbeddingDist], rank: int) -> bytes:
    """``dists``' state (a module's, in its shardings' order) on ``rank``."""
    state = {"recsz": VERSION, "rank": rank, "dists": [_dist_state(d) for d in dists]}
    return json.dumps(state, default=float).encode()


def load(dists: list[CompressedPooledEmbeddingDist], saved: Any, rank: int) -> None:
    """Restore :func:`dump`'s state into ``dists`` on ``rank``; ValueError naming the rank
    and what does not fit. Another rank's (a checkpointer that keeps one copy of what is not
    a tensor, as ``torch.distributed.checkpoint`` does) gives the step counts only (every
    rank's are the same), with a warning: this rank's policies then probe its tables anew
    from that step (:meth:`BoundPolicy.probe_again`)."""
    try:
        state = json.loads(bytes(saved))
    except (TypeError, ValueError) as e:
        raise ValueError(f"recsz: rank {rank}: the checkpoint's sharder state: {e}") from e
    if (
        not isinstance(state, dict)
        or state.get("recsz") != VERSION
        or len(state.get("dists", ())) != len(dists)
    ):
        got = len(state.get("dists", ())) if isinstance(state, dict) else None
        raise ValueError(
            f"recsz: rank {rank}: the checkpoint's sharder state does not fit this module "
            f"(version {state.get('recsz') if isinstance(state, dict) else None}, {got} "
            f"compressed dists for {len(dists)}: another sharding plan?)"
        )
    mine = state["rank"] == rank
    if not mine:
        warnings.warn(
            f"recsz: rank {rank} loads rank {state['rank']}'s sharder state: the step "
            "counts are restored, this rank's bound policies probe its tables anew",
            stacklevel=3,
        )
    for i, (d, one) in enumerate(zip(dists, state["dists"], strict=True)):
        try:
            _load_dist_state(d, one, whole=mine)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"recsz: rank {rank}: compressed dist {i}'s state: {e}") from e


def _dist_state(d: CompressedPooledEmbeddingDist) -> dict[str, Any]:
    """One dist's state (:func:`dump`)."""
    return {
        "step": d.step,
        "policies": {x.name: x.policy.state_dict() for x in (d.fwd, d.bwd)},
        "counters": {"raw": dict(d.raw), "wire": dict(d.wire), "max_err": dict(d.max_err)},
    }


def _load_dist_state(d: CompressedPooledEmbeddingDist, state: dict[str, Any], whole: bool) -> None:
    """Restore :func:`_dist_state`; ``whole``: this rank's (else the step count alone).
    The policies first: a state one refuses leaves the step and counters as they were."""
    step = int(state["step"])
    for x in (d.fwd, d.bwd):
        if whole:
            x.policy.load_state_dict(state["policies"][x.name])
        else:
            x.policy.probe_again(step)
    if whole:
        for k in ("raw", "wire", "max_err"):
            getattr(d, k).update(state["counters"][k])
    d.step = step
