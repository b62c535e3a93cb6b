"""The compressed dists' state in a checkpoint: what :class:`CompressedEBCSharder`'s modules
write into ``dmp.state_dict()`` (``get_extra_state``) and read back.

Each dist's step count (the bound decay's clock and the probe windows'), its bound
policies' state (the classes the homogenization index chose, a window's counts), its byte
counters and its layout (which tables it carries, where: the dist's ``layout``); this
rank's, marked with it; and the module's ``compress="auto"`` switch (its batches, way,
trials and schedule). Where the sharding plan changed since (TorchRec reshards tables on a
``torch.distributed.checkpoint`` load), the step counts alone are restored. One JSON
blob: a checkpointer that flattens nested state (``torch.distributed.checkpoint``) sees one
value of one shape on every rank.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from recsz.torchrec.dist import CompressedPooledEmbeddingDist

#: the version of what :func:`dump` writes
VERSION = 1


def dump(
    dists: list[CompressedPooledEmbeddingDist], rank: int, switch: dict[str, Any] | None = None
) -> bytes:
    """``dists``' state (a module's, in its shardings' order) on ``rank``, and its
    ``--compress auto`` switch's (the same on every rank: the ranks agree on its way)."""
    state = {"recsz": VERSION, "rank": rank, "dists": [_dist_state(d) for d in dists]}
    if switch is not None:
        state["switch"] = switch
    return json.dumps(state, default=float).encode()


def load(
    dists: list[CompressedPooledEmbeddingDist], saved: Any, rank: int
) -> dict[str, Any] | None:
    """Restore :func:`dump`'s state into ``dists`` on ``rank``, and give the switch's
    (None: a blob written without it); ValueError naming the rank
    and what does not fit (another version, a damaged blob). Another rank's (a checkpointer
    that keeps one copy of what is not a tensor, as ``torch.distributed.checkpoint`` does),
    or one written under another sharding plan (a dist's layout differs, or their number),
    gives the step counts only (every dist's are the same), with a warning: the policies
    then probe their tables anew from that step (:meth:`BoundPolicy.probe_again`)."""
    try:
        state = json.loads(bytes(saved))
    except (TypeError, ValueError) as e:
        raise ValueError(f"recsz: rank {rank}: the checkpoint's sharder state: {e}") from e
    if not isinstance(state, dict) or state.get("recsz") != VERSION:
        raise ValueError(
            f"recsz: rank {rank}: the checkpoint's sharder state is not version {VERSION} "
            f"(got {state.get('recsz') if isinstance(state, dict) else type(state).__name__})"
        )
    saved_dists = state.get("dists")
    if not isinstance(saved_dists, list) or not all(
        isinstance(one, dict) and "step" in one for one in saved_dists
    ):
        raise ValueError(
            f"recsz: rank {rank}: the checkpoint's sharder state holds no list of dists, "
            "each with its step count (damaged?)"
        )
    replanned = len(saved_dists) != len(dists) or any(
        one.get("layout", d.layout) != d.layout for d, one in zip(dists, saved_dists, strict=False)
    )
    mine = state["rank"] == rank and not replanned
    if replanned:
        warnings.warn(
            f"recsz: rank {rank}: the sharding plan changed since the checkpoint (its "
            "compressed dists carry other tables): the step counts are restored, the "
            "bound policies probe their tables anew",
            stacklevel=3,
        )
        steps = {int(one["step"]) for one in saved_dists}
        saved_dists = [{"step": max(steps, default=0)}] * len(dists)
    elif not mine:
        warnings.warn(
            f"recsz: rank {rank} loads rank {state['rank']}'s sharder state: the step "
            "counts are restored, this rank's bound policies probe its tables anew",
            stacklevel=3,
        )
    for i, (d, one) in enumerate(zip(dists, saved_dists, strict=True)):
        try:
            _load_dist_state(d, one, whole=mine)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"recsz: rank {rank}: compressed dist {i}'s state: {e}") from e
    switch = state.get("switch")
    if switch is not None and not isinstance(switch, dict):
        raise ValueError(f"recsz: rank {rank}: the checkpoint's switch state is not an object")
    return switch


def _dist_state(d: CompressedPooledEmbeddingDist) -> dict[str, Any]:
    """One dist's state (:func:`dump`)."""
    return {
        "step": d.step,
        "policies": {x.name: x.policy.state_dict() for x in (d.fwd, d.bwd)},
        "counters": {
            "raw": dict(d.raw),
            "wire": dict(d.wire),
            "between": dict(d.between),
            "max_err": dict(d.max_err),
        },
        "layout": d.layout,
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
        for k in ("raw", "wire", "between", "max_err"):
            getattr(d, k).update(state["counters"].get(k, {}))  # (between: since 2026-12)
    d.step = step
