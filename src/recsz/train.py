"""Train DLRM, one process or many, with a compressed embedding all-to-all.

Reads top to bottom: set up ranks -> data -> model parts (:mod:`recsz.step`) -> loop ->
evaluate -> write the run directory: config.json, metrics.jsonl, summary.json and
checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from recsz import checkpoint, console, profiling, report
from recsz.checkpointwrite import Saver, best_checkpoint
from recsz.config import TrainConfig, configured, given_args, resumed_config
from recsz.configcheck import idle, need_tensorboard
from recsz.data.prefetch import prefetch
from recsz.data.source import Batch, make_source
from recsz.evaluation import evaluate
from recsz.launcher import launch
from recsz.model import modelfile
from recsz.profiling import stage
from recsz.ranks import Ranks, keep_freed_memory, restarted, worker
from recsz.rundir import Held, continues, refuse_another_run, where_resumed
from recsz.step import (
    build_parts,
    rank_part,
    refuse_tables_that_cannot_fit,
    share_chunk_counts,
    table_owners,
    train_step,
)
from recsz.stepgraph import graphed
from recsz.stopping import Stopping

SYNTHETIC_DEFAULT_STEPS = 1000
#: Steps left out of samples_per_s_steady (first kernel compiles, CUDA graph captures).
WARM_STEPS = 3


# ---- the run ---------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this process's rank; returns the summary (same on every rank)."""
    if cfg.host_memory == "keep":
        keep_freed_memory()
    ranks = Ranks.from_env(cfg.dist_timeout, cfg.device)
    ok = False
    saver: Saver | None = None
    held: Held | None = None
    log: report.Log | None = None
    # SIGTERM or SIGINT from here on is noted, and acted on after a step: a checkpoint, then
    # the end
    stop = Stopping(ranks.world, ranks.rank) if cfg.out or cfg.resume else None
    try:
        ranks.check_same({k: v for k, v in cfg.to_dict().items() if k not in _LOCAL_FIELDS})
        out = Path(cfg.out) if cfg.out else None
        out = out or (checkpoint.run_dir_of(Path(cfg.resume)) if cfg.resume else None)
        if out:  # one job writes a run: rank 0 holds it, every rank says why not
            held = Held(out, create=bool(cfg.out)) if ranks.rank == 0 else None
            if why := ranks.gather(held.refused if held else None)[0]:
                raise ValueError(why)
        bsz = cfg.resolved("batch_size")
        if bsz % ranks.world:
            raise ValueError(
                f"--batch-size {bsz} is not divisible by the {ranks.world} ranks; "
                f"use a multiple of {ranks.world}"
            )
        m = cfg.model()
        source = make_source(cfg.data, m.table_sizes, cfg.seed, cfg.skip_bad_lines,
                             cfg.synthetic_eval, cfg.eval_fraction, cfg.eval_data,
                             cfg.data_order, m.n_dense)  # fmt: skip
        steps = cfg.steps or source.steps_per_epoch(bsz) or SYNTHETIC_DEFAULT_STEPS
        parts, owners = build_parts(cfg, ranks)
        start, counters = 0, dict[str, Any](train_s=0.0, data_s=0.0)
        evaluate_first = False  # resumed where an evaluation was due and did not end
        best = report.Best()  # the best evaluation so far, and those since (--patience)
        if cfg.init_from and not cfg.resume:  # a warm start: the weights, no more
            started = modelfile.read(cfg.init_from)
            parts.sparse.start_from(started.tables)
            parts.dense_module.load_torchrec_mlps(started.mlps)
        if cfg.resume:
            start, counters = checkpoint.load(Path(cfg.resume), parts, cfg, ranks)
            assert out is not None
            evaluate_first, finished, best = where_resumed(cfg, ranks, steps, start, counters, out)
            if finished:
                ok = True
                return {"steps": start, "already_finished": True}
        if out and ranks.rank == 0:  # (made where missing by Held)
            (out / "config.json").write_text(cfg.to_json())
        # Resumed: the metrics rows after the checkpoint are dropped (they are rerun).
        log = report.Log(out if ranks.rank == 0 else None, start if cfg.resume else None,
                         cfg.tensorboard)  # fmt: skip
        if ranks.rank == 0:
            for line in idle(cfg, ranks.world):  # said, not refused: a sweep sets flags for all
                tqdm.write(f"recsz: warning: {line}", file=sys.stderr)
            tqdm.write(
                f"recsz: preset {cfg.preset}, data {source.name}, {ranks.world} rank(s), "
                f"global batch {bsz}, steps {start}..{steps}, codecs "
                f"fwd={cfg.fwd_codec} bwd={cfg.bwd_codec} ({cfg.eb_policy} {cfg.eb_mode})"
            )
            tqdm.write(f"table owners: {owners}")
        progress = console.Progress(steps, start, cfg.progress and ranks.rank == 0)
        losses: list[torch.Tensor] = []
        train_s, data_s = counters["train_s"], counters["data_s"]
        lr_factor = 1.0
        eval_s = counters.get("eval_s", 0.0)  # every evaluation's seconds
        reached: dict[str, Any] | None = None  # --target-auc: the evaluation that reached it
        reached_ev: dict[str, Any] = {}  # (its numbers)
        warm: tuple[float, int] | None = None  # train_s and step after the first steps

        def gathered() -> list[dict]:
            """Every rank's counters, in one collective (metrics rows and the summary)."""
            loss = float(torch.stack(losses).double().mean()) if losses else float("nan")
            losses.clear()
            return ranks.gather(report.rank_record(parts, ranks.rank, loss, train_s, data_s))

        fail_at = cfg.failure_at()
        fiited = cfg.fiited_spec()
        if fiited is not None and cfg.fiited_mask_backward:
            share_chunk_counts(parts, ranks, fiited.chunk)

        def one_step(batch: Batch, k: int) -> torch.Tensor:
            return train_step(parts, batch, k, ranks)

        run_step = graphed(one_step, parts.exchange, ranks.world) if cfg.cuda_graph else one_step
        part = rank_part(parts, ranks)  # what the step reads
        made = source.train_batches(range(start, steps), bsz, part)
        batches = prefetch(made, ranks.device, cfg.prefetch)
        busy = stop.busy if stop is not None else _not_watched  # (its own long calls)
        trace = out / "profile" / f"rank-{ranks.rank}.json.gz" if out else None
        after = (max(start + WARM_STEPS, cfg.steady_from()) if cfg.profile_from is None
                 else cfg.profile_from)  # (steady steps: the profile's, unless told)  # fmt: skip
        profiler = profiling.StepProfiler(cfg.profile, start, steps, after, ranks.device, trace)
        saver = Saver(out, cfg, ranks, busy)
        if cfg.resume:  # the state the checkpoint resumed holds
            saver.completed = start

        heard = stop.heard if stop is not None else None  # (asked to stop during one)

        def evaluated(at: int) -> dict[str, Any] | None:
            """The held-out evaluation after step ``at``; where it meets --target-auc,
            ``reached``. None: the run was asked to stop during it (every rank alike)."""
            nonlocal eval_s, reached, reached_ev
            with busy(saved=at if saver.completed == at else None):
                ev = evaluate(parts, source, cfg, at, ranks, heard=heard)
            if ev is None:
                return None
            eval_s += ev["eval_s"]
            best.seen(at, ev["auc"])
            if cfg.target_auc is not None and ev["auc"] >= cfg.target_auc:
                reached, reached_ev = {"step": at, "auc": ev["auc"]}, ev  # every rank's alike
            elif cfg.patience and best.since >= cfg.patience and at < steps:  # (early stop)
                reached, reached_ev = {"step": at, "auc": ev["auc"], "patience": best.since}, ev
            return ev

        def save(at: int, eval_due: bool) -> None:
            """A checkpoint of step ``at``; ``eval_due``: written before the evaluation due
            there (a run resumed from it evaluates first, unless the log holds its row)."""
            run_totals = {"train_s": train_s, "data_s": data_s, "eval_s": eval_s,
                          "target_reached": reached, "eval_due": eval_due}  # fmt: skip
            parts.exchange.settle()  # no step whose payloads failed their checks is saved
            saver.save(parts, at, run_totals)

        stopped, during, done = False, False, start  # during: asked to stop in an evaluation

        def left_unfinished(at: int, eval_due: bool) -> None:
            """Asked to stop during the evaluation of step ``at``: the run stops, that step
            saved where no complete checkpoint holds it (``eval_due``: as :func:`save`)."""
            nonlocal stopped, during
            stopped = during = True
            if saver.completed != at:
                save(at, eval_due)

        if evaluate_first:  # (its step's checkpoint is the one resumed)
            if (first := evaluated(start)) is None:
                left_unfinished(start, True)
            else:
                log.metrics({"step": start, **report.eval_row(first)})
        for step in range(start, start if stopped or reached is not None else steps):
            if fail_at == (ranks.rank, step):
                raise RuntimeError(f"injected failure on rank {ranks.rank} at step {step}")
            # data_s: the time spent waiting for a batch (making it, without --prefetch).
            began = time.monotonic()  # (the step's length: Stopping's patience)
            profiler.before(step)
            t0 = time.perf_counter()
            with stage("recsz.data"):
                batch = next(batches)
            data_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            if parts.rates is not None:
                lr_factor = parts.rates.at(step)
            losses.append(run_step(batch, step))
            profiler.after(step)
            done = step + 1
            stopped = stop is not None and stop.agreed(began) and done != steps
            if fiited is not None and done % fiited.interval == 0:
                parts.sparse.prune()
                if cfg.fiited_mask_backward:
                    share_chunk_counts(parts, ranks, fiited.chunk)
            logged = done % cfg.log_every == 0 or done == steps
            warmed = done - start == WARM_STEPS  # compilation, graph capture, caches behind
            if ranks.device.type == "cuda" and (logged or warmed):
                # The loss is read only when logged, so the GPU may lag the host: the
                # queued work of the steps counted so far counts here.
                torch.cuda.synchronize(ranks.device)
            train_s += time.perf_counter() - t0
            progress.update()
            if warmed:
                warm = (train_s, done)
            row: dict[str, Any] = {}
            if logged:
                saver.complete()  # the checkpoint written since the last row, if any
                recs = gathered()
                if bad := report.diverged(recs):  # every rank sees the same: all stop here
                    msg = f"the loss is not finite on rank(s) {bad} by step {done}"
                    raise FloatingPointError(f"{msg}: diverged (lower --lr, --emb-lr or bounds)")
                row = {"step": done, **report.summarize(recs, done, bsz)}
                if parts.rates is not None:
                    row["lr_factor"] = lr_factor  # the schedule's, at this row's last step
            due = bool(cfg.eval_every) and done % cfg.eval_every == 0 and done != steps
            every = cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == steps)
            if due or (out and every) or stopped:
                profiler.close()  # (the profile holds steps only)
            if out and (every or stopped):  # before the evaluation due here:
                save(done, due)  # a job stopped or killed during it goes on from this step
            if due and not stopped:  # (and evaluates it first)
                # every checkpoint so far complete before it (on a GPU it waits for the
                # background write): a job killed during it loses none of them
                saver.complete()
                ev = evaluated(done)
                if ev is None:  # evaluated first when resumed
                    left_unfinished(done, True)
                else:
                    row = {"step": done, **row, **report.eval_row(ev)}
                if reached is not None and out and cfg.checkpoint_every and not every:
                    save(done, False)  # where the target was met: resuming it ends here
            if row:
                log.metrics(row)
                progress.row(row)
            if reached is not None or stopped:
                break
        progress.close()
        if cfg.profile:
            profiling.gathered(profiler, ranks, out)
        # the last checkpoint whole before the final evaluation: a run cut short during it
        # is evaluated again from there (on a GPU the evaluation waits for the write)
        saver.complete()
        final: dict[str, Any] | None = None  # the final evaluation's numbers
        if not stopped and reached is None and (final := evaluated(steps)) is None:
            left_unfinished(steps, False)  # asked to stop during the final evaluation
        if stopped:  # asked to stop (SIGTERM, SIGINT): a checkpoint, no evaluation, no summary
            saver.complete()  # (one saved just now)
            # (stopped where it resumed: in the evaluation it did first, of the one resumed)
            saved = Path(cfg.resume) if cfg.resume and done == start else saver.directory(done)
            assert stop is not None
            by = signal.Signals(stop.by).name
            if ranks.rank == 0:
                what = " during its evaluation, left unfinished" if during else ""
                tqdm.write(f"recsz: stopped at step {done} ({by}){what}; checkpoint "
                           f"{saved} written: the same command line again goes on from it "
                           f"(or `recsz train --resume {out}`)")  # fmt: skip
            ok = True
            return {"steps": done, "stopped": by, "checkpoint": str(saved)}
        if reached is not None:  # the model the target's evaluation saw
            steps, ev = reached["step"], reached_ev
        else:
            assert final is not None
            ev = final
        ended, early = (reached["step"], "patience" in reached) if reached else (None, False)
        recs = gathered()
        totals = report.summarize(recs, steps, bsz)  # the counters span the whole run
        totals.pop("loss", None)
        per_table = totals.pop("tables")  # the summary's per_table (once, not twice)
        summary = {
            **ev,
            "steps": steps,
            "world_size": ranks.world,
            "skipped_lines": source.skipped_lines,
            "graph_replays": getattr(run_step, "replays", 0),  # --cuda-graph's steps
            "compress": parts.exchange.switch.state(),  # --compress auto's trials
            "eval_s_total": eval_s,
            "target_auc": cfg.target_auc,
            "reached_target_at": None if early else ended,
            # MLPerf's time to train: training, waiting for batches and evaluating
            "time_to_target_s": None if early or ended is None else train_s + data_s + eval_s,
            "stopped_early_at": ended if early else None,
            # the kept checkpoint evaluated best (the final evaluation's row: logged below)
            "best_checkpoint": best_checkpoint(out, {steps: final["auc"]} if final else None)
            if out and ranks.rank == 0
            else None,
            **totals,
            "per_table": per_table,
            # This rank's pace after its first WARM_STEPS steps (the ranks keep in step).
            "samples_per_s_steady": (steps - warm[1]) * bsz / (train_s - warm[0])
            if warm is not None and steps > warm[1] and train_s > warm[0]
            else float("nan"),
            **report.final_extras(recs, cfg.check_bounds),
            "config": cfg.to_dict(),
        }
        if cfg.column_shards > 1:  # each exchanged table's table of the model, and shard
            for key, row in summary["per_table"].items():
                row["table"], row["shard"] = divmod(int(key), cfg.column_shards)
        if out and ranks.rank == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            if final is not None:  # (a mid-run evaluation that met the target has its row)
                log.metrics({"step": steps, **report.eval_row(final)})
        if ranks.rank == 0:
            tqdm.write(report.format_summary(summary))
        ok = True
        return summary
    finally:
        if stop is not None:
            stop.close(ok)
        if saver is not None and not ok:
            saver.abandon()
        if held is not None:
            held.release()
        if log is not None:
            log.close()
        ranks.close(ok)


@contextlib.contextmanager
def _not_watched(saved: int | None = None) -> Iterator[None]:
    """Stopping.busy's stand-in where nothing watches for SIGTERM (no run directory)."""
    yield


#: Fields that may differ between ranks of one job.
_LOCAL_FIELDS = ("progress", "out", "nproc", "prefetch")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `recsz train`; tests call it with a list of flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = given_args(argv)
    if given.get("resume") and "config" in given:
        raise ValueError("--config with --resume: a resumed run's configuration is its own")
    if "LOCAL_WORLD_SIZE" in os.environ:  # a rank torchrun started (the launcher left out
        # --nproc): its host's ranks recorded, which `--resume` and `--config` start again
        given["nproc"] = int(os.environ["LOCAL_WORLD_SIZE"])
    if restarted():  # the job started again after a failure
        given["inject_failure"] = None  # (a test's failure: once)
    found = checkpoint.record(Path(given["resume"])) if given.get("resume") else None
    # Resumed: the flags not given are the run's.
    cfg = resumed_config(given, found[1]["config"]) if found else configured(given)
    # --out holding a run: here, and in every rank before any writes (rank 0's after a
    # collective). This run's checkpoints: it goes on from the last; another run's: refused.
    if cfg.out and cfg.resume:
        refuse_another_run(Path(cfg.out), Path(cfg.resume))
    elif cfg.out and (found := continues(Path(cfg.out), cfg)) is not None:
        launching = cfg.nproc > 1 and "WORLD_SIZE" not in os.environ  # (its rank 0 says it)
        if os.environ.get("RANK", "0") == "0" and not launching:
            print(f"recsz: {cfg.out} holds this run's checkpoint at step {found[1]['step']}: "
                  "going on from it (another --out starts afresh)", flush=True)  # fmt: skip
        given = {k: v for k, v in given.items() if k != "config"} | {"resume": cfg.out}
        cfg = resumed_config(given, found[1]["config"])
    if cfg.tensorboard and (cfg.out or cfg.resume):  # where a run writes a board: not to
        need_tensorboard()  # read one, nor where the flag is idle (no run directory: said)
    if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
        # this host's ranks' tables, refused here where they cannot fit (each rank checks too)
        refuse_tables_that_cannot_fit(cfg, table_owners(cfg, cfg.nproc), Ranks(0, cfg.nproc))
        return launch(cfg.nproc, argv, max_restarts=cfg.max_restarts)

    def status() -> int:  # 128 + the signal it stopped by (a shell's status), or 0
        by = run(cfg).get("stopped")
        return 128 + signal.Signals[by] if by else 0

    return worker(status, as_main=__name__ == "__main__")


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
