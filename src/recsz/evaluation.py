"""Evaluating a model: during training (:func:`evaluate`) and from a checkpoint, on any
number of ranks (``recsz evaluate RUN``, :func:`main`).

Each rank makes its part of every held-out batch (prefetched as training batches are),
predicts its samples and keeps the predictions on its device; rank 0 gathers them all
once at the end and computes the numbers there (:mod:`recsz.metrics`), which every rank
then receives: no host read a batch, and one rank's memory holds the whole set.

``recsz evaluate RUN`` (or ``RUN/checkpoints/step-N``) takes the model the run's newest
complete checkpoint holds, with the run's configuration, on the ranks asked (its tables
resharded where their number differs, :mod:`recsz.checkpoint`), evaluates it on the run's
held-out set or on ``--eval-data``, prints the numbers and, asked, writes them
(``--json``) and every sample's prediction and label in the set's order
(``--predictions``, an (N, 2) float32 ``.npy``): the reference DLRM's ``--inference-only``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from recsz import checkpoint, console, report
from recsz.checkpointwrite import best_checkpoint
from recsz.config import TrainConfig
from recsz.configcheck import need_tensorboard
from recsz.data.prefetch import prefetch
from recsz.data.source import DataSource, Part, held_out_source, make_source
from recsz.fields import parser
from recsz.launcher import launch
from recsz.metrics import NUMBERS, binary_metrics
from recsz.ranks import Ranks, worker
from recsz.step import Parts, build_parts, forward, rank_part


# ---- an evaluation ----------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    parts: Parts,
    source: DataSource,
    cfg: TrainConfig,
    step: int,
    ranks: Ranks,
    predictions: bool = False,
    heard: Callable[[], bool] | None = None,
) -> dict[str, Any] | None:
    """The held-out set's numbers (:data:`recsz.metrics.NUMBERS`: AUC, logloss, accuracy,
    NE, calibration, click rate; every rank returns the same; none where its labels are
    not known: ``source.labeled`` False) and its size and seconds; with ``predictions``, rank
    0's also holds them ("predictions": (N, 2) prediction and label of every sample, in the
    set's order, on its device). The exchange codes evaluation batches as training ones
    but feeds no policy or counter. ``heard``: called by every rank after each batch, the
    same answer on each (:meth:`recsz.stopping.Stopping.heard`); True ends the evaluation
    there, unfinished: None."""
    parts.exchange.train(False)
    try:
        return _evaluate(parts, source, cfg, step, ranks, predictions, heard)
    finally:
        parts.exchange.train(True)


def _evaluate(
    parts: Parts,
    source: DataSource,
    cfg: TrainConfig,
    step: int,
    ranks: Ranks,
    predictions: bool,
    heard: Callable[[], bool] | None,
) -> dict[str, Any] | None:
    t0 = time.perf_counter()
    w, rank = ranks.world, ranks.rank
    size = math.ceil(cfg.eval_batch_size / w) * w
    part = rank_part(parts, ranks)
    preds = _Appended(ranks.device)
    shares = []  # each batch's samples per rank, known to every rank
    # rank 0's count of the samples so far (on a terminal, under the training's bar)
    with console.bar(cfg.progress and rank == 0, desc="evaluate", unit=" samples",
                    unit_scale=True, leave=False) as bar:  # fmt: skip
        for batch in prefetch(source.eval_batches(size, part), ranks.device, cfg.prefetch):
            n = len(batch)
            b = -(-n // w)
            batch = batch.padded(b * w)  # the set's last batch: zeros up to equal slices
            mine = batch.slice(rank * b, (rank + 1) * b)
            p = torch.sigmoid(forward(parts, mine.dense, batch.ids, step).float())
            shares.append([len(range(n)[Part(q, w, ()).rows(n)]) for q in range(w)])  # no pad
            keep = shares[-1][rank]
            preds.append(p[:keep], mine.labels[:keep])
            bar.update(n)
            if heard is not None and heard():
                return None
    counts = [sum(s[q] for s in shares) for q in range(w)]
    if sum(counts) == 0:
        raise ValueError(f"{source.name}: the evaluation set is empty")
    both = _gathered(preds.values(), counts, ranks)
    out: dict[str, Any] = {"eval_samples": sum(counts)}
    if source.labeled:
        numbers = torch.zeros(len(NUMBERS), dtype=torch.float64)
        if both is not None:
            got = binary_metrics(both[0], both[1])
            numbers = torch.tensor([got[k] for k in NUMBERS], dtype=torch.float64)
        if w > 1:
            dist.broadcast(numbers, src=0)
        out.update(zip(NUMBERS, numbers.tolist(), strict=True))
    out["eval_s"] = time.perf_counter() - t0
    if predictions and both is not None:
        out["predictions"] = both.t()[_set_order(shares, both.device)]
    return out


class _Appended:
    """Predictions and labels appended batch after batch into one (2, capacity) buffer
    that doubles when full: a set of millions held in a few allocations, not one a batch
    (a small block a batch, kept among each batch's transient ones, grew glibc's heap by
    about a megabyte a batch: benchmarks/README.md, "Scoring files")."""

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.empty((2, 0), device=device)
        self.n = 0

    def append(self, p: torch.Tensor, labels: torch.Tensor) -> None:
        k = p.shape[0]
        if self.n + k > self.buf.shape[1]:
            grown = p.new_empty((2, max(2 * self.n + k, 1 << 16)))
            grown[:, : self.n] = self.buf[:, : self.n]
            self.buf = grown
        self.buf[0, self.n : self.n + k] = p
        self.buf[1, self.n : self.n + k] = labels
        self.n += k

    def values(self) -> torch.Tensor:
        """The (2, n) appended so far."""
        return self.buf[:, : self.n]


def _gathered(mine: torch.Tensor, counts: list[int], ranks: Ranks) -> torch.Tensor | None:
    """Every rank's (2, counts[rank]) predictions and labels, side by side on rank 0 (one
    gather, each rank's padded to the largest count); None on the other ranks."""
    if ranks.world == 1:
        return mine
    longest = max(counts)
    padded = mine.new_zeros((2, longest))
    padded[:, : mine.shape[1]] = mine
    into = [torch.empty_like(padded) for _ in counts] if ranks.rank == 0 else None
    dist.gather(padded, into, dst=0)
    if into is None:
        return None
    return torch.cat([g[:, :c] for g, c in zip(into, counts, strict=True)], 1)


def _set_order(shares: list[list[int]], device: torch.device) -> torch.Tensor:
    """Where each sample of the set lies among the gathered ones (rank 0's of every batch,
    then rank 1's, ...): batch after batch, a batch's ranks' slices one after another."""
    s = torch.tensor(shares, dtype=torch.int64)  # (batches, ranks)
    counts = s.sum(0)
    first = (counts.cumsum(0) - counts) + (s.cumsum(0) - s)  # each (batch, rank)'s first
    n = s.reshape(-1)  # runs in the set's order
    start = n.cumsum(0) - n
    within = torch.arange(int(n.sum())) - start.repeat_interleave(n)
    return (first.reshape(-1).repeat_interleave(n) + within).to(device)


# ---- recsz evaluate ---------------------------------------------------------------------
#: what `recsz evaluate` and `recsz predict` may set, the rest being the run's: where they
#: run (what may change under a checkpoint) and what `evaluate` evaluates on
WHERE = ("nproc", "device", "prefetch", "dist_timeout")
_WHAT = ("eval_data", "synthetic_eval", "eval_batch_size", "skip_bad_lines", "progress")
_OUTPUTS = ("json", "predictions")


#: what ``RUN/best`` names: the run's kept checkpoint whose evaluation scored best
BEST = "best"
RUN_HELP = (
    "a run directory (its newest complete checkpoint), one checkpoint of it "
    f"(RUN/checkpoints/step-N), or RUN/{BEST}: the kept one whose evaluation scored best"
)


def run_parser(prog: str, description: str, flags: tuple[str, ...]) -> argparse.ArgumentParser:
    """A command on a run's checkpoint: its ``run``, and ``TrainConfig``'s flags of where it
    runs (:data:`WHERE`) and ``flags``, each defaulting to the run's."""
    p = parser(TrainConfig, prog, description, only=(*WHERE, *flags), otherwise="the run's")
    p.add_argument("run", help=RUN_HELP)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = run_parser(
        "recsz evaluate",
        "Evaluate a run's model (its newest complete checkpoint, or the one named) on its "
        "held-out set or on --eval-data, on any number of ranks (default: as many as wrote "
        "the checkpoint).",
        _WHAT,
    )
    p.add_argument("--json", default=None, help="write the numbers, step and data to this file")
    p.add_argument(
        "--tensorboard",
        action="store_true",
        default=False,
        help="add the numbers at the checkpoint's step to the run's TensorBoard, as a board "
        "of their own beside the training's (RUN/tensorboard/evaluate-DATA: DATA the "
        "--eval-data file's name, or held-out), drawn on its eval/* charts",
    )
    p.add_argument(
        "--predictions",
        default=None,
        help="write each sample's prediction and label, in the set's order, to this .npy "
        "file (N rows of 2 float32)",
    )
    return p


def chosen(run: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``run`` names (a run: its newest complete one; ``RUN/best``: the one
    :func:`checkpointwrite.best_checkpoint` finds) and its record."""
    if run.name == BEST and not run.exists() and (run.parent / "checkpoints").is_dir():
        best = best_checkpoint(run.parent)
        if best is None:
            raise FileNotFoundError(
                f"{run}: no kept checkpoint of {run.parent} was evaluated (a run keeps one's "
                "AUC where --eval-every and --checkpoint-every meet, and at its last step)"
            )
        run = Path(best["path"])
    found = checkpoint.record(run)
    if found is None:
        raise FileNotFoundError(checkpoint.nothing_kept(run))
    return found


@dataclass
class Restored:
    """A run's model restored on this rank: the checkpoint, its step, the configuration
    it was loaded with (the run's, but where it runs), the one it reads data with (also
    the other flags given), the rank and its parts."""

    ckpt: Path
    step: int
    cfg: TrainConfig
    on: TrainConfig
    ranks: Ranks
    parts: Parts


@contextmanager
def restored(args: argparse.Namespace, flags: tuple[str, ...]) -> Iterator[Restored]:
    """The checkpoint ``args.run`` names, loaded on this process's rank (its tables
    resharded where the number of ranks differs), in the run's configuration but for the
    ``flags`` given in ``args``; the rank's group closed at the end."""
    ckpt, meta = chosen(Path(args.run))
    given = {k: getattr(args, k) for k in flags if hasattr(args, k)}
    where = {k: v for k, v in given.items() if k in WHERE}  # what a checkpoint allows
    saved = TrainConfig.from_dict(meta["config"])
    cfg = replace(saved, **where, resume=str(ckpt), out=None)
    on = replace(cfg, **{k: v for k, v in given.items() if k not in WHERE and k != "eval_data"})
    ranks = Ranks.from_env(cfg.dist_timeout, cfg.device)
    ok = False
    try:
        parts, _ = build_parts(cfg, ranks, train=False)  # no optimizers: it only scores
        step, _ = checkpoint.load(ckpt, parts, cfg, ranks)
        yield Restored(ckpt, step, cfg, on, ranks, parts)
        ok = True
    finally:
        ranks.close(ok)


def run(argv: list[str]) -> dict[str, Any]:
    """Evaluate on this process's rank; returns the numbers (the same on every rank)."""
    args = build_parser().parse_args(argv)
    with restored(args, (*WHERE, *_WHAT)) as r:
        m = r.cfg.model()
        # Another file stands alone (the run may have trained on any data).
        if (eval_data := getattr(args, "eval_data", None)) is not None:
            source = held_out_source(eval_data, m.table_sizes, r.on.skip_bad_lines, m.n_dense)
        else:
            c = r.on
            source = make_source(c.data, m.table_sizes, c.seed, c.skip_bad_lines,
                                 c.synthetic_eval, c.eval_fraction, c.eval_data, c.data_order,
                                 m.n_dense)  # fmt: skip
        ev = evaluate(r.parts, source, r.on, r.step, r.ranks, args.predictions is not None)
        assert ev is not None  # (no `heard`: nothing ends it early)
        preds = ev.pop("predictions", None)
        result = {**ev, "step": r.step, "checkpoint": str(r.ckpt), "data": source.name,
                  "world_size": r.ranks.world}  # fmt: skip
        if r.ranks.rank == 0:
            if preds is not None:
                np.save(args.predictions, preds.float().cpu().numpy())
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
            if args.tensorboard:
                label = "held-out" if eval_data is None else Path(eval_data).name
                name = "evaluate-" + re.sub(r"[^\w.-]", "_", label)
                where = report.add_to_board(r.ckpt.parent.parent, name, r.step, ev)
                print(f"recsz: added to {where}", flush=True)
            auc = " ".join(filter(None, [f"AUC {ev['auc']:.5f}", report.one_class(ev)]))
            print(
                f"recsz: {r.ckpt} (step {r.step}) on {source.name}, {ev['eval_samples']} "
                f"samples, {r.ranks.world} rank(s): {auc}, logloss "
                f"{ev['logloss']:.5f}, accuracy {ev['accuracy']:.5f}, NE {ev['ne']:.5f}, "
                f"calibration {ev['calibration']:.4f} ({ev['eval_s']:.1f} s)",
                flush=True,
            )
    return result


def writable(args: argparse.Namespace, outputs: tuple[str, ...]) -> None:
    """The files the flags ``outputs`` name have a directory to go to (FileNotFoundError
    naming the flag otherwise): checked before any work, not after."""
    for flag in outputs:
        out = getattr(args, flag, None)
        if out is not None and not Path(out).resolve().parent.is_dir():
            raise FileNotFoundError(f"--{flag} {out}: no directory {Path(out).parent} to write to")


def entry(argv: list[str], args: argparse.Namespace, module: str, body: Callable[[], object],
          as_main: bool, outputs: tuple[str, ...]) -> int:  # fmt: skip
    """Run ``body`` on this process's rank, or launch ``module`` on the ranks asked
    (``--nproc``; default: as many as wrote the checkpoint). The files the flags
    ``outputs`` name must have a directory to go to: refused before any work, not after."""
    writable(args, outputs)
    if "WORLD_SIZE" not in os.environ:
        saved = chosen(Path(args.run))[1]  # named here, not by every rank launched
        nproc = getattr(args, "nproc", None) or int(saved["world_size"])
        if nproc > 1:
            return launch(nproc, argv, module)

    def rank_body() -> int:
        body()
        return 0

    return worker(rank_body, as_main)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `recsz evaluate`; tests call it with a list of flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if (data := getattr(args, "eval_data", None)) is not None and not Path(data).exists():
        raise FileNotFoundError(f"--eval-data {data}: no such file or directory")
    if args.tensorboard:
        need_tensorboard()
    body = lambda: run(argv)  # noqa: E731
    return entry(argv, args, "recsz.evaluation", body, __name__ == "__main__", _OUTPUTS)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
