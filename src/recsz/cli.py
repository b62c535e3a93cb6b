"""The one command line: ``recsz train | evaluate | predict | export | preprocess | plan |
plot``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: recsz {train,evaluate,predict,export,preprocess,plan,plot} ... | --version\n\n"
            "  train       train DLRM (recsz train --help)\n"
            "  evaluate    evaluate a run's checkpoint, on any number of ranks\n"
            "  predict     score unlabeled Criteo lines (test layout) with a run's model\n"
            "  export      write a run's model as TorchRec's DLRM (recsz.torchrec.load_dlrm)\n"
            "  preprocess  convert raw Criteo TSVs to memory-mappable arrays\n"
            "  plan        where a run's tables would lie on N ranks, and what each holds\n"
            "  plot        plot a run directory's metrics to PNG files, or compare runs"
        )
        return 0 if argv else 2
    if argv[0] == "--version":
        print(versions())
        return 0
    cmd, rest = argv[0], argv[1:]
    from recsz.console import plain_warnings

    plain_warnings()
    try:
        return _run(cmd, rest)
    except BrokenPipeError:  # its output's reader is gone (`recsz plan | head`): be quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (at exit's flush)
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:  # Ctrl-C (a run with a directory saves a checkpoint first)
        print(f"recsz {cmd}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as e:
        # Bad input (flags, files, data lines, payloads from a rank, what cannot fit in the
        # host's or the GPU's memory, settings under which the loss diverges, an optional
        # library missing): the message names the problem; a traceback would bury it.
        # RECSZ_TRACEBACK=1 shows it.
        oom = _out_of_memory_said(e) if "torch" in sys.modules else None  # (torch's, if run)
        if os.environ.get("RECSZ_TRACEBACK") or not (isinstance(e, _SAID) or oom):
            raise
        print(f"recsz {cmd}: error: {oom or e}", file=sys.stderr)
        return 2


def _out_of_memory_said(e: Exception) -> str | None:
    """``e``'s message and what to change, where it says that memory ran out."""
    from recsz.ranks import out_of_memory, said

    return said(e) if out_of_memory(e) else None


#: What ``recsz`` says as a line, without a traceback (and torch's OutOfMemoryError).
_SAID = (ValueError, FloatingPointError, OSError, IndexError, MemoryError, ImportError)


def versions() -> str:
    """recsz's version and those of what it runs on (for a bug report)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from recsz import __version__

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    fbgemm = of("fbgemm-gpu") if of("fbgemm-gpu") != "absent" else of("fbgemm-gpu-cpu")
    python = sys.version.split()[0]
    return (f"recsz {__version__} (Python {python}, torch {torch.__version__}, {cuda}, "
            f"triton {of('triton')}, torchrec {of('torchrec')}, fbgemm-gpu {fbgemm})")  # fmt: skip


def _run(cmd: str, rest: list[str]) -> int:
    if cmd == "train":
        from recsz.train import main as train_main

        return train_main(rest)
    if cmd == "evaluate":
        from recsz.evaluation import main as evaluate_main

        return evaluate_main(rest)
    if cmd == "predict":
        from recsz.prediction import main as predict_main

        return predict_main(rest)
    if cmd == "export":
        if importlib.util.find_spec("torchrec") is None:
            raise ImportError(
                "it writes TorchRec's DLRM and needs TorchRec: pip install torchrec (with "
                "the fbgemm-gpu matching your torch; README.md, 'With TorchRec')"
            )
        from recsz.torchrec.export import main as export_main

        return export_main(rest)
    if cmd == "preprocess":
        return _preprocess(rest)
    if cmd == "plan":
        return _plan(rest)
    if cmd == "plot":
        from recsz.plot import main as plot_main

        return plot_main(rest)
    print(
        f"recsz: unknown command {cmd!r} (train, evaluate, predict, export, preprocess, plan, "
        "plot)",
        file=sys.stderr,
    )
    return 2


def _preprocess(argv: list[str]) -> int:
    from recsz.config import TrainConfig
    from recsz.data import preprocessed
    from recsz.model import PRESETS

    p = argparse.ArgumentParser(
        prog="recsz preprocess", description="Raw Criteo TSV -> binary arrays (memory-mapped)."
    )
    p.add_argument(
        "raw",
        nargs="+",
        help="raw Criteo file(s), plain or .gz, read in order into one set (Kaggle "
        "train.txt, or Terabyte's day_0 .. day_22)",
    )
    p.add_argument("out_dir")
    p.add_argument(
        "--preset",
        default="tiny",
        choices=PRESETS,
        help="hash categories into this preset's table sizes",
    )
    p.add_argument(
        "--max-rows", type=int, help="rows of each table at most (as recsz train's --max-rows)"
    )
    p.add_argument("--skip-bad-lines", action="store_true")
    p.add_argument(
        "--jobs", type=int, default=1, help="files parsed at once (processes), then joined in order"
    )
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    sizes = TrainConfig(preset=a.preset, max_rows=a.max_rows).model().table_sizes
    stats = preprocessed.preprocess(
        a.raw, a.out_dir, sizes, skip_bad_lines=a.skip_bad_lines, jobs=a.jobs
    )
    print(
        f"{a.out_dir}: {stats.lines} rows ({stats.padded} padded, {stats.skipped} skipped"
        + (f"; first bad line: {stats.first_error}" if stats.skipped else "")
        + ")"
    )
    return 0


def _plan(argv: list[str]) -> int:
    """``recsz plan``: the table-wise plan of a run's tables (``--config``: a run's or a
    file's options, else recsz train's defaults; flags given over them) on ``--nproc``
    ranks (no training): each rank's tables, rows, table and row-optimizer bytes (and with
    ``--multi-hot-draws mlperf`` its tables' draws), and share of the forward all-to-all's
    bytes."""
    import json

    from recsz.config import TrainConfig, configured
    from recsz.fields import parser
    from recsz.model.rowopt import TABLE_DTYPES
    from recsz.model.sharding import rank_loads
    from recsz.step import held_bytes, rank_draws, table_owners

    flags = ("preset", "nproc", "column_shards", "table_dtype", "emb_optimizer", "multi_hot",
             "multi_hot_draws", "emb_dim", "max_rows", "table_rows")  # fmt: skip
    p = parser(TrainConfig, "recsz plan", "Where a run's tables would lie on --nproc ranks, "
               "and what each rank would hold and send (no training).", only=flags,
               otherwise="recsz train's")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="the run to plan: a run's directory or "
                   "config.json, or a JSON / TOML file of recsz train's options; flags given "
                   "override it")  # fmt: skip
    p.add_argument("--json", default=None, help="write each rank's load to this file")
    a = p.parse_args(argv)
    given = {k: getattr(a, k) for k in (*flags, "config") if hasattr(a, k)}

    def split(values: dict) -> dict:  # a batch the ranks divide (the plan takes none)
        n = values.get("nproc", 1)
        return {**values, "batch_size": n if isinstance(n, int) and n >= 1 else 1}

    cfg = configured(given, split)  # each flag checked, named as given (or file and key)
    world = cfg.nproc
    sizes, dim = cfg.sharded_tables()
    optimizer = cfg.resolved("emb_optimizer")
    value = TABLE_DTYPES[cfg.table_dtype].itemsize
    owners = table_owners(cfg, world)  # the run's plan (TT tables charged their cores)
    loads = rank_loads(sizes, dim, owners, world, value, optimizer)
    for x, d in zip(loads, rank_draws(cfg, owners, world), strict=True):
        x["draws_bytes"] = d  # MLPerf's draws: a table's once on each rank of its shards
    gb = 1e9
    print(f"recsz plan: preset {cfg.preset}, {world} rank(s), {len(sizes)} tables of dim {dim} "
          f"({cfg.column_shards} column shard(s) a table), {cfg.table_dtype} rows, "
          f"{optimizer}")  # fmt: skip
    print("  rank  tables        rows   tables GB  optimizer GB  bags' draws GB  forward bytes "
          "share")  # fmt: skip
    for r, x in enumerate(loads):
        print(f"  {r:4d}  {x['tables']:6d}  {x['rows']:10d}  {x['table_bytes'] / gb:10.2f}  "
              f"{x['optimizer_bytes'] / gb:12.2f}  {x['draws_bytes'] / gb:14.2f}  "
              f"{x['send_share']:19.3f}")  # fmt: skip
    held = held_bytes(cfg, owners, world)  # what a run holds each rank to (step.py)
    for x, h in zip(loads, held, strict=True):
        x["held_bytes"] = h
    print(f"  most a rank {max(held) / gb:.2f} GB, mean {sum(held) / world / gb:.2f} GB; "
          f"{sum(1 for x in loads if not x['tables'])} rank(s) hold no table; largest share "
          f"of the forward bytes {max(x['send_share'] for x in loads):.3f} (even: "
          f"{1 / world:.3f})")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {k: getattr(cfg, k) for k in flags}, "ranks": loads}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
