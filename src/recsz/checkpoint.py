"""Checkpoints: each rank saves what it owns; a marker written last makes one complete.

Layout: RUN/checkpoints/step-000120/{rank-0.pt, rank-1.pt, ..., meta.json}. Every file is
written under a temporary name and renamed, and rank 0 writes ``meta.json`` only after
all ranks have renamed theirs (a barrier), so a crash mid-write leaves a directory
without ``meta.json``, which :func:`load` ignores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from recsz.config import TrainConfig
    from recsz.ranks import Ranks
    from recsz.train import Parts

# Fields that may differ between the run that saved and the run that resumes.
_MAY_CHANGE = {
    "steps",
    "resume",
    "out",
    "progress",
    "eval_every",
    "log_every",
    "nproc",
    "checkpoint_every",
    "check_bounds",
    "dist_timeout",
    "prefetch",
    "device",  # a run may move between CPU and GPU (the state is mapped on load)
}


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(out: Path, parts: Parts, cfg: TrainConfig, ranks: Ranks, step: int) -> Path:
    d = out / "checkpoints" / f"step-{step:09d}"
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "rank": ranks.rank,
        "tables": parts.sparse.tables,
        "sparse": parts.sparse.state_dict(),
        "dense": parts.dense_module.state_dict(),
        "dense_opt": parts.dense_opt.state_dict(),
        "policies": {k: p.state_dict() for k, p in parts.exchange.policies.items()},
        "torch_rng": torch.get_rng_state(),
        "dct_dp": _dct_state(parts),
    }
    _atomic_save(state, d / f"rank-{ranks.rank}.pt")
    ranks.barrier()
    if ranks.rank == 0:
        meta = {"step": step, "world_size": ranks.world, "config": cfg.to_dict()}
        tmp = d / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, d / "meta.json")
    ranks.barrier()
    return d


def _dct_state(parts: Parts) -> dict[str, Any] | None:
    """DCT-DP residuals and thresholds: resuming without them would change the run."""
    d = parts.dct
    if d is None:
        return None
    return {
        "step": d.step,
        "residual": d.residual,
        "threshold": d.threshold,
        "refreshed_at": d.refreshed_at,
        "refreshes": d.refreshes,
    }


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    base = run_dir / "checkpoints"
    if not base.is_dir():
        return None
    done = sorted(p for p in base.iterdir() if (p / "meta.json").exists())
    return done[-1] if done else None


def load(run_dir: Path, parts: Parts, cfg: TrainConfig, ranks: Ranks) -> int:
    """Restore this rank's state from the newest complete checkpoint; return its step."""
    d = latest(run_dir)
    if d is None:
        raise FileNotFoundError(
            f"--resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}"
        )
    meta = json.loads((d / "meta.json").read_text())
    if meta["world_size"] != ranks.world:
        raise ValueError(
            f"checkpoint {d} was written by {meta['world_size']} ranks, this job "
            f"has {ranks.world}; resume with --nproc {meta['world_size']}"
        )
    saved, now = meta["config"], cfg.to_dict()
    diff = sorted(k for k in now if k not in _MAY_CHANGE and saved.get(k) != now[k])
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in diff)
        raise ValueError(f"checkpoint {d} was written with another configuration ({detail})")
    state = torch.load(d / f"rank-{ranks.rank}.pt", weights_only=False, map_location=ranks.device)
    if state["tables"] != parts.sparse.tables:
        raise ValueError(
            f"checkpoint {d}: rank {ranks.rank} held tables {state['tables']}, "
            f"the plan now gives it {parts.sparse.tables}"
        )
    parts.sparse.load_state_dict(state["sparse"])
    parts.dense_module.load_state_dict(state["dense"])
    parts.dense_opt.load_state_dict(state["dense_opt"])
    for k, p in parts.exchange.policies.items():
        p.load_state_dict(state["policies"][k])
    torch.set_rng_state(state["torch_rng"].cpu())  # map_location may have moved it
    if parts.dct is not None and state.get("dct_dp"):
        for k, v in state["dct_dp"].items():
            setattr(parts.dct, k, v)
    return int(meta["step"])
