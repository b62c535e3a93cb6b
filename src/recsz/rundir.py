"""What a run directory (``--out``) already holds when a run starts there: nothing; this
run, the same command line run again (a job its scheduler requeued after a preemption,
torchrun restarted after a failure, or simply rerun), which continues from its last
checkpoint or, without one, starts over; or another run, which is not written over. And
whether another job is writing it now (:class:`Held`): one job at a time. And where a
resumed run stands (:func:`where_resumed`): an evaluation to do first, or nothing left."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from recsz import checkpoint, report

if TYPE_CHECKING:
    from recsz.config import TrainConfig
    from recsz.ranks import Ranks

#: what in a directory makes it a run's
HELD = ("config.json", "metrics.jsonl", "summary.json", "checkpoints")


def _held(out: Path) -> list[str]:
    """What of a run's :data:`HELD` ``out`` holds."""
    return [n for n in HELD if (out / n).exists()]


def continues(out: Path, cfg: TrainConfig) -> tuple[Path, dict[str, Any]] | None:
    """This run's checkpoint in ``out`` that a new run of ``cfg`` goes on from, and its
    record (as ``--resume out`` reads them: its newest complete one, written with ``cfg``'s
    configuration but for what a resumed run may change); None where ``out`` holds no run,
    or this run without a checkpoint (it starts over there). A ValueError where ``out`` holds
    another run."""
    held = _held(out)
    if not held:
        return None
    found = checkpoint.record(out)
    if found is not None:
        d, meta = found
        if not (diff := checkpoint.differences(meta.get("config", {}), cfg)):
            return found
        why = f"its checkpoint {d.name} was written with {', '.join(diff)}"
    elif (out / "config.json").exists():
        try:
            saved = json.loads((out / "config.json").read_text())
        except json.JSONDecodeError:
            saved = {}
        if not (diff := checkpoint.differences(saved, cfg)):
            return None  # this run, never checkpointed: it starts over
        why = f"its config.json says {', '.join(diff)}" if saved else "its config.json is not JSON"
    else:
        why = f"it holds {', '.join(held)} without a record of its configuration"
    go_on = f"continue that one with `--resume {out}` (its own configuration), or " if found else ""
    raise ValueError(
        f"--out {out} holds another run ({why}); {go_on}write this one elsewhere (another "
        "--out, or remove that one)"
    )


def refuse_another_run(out: Path, resume: Path) -> None:
    """A ValueError where ``out`` holds a run other than the one ``--resume`` names, which
    the resumed run would write over."""
    held = _held(out)
    if held and checkpoint.run_dir_of(resume).resolve() != out.resolve():
        raise ValueError(
            f"--out {out} already holds a run ({', '.join(held)}); a run resumed from "
            f"{resume} writes elsewhere (another --out, or remove that one)"
        )


#: the file whose lock the job writing a run directory holds (named by it, a line)
WRITER = ".writer"


class Held:
    """``out`` held by this process (a job's rank 0) as the one job writing it: an advisory
    lock (``flock``) on ``out/.writer``, which the kernel drops as the process ends, however
    it ends (a crash, SIGKILL, a node gone: its server's lease), so a job restarted or
    requeued after it takes it again. Two jobs writing one run (the same command line
    started twice, a requeued job beside one still running) would interleave its log and
    write over each other's checkpoint files: the second is refused (:attr:`refused`, naming
    the first). Where the file system keeps no locks (some network ones), said once and
    not held."""

    def __init__(self, out: Path, create: bool = True) -> None:
        """``create``: make ``out`` where it is missing (else, a run resumed from a
        checkpoint that is not there, nothing is held: the resume says what is missing)."""
        self.refused: str | None = None
        self._file: IO[str] | None = None
        if not create and not out.is_dir():
            return
        out.mkdir(parents=True, exist_ok=True)
        f = (out / WRITER).open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            self.refused = (
                f"--out {out} is being written by another job ({holder}): two jobs writing "
                "one run would interleave its log and write over each other's checkpoints; "
                "wait for that one to end (or stop it), or write this one elsewhere (another "
                "--out)"
            )
            return
        except OSError as e:  # no locks on this file system
            f.close()
            print(f"recsz: warning: cannot lock {out / WRITER} ({e.strerror}): a second "
                  "job writing this run at once would not be refused", file=sys.stderr)  # fmt: skip
            return
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        """The run has ended: the lock dropped (the file stays, naming the last writer)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def where_resumed(
    cfg: TrainConfig, ranks: Ranks, steps: int, start: int, counters: dict[str, Any], out: Path
) -> tuple[bool, bool, report.Best]:
    """A run resumed at ``start`` of ``steps`` (its ``counters``, updated here): whether it
    evaluates ``start`` first (its checkpoint written before an evaluation due there, whose
    row the log lacks: cut short), whether it already finished (its target met, its
    --patience spent, or every step trained and summarized), each said by rank 0, and with
    --patience its evaluations up to ``start`` (rank 0's log; none without)."""
    if steps < start:
        raise ValueError(f"--steps {steps} is below the step of the checkpoint resumed ({start})")
    hit: dict[str, Any] | None = counters.get("target_reached")  # where it stopped
    due = bool(cfg.eval_every) and start % cfg.eval_every == 0 and start != steps
    first, cut = False, bool(counters.get("eval_due")) and due  # saved before its evaluation
    # The log's evaluation of ``start``: whether it was cut short, and whether it met the
    # target (a final evaluation meets it after its step's checkpoint is saved).
    got = None
    if cut or (cfg.target_auc is not None and hit is None):
        got = ranks.gather(report.logged_eval(out, start) if ranks.rank == 0 else None)[0]
    if cut:
        first = got is None  # cut short (a stop, a kill) before its row
        counters["eval_s"] = counters.get("eval_s", 0.0) + (got or {}).get("eval_s", 0.0)
    if got and hit is None and cfg.target_auc is not None and got["eval_auc"] >= cfg.target_auc:
        hit = {"step": start, "auc": got["eval_auc"]}
    met = hit is not None and cfg.target_auc is not None and hit["auc"] >= cfg.target_auc
    summarized = (out / "summary.json").exists()  # (a final evaluation cut short: not)
    best = report.Best()  # --patience: the evaluations up to this step, as the run saw them
    if cfg.patience:
        seen = report.logged_aucs(out) if ranks.rank == 0 else None
        best = report.Best.of([(s, auc) for s, auc in ranks.gather(seen)[0] if s <= start])
    tired = bool(cfg.patience) and best.since >= cfg.patience
    if met or tired or (steps == start and summarized):
        why = f"AUC {hit['auc']:.5f} at step {start}" if met and hit else f"its {steps} steps"
        if tired and not met:
            why = f"no better AUC than step {best.step}'s in the {best.since} evaluations after"
        if ranks.rank == 0:
            print(f"recsz: {cfg.resume} already finished ({why}); nothing to do", flush=True)
        return first, True, best
    if ranks.rank == 0 and steps == start:  # no steps left: the evaluation, the summary
        print(f"recsz: {cfg.resume} trained its {steps} steps but has no summary (its final "
              "evaluation cut short?): evaluating it now", flush=True)  # fmt: skip
    elif ranks.rank == 0 and first:
        print(f"recsz: the evaluation due at step {start} did not end before the run "
              "stopped: evaluating it first", flush=True)  # fmt: skip
    return first, False, best
