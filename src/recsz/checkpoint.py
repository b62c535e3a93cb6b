"""Checkpoints: each rank saves what it owns; a marker written last makes one complete.
This module reads them (and names their layout); :mod:`recsz.checkpointwrite` writes them.

Layout: RUN/checkpoints/step-000000120/{rank-0.pt, rank-1.pt, ..., meta.json}. Every file
is written under a temporary name and renamed (the temporary file is removed if the write
fails), and rank 0 writes ``meta.json`` only after all ranks have renamed theirs (a
barrier). ``meta.json`` holds the step, the world size, the configuration, its fingerprint,
the digest of every rank's file (SHA-256 of its pieces' SHA-256, hashed on several
threads: :data:`DIGEST`) and its own, so a checkpoint whose files were damaged, truncated
or swapped for another run's is refused with the file named. A directory without
``meta.json`` (a crash mid-write) is ignored. After each save only the newest
``keep_checkpoints`` complete checkpoints stay.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recsz.comm.dp_hooks import resumed_state
from recsz.comm.stats import CommStats
from recsz.model import tablestate
from recsz.model.sharding import column_shards
from recsz.runoptions import CONFIG_VERSION

if TYPE_CHECKING:
    from recsz.config import TrainConfig
    from recsz.ranks import Ranks
    from recsz.step import Parts

# Fields that may differ between the run that saved and the run that resumes ("device": a
# run may move between CPU and GPU, the state is mapped on load).
MAY_CHANGE = {
    "steps", "resume", "resume_fallback", "out", "progress", "tensorboard", "eval_every",
    "log_every", "nproc", "max_restarts", "checkpoint_every", "keep_checkpoints", "check_bounds",
    "dist_timeout",
    "prefetch", "compile", "cuda_graph", "device", "dense_dtype", "host_memory",
    "mlp_init",  # the checkpoint's weights replace the start
    "target_auc", "patience",  # when to stop, not what trains
    "inject_failure",  # where a test fails a rank, not what trains
    "profile", "profile_from",  # what is measured, not what trains
    "column_shards",  # the tables resharded into the new layout (_restore_resharded)
    "compress_scope",  # where the job runs (its hosts), as nproc
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file."""


class OtherConfiguration(CheckpointError):
    """A checkpoint written with another configuration: so is every older one of its run
    (a run resumes only with its own), so ``--resume-fallback`` does not pass it over."""


def _json_sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


#: The fields each configuration version added whose defaults keep what the version
#: before trained: a record of that version is this one's with them at their defaults, so
#: a run an upgrade finds goes on (a version not here changed what a field means: its runs
#: are others).
ADDED = {18: ("emb_dim", "bottom_mlp", "top_mlp", "max_rows"), 19: ("table_rows", "dense_features")}


def _as_of(cfg: TrainConfig, version: int | None) -> dict[str, Any]:
    """``cfg`` as a record of configuration ``version`` would hold it: without the fields
    added since that are at their defaults (:data:`ADDED`; one that is not, kept: a run the
    record cannot be); as it is where ``version`` is None, this one's, or one no record of
    goes on from."""
    now = cfg.to_dict()
    later = range((version or 0) + 1, CONFIG_VERSION + 1)  # (``cfg`` may carry the record's)
    if version is None or not later or any(v not in ADDED for v in later):
        return now
    defaults = {f.name: f.default for f in fields(cfg)}
    idle = {k for v in later for k in ADDED[v] if now[k] == defaults[k]}
    return {**{k: v for k, v in now.items() if k not in idle}, "config_version": version}


def differences(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Where ``cfg`` differs from the configuration ``saved`` (a run's record, of its own
    configuration version) in a field a resumed run must share, each as ``field: saved ->
    now``."""
    now = _as_of(cfg, saved.get("config_version"))
    return [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in sorted(now)
            if k not in MAY_CHANGE and saved.get(k) != now[k]]  # fmt: skip


def fingerprint(cfg: TrainConfig, version: int | None = None) -> str:
    """A digest of the configuration fields a resumed run must share (as a record of
    configuration ``version`` holds them: :func:`_as_of`)."""
    kept = {k: v for k, v in _as_of(cfg, version).items() if k not in MAY_CHANGE}
    return _json_sha256(kept)[:16]


#: how a rank file's digest is made (``meta.json``'s "digest"): SHA-256 over the SHA-256 of
#: each of its pieces of :data:`_PIECE` bytes, the pieces read and hashed on several threads
#: at once (hashlib leaves the GIL while it hashes). Records without it (written before)
#: hold one SHA-256 of the whole file.
DIGEST = "sha256-of-64MiB-pieces"
_PIECE = 64 << 20


def digest(path: Path, how: str | None = DIGEST) -> str:
    """``path``'s digest made ``how``; None: one SHA-256 of the whole file, read through."""
    if how is None:
        return _sha256(path, 0, None).hex()
    if how != DIGEST:
        raise CheckpointError(f"{path}: digest {how!r} unknown to this recsz (it makes {DIGEST})")
    size = path.stat().st_size
    starts = range(0, max(size, 1), _PIECE)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks of a host hash at once
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, min(len(starts), (cores or 1) // local))
    with ThreadPoolExecutor(threads) as pool:
        pieces = pool.map(lambda at: _sha256(path, at, min(_PIECE, size - at)), starts)
        return hashlib.sha256(b"".join(pieces)).hexdigest()


def _sha256(path: Path, at: int, n: int | None) -> bytes:
    """SHA-256 of ``n`` bytes of ``path`` from ``at`` (None: to its end)."""
    h, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        f.seek(at)
        while n is None or n > 0:
            got = f.readinto(view if n is None else view[: min(len(buf), n)])
            if not got:
                break
            h.update(view[:got])
            n = None if n is None else n - got
    return h.digest()


def record_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint record without its own checksum (canonical JSON)."""
    return _json_sha256({k: v for k, v in meta.items() if k != "checksum"})


def complete(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint directories, oldest first."""
    base = run_dir / "checkpoints"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / "meta.json").exists())


def run_dir_of(resume: Path) -> Path:
    """The run directory ``--resume`` names: itself, or the run of the one checkpoint
    directory it names (``RUN/checkpoints/step-N``)."""
    return resume.parent.parent if (resume / "meta.json").exists() else resume


def _named(resume: Path) -> list[Path]:
    """The checkpoints ``resume`` names, oldest first: itself (``RUN/checkpoints/step-N``)
    or a run's complete ones."""
    return [resume] if run_dir_of(resume) != resume else complete(resume)


def _record(d: Path) -> dict[str, Any]:
    """Checkpoint ``d``'s record, its checksum verified; CheckpointError names it
    otherwise."""
    meta_path = d / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("checksum") != record_digest(meta):
            raise ValueError("checksum mismatch (damaged or edited)")
        int(meta["step"]), int(meta["world_size"]), dict(meta["files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint record ({e})") from None
    return meta


def nothing_kept(run: Path) -> str:
    """Why ``run`` has no complete checkpoint to read: one trained without
    ``--checkpoint-every`` kept none."""
    try:
        every = json.loads((run / "config.json").read_text()).get("checkpoint_every")
    except (OSError, ValueError, AttributeError):
        every = None
    if every == 0:
        return (
            f"{run} was trained without --checkpoint-every, so it kept no model (train with "
            "--checkpoint-every N: the last step is always among them)"
        )
    return f"{run}: no complete checkpoint (RUN/checkpoints/step-N)"


def record(resume: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint ``resume`` names (a run: its newest complete one whose record is
    intact) and its record, the files not yet verified (the load does); None if none."""
    for d in reversed(_named(resume)):
        try:
            return d, _record(d)
        except CheckpointError:
            continue
    return None


def _check(
    d: Path, cfg: TrainConfig, ranks: Ranks
) -> tuple[int, int, int, dict[int, dict[str, Any]]]:
    """Read and verify checkpoint ``d`` for this rank: its step, the number of ranks that
    wrote it, its column shards and the saved states this rank restores from, by the rank
    that wrote them (its own; or, written by another number of ranks or of column shards,
    every rank's, memory-mapped, this rank verifying every ``world``-th file);
    CheckpointError names the file otherwise."""
    meta = _record(d)
    step, world, files = int(meta["step"]), int(meta["world_size"]), meta["files"]
    shards = int(meta.get("config", {}).get("column_shards") or 1)
    if meta.get("fingerprint") != fingerprint(cfg, meta.get("config", {}).get("config_version")):
        detail = ", ".join(differences(meta.get("config", {}), cfg))
        raise OtherConfiguration(
            f"checkpoint {d} was written with another configuration ({detail or 'fingerprint'})"
        )
    same = world == ranks.world and shards == cfg.column_shards
    for r in [ranks.rank] if same else range(ranks.rank, world, ranks.world):
        f = d / f"rank-{r}.pt"
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        if digest(f, meta.get("digest")) != files.get(f.name):
            raise CheckpointError(f"{f}: checksum mismatch (damaged, truncated or replaced)")
    if same:
        return step, world, shards, {ranks.rank: _read(d / f"rank-{ranks.rank}.pt")}
    return step, world, shards, {r: _read(d / f"rank-{r}.pt") for r in range(world)}


def _read(f: Path) -> dict[str, Any]:
    """A rank's file, memory-mapped on the host: read as used, its pages the file's (the
    system's to drop), not a copy. The modules' states are copied into the modules' own
    tensors on their device; the rest is placed there (:func:`snapshot`): so a resumed
    run's device holds its model once, not the file's copy beside it, and what no part
    reads (a scoring model's optimizer state) is never read."""
    try:
        return torch.load(f, weights_only=False, map_location="cpu", mmap=True)
    except Exception as e:
        raise CheckpointError(f"{f}: cannot be loaded ({type(e).__name__}: {e})") from None


def snapshot(obj: Any, device: torch.device | str = "cpu") -> Any:
    """``obj`` with every tensor copied onto ``device`` (the host's memory by default) and
    everything else deep-copied: nothing that changes the one changes the other."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v, device)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v, device) for v in obj)
    return copy.deepcopy(obj)


def _older(named: Path, failed: Path, other: bool) -> str:
    """What a damaged checkpoint's error adds: where its run has an older one, how to take
    it (a run named: ``--resume-fallback``; a checkpoint named, as `recsz evaluate` names
    the newest: another's path)."""
    older = [c for c in complete(run_dir_of(failed)) if c < failed]
    if other or not older:  # (--resume-fallback fails only on the oldest)
        return ""
    if named != failed:  # (a run: its checkpoints tried newest first)
        return " (--resume-fallback: the last intact one)"
    return f" (an older one may be intact: name it, {older[-1]})"


def load(run_dir: Path, parts: Parts, cfg: TrainConfig, ranks: Ranks) -> tuple[int, dict[str, Any]]:
    """Restore this rank's state from the newest complete checkpoint every rank verifies
    (or from the one checkpoint directory ``run_dir`` names); return its step and the run
    counters saved with it. A damaged newest checkpoint is an error, unless
    ``cfg.resume_fallback``: then the newest intact one is used. One written by another
    number of ranks is resharded (:func:`_restore_resharded`)."""
    done = _named(run_dir)
    if not done:
        raise FileNotFoundError(f"--resume {nothing_kept(run_dir)}")
    for d in reversed(done):
        try:
            step, world, shards, saved = _check(d, cfg, ranks)
            err, other = "", False
        except CheckpointError as e:
            err, other = str(e), isinstance(e, OtherConfiguration)
        said = ranks.gather((err, other))
        errors = list(dict.fromkeys(e for e, _ in said if e))  # each once
        if not errors:
            break
        other = any(o for _, o in said)  # no older checkpoint would do
        if not cfg.resume_fallback or d == done[0] or other:
            raise CheckpointError("; ".join(errors) + _older(run_dir, d, other))
        if ranks.rank == 0:
            print(f"recsz: skipping checkpoint {d}: {'; '.join(errors)}", flush=True)
    if world != ranks.world or shards != cfg.column_shards:
        return step, _restore_resharded(d, step, saved, parts, cfg, ranks, shards)
    state = saved[ranks.rank]
    if state["tables"] != parts.sparse.tables:
        raise CheckpointError(
            f"checkpoint {d}: rank {ranks.rank} held tables {state['tables']}, "
            f"the plan now gives it {parts.sparse.tables}"
        )
    _into(parts.sparse, state["sparse"], parts)  # (copied into the modules' tensors)
    _into(parts.dense_module, state["dense"], parts)
    names: tuple[str, ...] = ("policies", "stats", "switch", "counters")
    names += ("dense_opt", "dp") if parts.dense_opt is not None else ()  # (scoring: none)
    kept = snapshot({k: state[k] for k in names}, ranks.device)  # kept as read: copies
    if parts.dense_opt is not None:
        parts.dense_opt.load_state_dict(kept["dense_opt"])
        parts.dp.load_state_dict(kept["dp"])
    for k, p in parts.exchange.policies.items():
        p.load_state_dict(kept["policies"][k])
    parts.exchange.stats = kept["stats"]
    parts.exchange.switch.load_state_dict(kept["switch"])
    torch.set_rng_state(state["torch_rng"].clone())
    return step, kept["counters"]


def _into(module: torch.nn.Module, state: dict[str, Any], parts: Parts) -> None:
    """``module`` of ``parts`` loads ``state``; parts built to score (no optimizers:
    ``build_parts(train=False)``) leave what only training reads unread."""
    if parts.dense_opt is None:
        state = tablestate.for_scoring(state, module.state_dict())
    module.load_state_dict(state)


def _restore_resharded(
    d: Path, step: int, saved: dict[int, dict[str, Any]], parts: Parts, cfg: TrainConfig,
    ranks: Ranks, shards: int,
) -> dict[str, Any]:  # fmt: skip
    """Restore a checkpoint written by another number of ranks, or of column shards
    (``shards``; ``saved``: every rank's state, memory-mapped): each table this rank now
    holds from the rank that held it (:mod:`recsz.model.tablestate`: rows, row optimizer,
    FIITED's chunks, TT cores and caches; a table's columns joined and cut again where the
    shards changed); the MLPs, their optimizer and ``--compress auto``'s switch from rank
    0 (every rank's are the same); what the bound policies learnt of each table from the
    rank that saw it (:meth:`BoundPolicy.load_resharded`; where the shards changed, they
    probe anew); counters and the MLP hook's state as :meth:`CommStats.resumed` and
    :func:`resumed_state` fold them. Returns the run's counters (saved rank ``rank % W``'s)."""
    old = [saved[r] for r in range(len(saved))]
    tt = cfg.tt_spec()
    tt_tables = tt.tables if tt is not None else frozenset()
    model, k = cfg.model(), cfg.column_shards
    sizes = column_shards(model.table_sizes, model.emb_dim, shards)[0]  # as saved
    pieces: dict[int, tablestate.Piece] = {}
    for r, state in enumerate(old):
        try:
            pieces.update(tablestate.split(state["sparse"], state["tables"], sizes, tt_tables))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{d / f'rank-{r}.pt'}: its tables' state: {e}") from None
    if shards != k:
        try:
            pieces = tablestate.recolumned(pieces, model.n_tables, shards, k, parts.sparse.tables)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {d}: --column-shards {shards} -> {k}: {e}") from None
    sparse = parts.sparse
    try:
        _into(sparse, tablestate.join(pieces, sparse.tables, tt_tables, sparse.state_dict()), parts)
    except KeyError as e:
        raise CheckpointError(f"checkpoint {d}: {e.args[0]}") from None
    own = old[ranks.rank % len(old)]
    # Copies: what is kept, not read into the modules' own tensors, leaves the files.
    _into(parts.dense_module, old[0]["dense"], parts)
    if parts.dense_opt is not None:
        parts.dense_opt.load_state_dict(snapshot(old[0]["dense_opt"], ranks.device))
    # What the bound policies learnt of each table: the forward's from the table's owner
    # (it saw the table's values of every sample, as its new owner will), the backward's
    # (of a rank's samples, every table) and the rest from rank ``rank % W``.
    owners = {t: r for r, state in enumerate(old) for t in state["tables"]}
    every = dict.fromkeys(range(len(sizes)), ranks.rank % len(old))
    for way, p in parts.exchange.policies.items():
        if shards != k:  # what they learnt was of other tables
            p.probe_again(step)
            continue
        try:
            saved_p = [state["policies"][way] for state in old]
            p.load_resharded(saved_p, owners if way == "fwd" else every, ranks.rank % len(old))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {d}: the {way} bound policy's state: {e}") from None
    parts.exchange.switch.load_state_dict(old[0]["switch"])
    torch.set_rng_state(own["torch_rng"].clone())
    stats = [state["stats"].recolumned(shards, k) if shards != k else state["stats"]
             for state in old]  # fmt: skip
    parts.exchange.stats = CommStats.resumed(stats, ranks.rank, ranks.world, sparse.tables)
    if parts.dense_opt is not None:
        dp = resumed_state([state["dp"] for state in old], ranks.rank, ranks.world)
        parts.dp.load_state_dict(snapshot(dp, ranks.device))
    if ranks.rank == 0:

        def layout(n: int) -> str:
            return "" if shards == k else " (whole tables)" if n == 1 else f" ({n} shards a table)"

        cols = (layout(shards), layout(k))
        anew = "" if shards == k else " (the bound policies probe anew)"
        print(
            f"recsz: {d} was written by {len(old)} ranks{cols[0]}, read on {ranks.world}"
            f"{cols[1]}: its tables resharded{anew}",
            flush=True,
        )
    return copy.deepcopy(own["counters"])
