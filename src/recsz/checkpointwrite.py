"""Writing checkpoints, on a GPU while training goes on.

On a GPU, at a checkpoint's step each rank copies its state into host memory (the snapshot:
the training that goes on cannot change it), then a thread writes it to the rank's file
(under a temporary name, renamed when whole) and digests it while the steps go on; the
checkpoint is completed (every rank's digest gathered, rank 0's record, ``meta.json``,
written last, old checkpoints pruned) at the next step all ranks take for it: the next
logged step (``--log-every``), the next checkpoint, an evaluation, or the run's end. Until
then it is an incomplete directory, which a resume passes over (a crash before loses it, and
resumes from the one before). On the CPU, or where the host's free memory would not hold the
snapshot, a rank writes its live state at once, training waiting for it: there the
training's threads already use the cores, and a writer beside them made the run slower
(`benchmarks/bench_checkpoint.py`: 2 cores, a 4.3 GB file, 15-30% more wall time). On the
CPU, where every rank writes so, the checkpoint is completed as soon as it is written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recsz import hostmemory, report
from recsz.checkpoint import DIGEST, complete, digest, fingerprint, record_digest, snapshot
from recsz.diskroom import NO_ROOM, free, no_room

if TYPE_CHECKING:
    from recsz.config import TrainConfig
    from recsz.ranks import Ranks
    from recsz.step import Parts


def atomic_write(path: Path, write: Any, size: int = 0) -> None:
    """``write(tmp_path)`` then rename; the temporary file never outlives a failure.
    ``size``: about the bytes it writes, refused at once where its filesystem has fewer
    free (as is a failure that leaves fewer free than the bytes not yet written: torch's
    writer says a full disk as "unexpected pos")."""
    tmp = path.with_name(path.name + ".tmp")
    if size and free(path) < size:
        raise no_room(path, f"no room for its {size / 2**20:.1f} MB")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        full = isinstance(e, OSError) and e.errno in NO_ROOM
        if isinstance(e, Exception) and not full:  # (before the partial file goes)
            written = tmp.stat().st_size if tmp.exists() else 0
            full = free(path) < max(size - written, 2**16)
        tmp.unlink(missing_ok=True)
        if full:
            raise no_room(path, "no space left on device") from e
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write checkpoint file {path}: {e.strerror}") from e
        raise


def rank_state(parts: Parts, ranks: Ranks, counters: dict[str, Any]) -> dict[str, Any]:
    """What a rank's file holds (live: its tensors are the training's own)."""
    assert parts.dense_opt is not None, "parts built to score (no optimizers) are not saved"
    return {
        "rank": ranks.rank,
        "tables": parts.sparse.tables,
        "sparse": parts.sparse.state_dict(),
        "dense": parts.dense_module.state_dict(),
        "dense_opt": parts.dense_opt.state_dict(),
        "policies": {k: p.state_dict() for k, p in parts.exchange.policies.items()},
        "switch": parts.exchange.switch.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "dp": parts.dp.state_dict(),
        "stats": parts.exchange.stats,
        "counters": counters,
    }


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _room_for_a_copy(state: dict[str, Any]) -> bool:
    """Whether the host's free memory holds a copy of ``state`` on each of its ranks (they
    copy theirs at once), a quarter to spare."""
    free = hostmemory.available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return free is not None and tensor_bytes(state) * local * 1.25 <= free


def in_background(device: torch.device) -> bool:
    """Whether a rank on ``device`` writes its checkpoints in the background."""
    return device.type == "cuda"


@dataclass
class _Write:
    """One rank's file of one checkpoint: its step and, once written, its digest or why
    it could not be written."""

    step: int
    path: Path
    thread: threading.Thread | None = None
    result: dict[str, str] = field(default_factory=dict)

    def run(self, state: dict[str, Any]) -> None:
        try:
            atomic_write(self.path, lambda tmp: torch.save(state, tmp), tensor_bytes(state))
            self.result["digest"] = digest(self.path)
        except Exception as e:  # named on every rank when the checkpoint completes (a
            self.result["error"] = f"{type(e).__name__}: {e}"  # second Ctrl-C: raised)
            if isinstance(e, OSError) and e.errno in NO_ROOM:
                self.result["error"], self.result["no_room"] = str(e), "1"


class Saver:
    """A run's checkpoints, each written in the background and completed later
    (:meth:`complete`, which every rank calls at the same steps)."""

    def __init__(
        self,
        out: Path | None,
        cfg: TrainConfig,
        ranks: Ranks,
        busy: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.out, self.cfg, self.ranks = out, cfg, ranks  # out: None, no checkpoints
        self.pending: _Write | None = None
        self.completed: int | None = None  # the step of the last checkpoint it completed
        # ``busy``: around a write, or the wait for one (one long call: no sign of a peer
        # gone to SIGTERM's watcher, stopping.Stopping.busy)
        self._busy = busy

    def save(self, parts: Parts, step: int, counters: dict[str, Any]) -> None:
        """Start this rank's file of the checkpoint at ``step`` (the last one completed
        first); on the CPU, write it and complete it."""
        self.complete()
        d = self.directory(step)
        d.mkdir(parents=True, exist_ok=True)
        live = rank_state(parts, self.ranks, counters)
        self.pending = write = _Write(step, d / f"rank-{self.ranks.rank}.pt")
        with self._busy():
            if background := in_background(self.ranks.device) and _room_for_a_copy(live):
                state = snapshot(live)  # (a large table's copy: one call)
            else:
                write.run(live)  # the live state, training waiting
        if not background:
            if not in_background(self.ranks.device):  # every rank's file written by now:
                self.complete()  # a failure before the next logged step keeps it
            return
        write.thread = threading.Thread(target=write.run, args=(state,), name=f"checkpoint-{step}")
        write.thread.start()

    def directory(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lies."""
        assert self.out is not None, "a run without a directory keeps no checkpoints"
        return self.out / "checkpoints" / f"step-{step:09d}"

    def complete(self) -> Path | None:
        """Complete the checkpoint started last, if any: wait for this rank's file, gather
        every rank's digest (an error names each rank that could not write), and rank 0
        writes the record and prunes. Every rank calls it at the same steps."""
        write, self.pending = self.pending, None
        if write is None:
            return None
        if write.thread is not None:
            with self._busy():
                write.thread.join()
        results = self.ranks.gather(write.result)
        failed = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
        d = write.path.parent
        if failed:
            if self.ranks.rank == 0 and not (d / "meta.json").exists():  # (every rank's
                shutil.rmtree(d, ignore_errors=True)  # write has ended: the step's nothing)
            e = OSError(f"cannot write checkpoint step {write.step}: " + "; ".join(failed))
            if any("no_room" in res for res in results):  # not the job's to mend: no restart
                e.errno = errno.ENOSPC
            raise e
        if self.ranks.rank == 0 and self.out is not None:
            meta = {
                "step": write.step,
                "world_size": self.ranks.world,
                "fingerprint": fingerprint(self.cfg),
                "files": {f"rank-{r}.pt": res["digest"] for r, res in enumerate(results)},
                "digest": DIGEST,
                "config": self.cfg.to_dict(),
            }
            meta["checksum"] = record_digest(meta)
            atomic_write(d / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))
            prune(self.out / "checkpoints", self.cfg.keep_checkpoints)
        self.ranks.barrier()
        self.completed = write.step
        return d

    def abandon(self) -> None:
        """A failed run: wait for this rank's file (whole, or no file), never completing
        the checkpoint (no collective: the ranks may be gone)."""
        write, self.pending = self.pending, None
        if write is not None and write.thread is not None:
            write.thread.join()


def best_checkpoint(run_dir: Path, also: dict[int, float] | None = None) -> dict[str, Any] | None:
    """The complete checkpoint whose step's held-out evaluation scored the highest AUC
    (the run's log, and ``also``: steps' AUCs not logged yet; the earliest of equals), as
    its step, AUC and path; None where no checkpoint was evaluated."""
    aucs = dict(report.logged_aucs(run_dir)) | (also or {})
    best = report.Best.of([(s, aucs[s]) for p in complete(run_dir) if (s := _step_of(p)) in aucs])
    if best.step is None:
        return None
    path = run_dir / "checkpoints" / f"step-{best.step:09d}"
    return {"step": best.step, "auc": best.auc, "path": str(path)}


def _step_of(d: Path) -> int:
    """The step of checkpoint directory ``d`` (``step-N``)."""
    return int(d.name.removeprefix("step-"))


def prune(base: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (0: all) and the one evaluated best
    (:func:`best_checkpoint`); drop incomplete ones older than the newest complete one."""
    done = complete(base.parent)
    if not done:
        return
    drop = done[:-keep] if keep else []
    if drop and (best := best_checkpoint(base.parent)) is not None:
        drop = [p for p in drop if str(p) != best["path"]]
    drop += [p for p in base.iterdir() if p.is_dir() and p not in done and p.name < done[-1].name]
    for p in drop:
        shutil.rmtree(p, ignore_errors=True)
