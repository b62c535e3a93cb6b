"""``recsz predict RUN FILE... --out P``: a run's model scores unlabeled samples.

Criteo's test files (the Display Advertising Challenge's ``test.txt``) hold 39 fields a
line, the label left out; this reads them (plain or gzipped, several in order), streamed a
batch at a time (:mod:`recsz.data.stream`). A directory of TorchRec-layout ``.npy`` days
(``day_N_dense.npy`` and ``day_N_sparse.npy``, a model of any shape's; labels not needed)
is read as it lies instead. On any number of ranks (default: as many as wrote the
checkpoint, its tables resharded where that differs); every sample's click probability is
written in order: a ``.npy`` of N float32, or any other name a text file of one
probability a line. Labeled files are `recsz evaluate`'s (``--predictions``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from recsz.data.npydays import holds_days
from recsz.data.source import DataSource, unlabeled_source
from recsz.data.stream import RawStream
from recsz.evaluation import WHERE, entry, evaluate, restored, run_parser

#: what `recsz predict` may set besides where it runs, the rest being the run's
_HOW = ("eval_batch_size", "skip_bad_lines", "progress")


def build_parser() -> argparse.ArgumentParser:
    p = run_parser(
        "recsz predict",
        "Score unlabeled Criteo lines (the test layout: 39 fields, no label), or a "
        "directory of TorchRec-layout .npy days (labels not needed), with a run's model (its "
        "newest complete checkpoint, or the one named), on any number of ranks (default: as "
        "many as wrote the checkpoint).",
        _HOW,
    )
    p.add_argument(
        "data",
        nargs="+",
        help="unlabeled Criteo file(s), plain or .gz, in order; or one directory of .npy days",
    )
    p.add_argument(
        "--out",
        required=True,
        help="where the predictions go, in the files' order: a .npy file (N float32), or "
        "text (one probability a line)",
    )
    p.add_argument("--json", default=None, help="write the count, step and seconds to this file")
    return p


def run(argv: list[str]) -> dict[str, Any]:
    """Score on this process's rank; rank 0 writes the predictions."""
    args = build_parser().parse_args(argv)
    with restored(args, (*WHERE, *_HOW)) as r:
        m = r.cfg.model()
        source: DataSource = (
            unlabeled_source(args.data[0], m.table_sizes, m.n_dense)
            if Path(args.data[0]).is_dir()
            else RawStream(args.data, m.table_sizes, r.on.skip_bad_lines, False, m.n_dense)
        )
        ev = evaluate(r.parts, source, r.on, r.step, r.ranks, predictions=True)
        assert ev is not None  # (no `heard`: nothing ends it early)
        preds = ev.pop("predictions", None)
        result = {**ev, "step": r.step, "checkpoint": str(r.ckpt), "data": source.name,
                  "world_size": r.ranks.world, "out": args.out}  # fmt: skip
        if preds is not None:  # rank 0
            p = preds[:, 0].float().cpu().numpy()
            if args.out.endswith(".npy"):
                np.save(args.out, p)
            else:
                np.savetxt(args.out, p, fmt="%.7g")
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
            print(
                f"recsz: {r.ckpt} (step {r.step}) scored {ev['eval_samples']} samples of "
                f"{source.name} on {r.ranks.world} rank(s) into {args.out} "
                f"({ev['eval_s']:.1f} s)",
                flush=True,
            )
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of `recsz predict`; tests call it with a list of flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for f in args.data:
        if Path(f).is_dir():
            if len(args.data) > 1:
                raise ValueError(f"{f}: a directory of .npy days is scored alone, not beside "
                                 "other files")  # fmt: skip
            if not holds_days(Path(f)):
                raise FileNotFoundError(f"{f}: no day_N_dense.npy (TorchRec-layout .npy days)")
        elif not Path(f).is_file():
            raise FileNotFoundError(f"{f}: no such file")
    body = lambda: run(argv)  # noqa: E731
    return entry(argv, args, "recsz.prediction", body, __name__ == "__main__", ("out", "json"))


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
