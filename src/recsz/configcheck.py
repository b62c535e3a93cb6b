"""Which combinations of `recsz train`'s options no run can take: refused by name when a
:class:`recsz.config.TrainConfig` is made, before any rank starts; and which options the
rest of a configuration leaves idle (:func:`idle`): said, not refused (a sweep may set one
flag for every run)."""

from __future__ import annotations

import importlib.util
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from recsz.codecs.base import EB_MAX, EB_MIN
from recsz.codecs.registry import get_codec_with, takes
from recsz.data.npydays import check_bags, holds_days
from recsz.data.source import check_criteo_layout

if TYPE_CHECKING:
    from recsz.codecs import Codec
    from recsz.config import TrainConfig


def refused(cfg: TrainConfig) -> None:
    """A ValueError naming the flags of the first combination of ``cfg``'s options that no
    run can take (each field's own limits are :func:`recsz.fields.check`'s), before any
    rank starts."""
    _check_bound_values(cfg)
    model = cfg.model()
    n_tables = model.n_tables
    cfg.failure_at()
    cfg.switch()
    if cfg.eval_data is not None and cfg.eval_fraction is not None:
        raise ValueError(
            "--eval-fraction splits --data; with --eval-data all of --data trains and "
            "--eval-data evaluates"
        )
    filed = {"--eval-data": cfg.eval_data is not None, "--eval-fraction": cfg.eval_fraction
             is not None, "--data-order": cfg.data_order != "auto"}  # fmt: skip
    if cfg.data == "synthetic" and (asked := [f for f, on in filed.items() if on]):
        raise ValueError(f"{', '.join(asked)}: for --data from a file (the generator has no "
                         "rows to hold out or order)")  # fmt: skip
    cfg.lr_schedule()  # its steps in order
    for flag, on in (("--target-auc", cfg.target_auc is not None), ("--patience", cfg.patience)):
        if on and not cfg.eval_every:
            raise ValueError(f"{flag} is checked at each evaluation: give --eval-every N")
    spec = cfg.fiited_spec()
    if spec is not None:
        spec.chunks_of(model.emb_dim)  # before any rank starts
    if cfg.column_shards > 1:
        cfg.sharded_tables()  # they divide the dim
        if spec is not None or cfg.tt_tables:
            raise ValueError("--column-shards with --fiited-budget or --tt-tables: a column "
                             "shard is a plain table's (FIITED and TT-Rec split tables their "
                             "own ways)")  # fmt: skip
    if (bsz := cfg.resolved("batch_size")) % cfg.nproc:  # once, before the launch
        raise ValueError(f"--batch-size {bsz} is not divisible by --nproc {cfg.nproc}")
    if cfg.tt_tables > n_tables:
        raise ValueError(f"--tt-tables must be 0 to {n_tables} (the model's tables)")
    if spec is not None and cfg.table_dtype != "fp32":
        raise ValueError(f"--table-dtype {cfg.table_dtype} with --fiited-budget: FIITED's "
                         "chunk store keeps fp32 rows")  # fmt: skip
    if cfg.init_from is not None and cfg.resume is None:  # (resumed: the checkpoint's)
        if spec is not None or cfg.tt_tables:
            raise ValueError("--init-from with --fiited-budget or --tt-tables: their tables "
                             "do not start from dense rows")  # fmt: skip
        from recsz.model.modelfile import read

        read(cfg.init_from).check(model)
    for flag, path in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if not path or path == "synthetic" or not Path(path).exists():
            continue
        if Path(path).is_dir() and holds_days(Path(path)):  # materialized multi-hot: same bags
            check_bags(Path(path), model.table_sizes, cfg.hotness(), cfg.multi_hot_draws)
        else:
            check_criteo_layout(flag, path, model.n_tables, model.n_dense)
    bags = cfg.hotness() is not None  # and --multi-hot parses, before any rank starts
    if not bags and cfg.multi_hot_draws != "hash":
        raise ValueError(
            f"--multi-hot-draws {cfg.multi_hot_draws} draws bags: it needs --multi-hot"
        )
    if bags and cfg.fiited_mask_backward:
        raise ValueError(
            "--multi-hot with --fiited-mask-backward: a bag's rows hold other chunks than "
            "its id's row, whose count the mask reads"
        )
    if cfg.tt_placement == "replicated" and cfg.tt_cache_rows:
        raise ValueError(
            "--tt-cache-rows needs --tt-placement sharded (a replicated table's cached "
            "rows would train apart on each rank)"
        )
    fwd, bwd = cfg.codec("fwd"), cfg.codec("bwd")
    for codec in (fwd, bwd, *([get_codec_with(cfg.dp_codec)] if cfg.dp_comm == "eb" else [])):
        codec.check_installed()  # an optional library (SZ3, ZFP, fbgemm) is missing
    if bwd.forward_mask and not fwd.threshold:
        raise ValueError(
            f"--bwd-codec {cfg.bwd_codec} sends the forward's kept entries; it needs a "
            "thresholding forward codec (--fwd-codec dct)"
        )
    if cfg.cuda_graph and (clash := _graph_clashes(cfg, fwd, bwd)):
        raise ValueError(
            "--cuda-graph replays one fixed-size step on one GPU; it cannot run with "
            + ", ".join(clash)
        )
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device here")
        if cfg.dense_dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError("--dense-dtype bf16, but this GPU has no bfloat16 arithmetic")


def _check_bound_values(cfg: TrainConfig) -> None:
    """The class bounds parse; an absolute bound is one a codec accepts; a relative one is
    below 1 (of the range it is relative to: one of 1 or more spans all of it)."""
    if cfg.dp_eb >= 1:
        raise ValueError(_whole_range("--dp-eb", cfg.dp_eb, "each gradient bucket's range"))
    for d in ("fwd", "bwd"):
        if cfg.eb_policy == "none" and _bounded(cfg, d):  # (the first step's exchange: late)
            codec = getattr(cfg, f"{d}_codec")
            raise ValueError(f"--{d}-codec {codec} needs an error bound: --eb-policy fixed "
                             f"(its bound --{d}-eb), table or dual")  # fmt: skip
        classes = cfg.class_eb(d)
        bounds = (
            (f"--{d}-eb", getattr(cfg, f"{d}_eb")),
            *((f"--{d}-class-eb {c}", v) for c, v in classes.items()),
        )
        if cfg.eb_mode != "abs":
            for flag, eb in bounds:
                if eb >= 1:
                    raise ValueError(_whole_range(flag, eb, "each slice's range (--eb-mode rel)"))
            continue
        for flag, eb in bounds:
            if not EB_MIN <= eb <= EB_MAX:
                raise ValueError(
                    f"{flag} {eb:g} (--eb-mode abs) is outside the codecs' bounds "
                    f"[{EB_MIN:.7g}, {EB_MAX:g}]"
                )


def _whole_range(flag: str, eb: float, of: str) -> str:
    return (f"{flag} {eb:g} is not below 1: a relative bound is a fraction of {of} (0.01: "
            "1%), and one of 1 or more lets every value go as about the same number")  # fmt: skip


def need_tensorboard() -> None:
    """An ImportError naming the package and recsz's extra where ``--tensorboard`` has no
    tensorboard package to write with."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError("--tensorboard needs the tensorboard package: pip install "
                          "tensorboard  (or pip install 'recsz[tensorboard]')")  # fmt: skip


def _graph_clashes(cfg: TrainConfig, fwd: Codec, bwd: Codec) -> list[str]:
    """What ``--cuda-graph`` cannot replay: more than one process, traffic whose sizes
    change every step, host work inside the step (host-coded codecs, DCT thresholds,
    bound checks, FIITED's pruning, TT-Rec's caches and replicated cores)."""
    import torch

    gpu = torch.device("cuda")
    host = [
        f"--{d}-codec {c.codec_id} (coded on the host)"
        for d, c in (("fwd", fwd), ("bwd", bwd))
        if not (c.identity or c.segments_on(gpu)) or c.threshold or c.forward_mask
    ]
    flags = [
        ("--device cpu", cfg.device != "cuda"),
        (f"--nproc {cfg.nproc}", cfg.nproc > 1),
        ("--id-dedup", cfg.id_dedup),
        ("--bwd-coalesce", cfg.bwd_coalesce),
        ("--check-bounds", cfg.check_bounds),
        ("--compress auto", cfg.compress == "auto"),
        ("--fiited-budget", cfg.fiited_budget is not None),
        ("--tt-tables", cfg.tt_tables > 0),
        ("--dense-optimizer adagrad", cfg.resolved("dense_optimizer") == "adagrad"),
        ("a learning-rate schedule", not cfg.lr_schedule().constant),  # rates held in kernels
    ]
    return [f for f, on in flags if on] + host


def idle(cfg: TrainConfig, world: int | None = None) -> list[str]:
    """A line for each option ``cfg`` sets away from its default that nothing in the rest of
    ``cfg`` reads, on ``world`` ranks where given (each such option trains as its default
    would: tested), naming what would make it act."""
    model = cfg.model()
    ranks = world is None or world > 1  # one rank: no MLP gradients to exchange
    on = "" if ranks else " on 2 or more ranks"
    bounded = [d for d in ("fwd", "bwd") if _bounded(cfg, d)]
    policy = cfg.eb_policy if bounded else None
    dct = (cfg.dp_comm == "dct" and ranks) or any(cfg.codec(d).threshold for d in ("fwd", "bwd"))
    dual = "--eb-policy dual with a bounded codec"
    table_or_dual = "--eb-policy table or dual with a bounded codec"
    when = {  # field -> (whether it acts, what would make it)
        "eb_policy": (bool(bounded), "a bounded --fwd-codec or --bwd-codec (hybrid, quant...)"),
        "eb_mode": (bool(bounded) and policy != "none", "a bounded codec and --eb-policy"),
        "fwd_eb": ("fwd" in bounded and policy == "fixed",
                   "a bounded --fwd-codec and --eb-policy fixed (table and dual: --fwd-class-eb)"),
        "bwd_eb": ("bwd" in bounded and policy == "fixed",
                   "a bounded --bwd-codec and --eb-policy fixed (table and dual: --bwd-class-eb)"),
        "fwd_class_eb": ("fwd" in bounded and policy in ("table", "dual"),
                         "a bounded --fwd-codec and --eb-policy table or dual"),
        "bwd_class_eb": ("bwd" in bounded and policy in ("table", "dual"),
                         "a bounded --bwd-codec and --eb-policy table or dual"),
        "hindex_probe_steps": (policy in ("table", "dual"), table_or_dual),
        "hindex_every": (policy in ("table", "dual"), table_or_dual),
        "decay_schedule": (policy == "dual", dual),
        "decay_c": (policy == "dual", dual),
        "decay_t": (policy == "dual", dual),
        "coder": (any(takes(getattr(cfg, f"{d}_codec"), "coder") for d in ("fwd", "bwd")),
                  "a quantizing --fwd-codec or --bwd-codec (hybrid, quant)"),
        "compress_scope": (not all(cfg.codec(d).identity for d in ("fwd", "bwd")),
                           "a --fwd-codec or --bwd-codec other than none"),
        "compress_trial": (cfg.compress == "auto", "--compress auto"),
        "compress_every": (cfg.compress == "auto", "--compress auto"),
        "dp_comm": (ranks, "2 or more ranks (one holds the only copy of the MLPs)"),
        "powersgd_rank": (cfg.dp_comm == "powersgd" and ranks, f"--dp-comm powersgd{on}"),
        "powersgd_warmup": (cfg.dp_comm == "powersgd" and ranks, f"--dp-comm powersgd{on}"),
        "dp_codec": (cfg.dp_comm == "eb" and ranks, f"--dp-comm eb{on}"),
        "dp_eb": (cfg.dp_comm == "eb" and ranks, f"--dp-comm eb{on}"),
        "dp_eb_collective": (cfg.dp_comm == "eb" and ranks, f"--dp-comm eb{on}"),
        "dct_keep": (dct, f"--dp-comm dct{on} or --fwd-codec dct"),
        "dct_refresh": (dct, f"--dp-comm dct{on} or --fwd-codec dct"),
        "dcn_layers": (model.interaction == "dcn", "--interaction dcn"),
        "dcn_rank": (model.interaction == "dcn", "--interaction dcn"),
        "lr_decay_start": (cfg.lr_decay_steps > 0, "--lr-decay-steps"),
        "lr_decay_power": (cfg.lr_decay_steps > 0, "--lr-decay-steps"),
        "synthetic_eval": (cfg.data == "synthetic", "--data synthetic (a file holds its own out)"),
        "checkpoint_every": (bool(cfg.out or cfg.resume), "--out (a run directory to write to)"),
        "resume_fallback": (cfg.resume is not None, "--resume"),
        "tensorboard": (bool(cfg.out or cfg.resume), "--out (a run directory to write to)"),
        "profile_from": (cfg.profile > 0, "--profile N"),
        "max_restarts": (cfg.nproc > 1, "--nproc 2 or more (under torchrun: its own flag)"),
        "tt_cache_interval": (cfg.tt_tables > 0 and cfg.tt_cache_rows > 0,
                              "--tt-tables and --tt-cache-rows"),
    }  # fmt: skip
    for name in ("tt_rank", "tt_cores", "tt_init", "tt_lr", "tt_cache_rows", "tt_placement"):
        when[name] = (cfg.tt_tables > 0, "--tt-tables")
    for name in ("fiited_chunk", "fiited_interval", "fiited_decay", "fiited_mask_backward",
                 "fiited_rule"):  # fmt: skip
        when[name] = (cfg.fiited_budget is not None, "--fiited-budget")
    defaults = {f.name: f.default for f in fields(cfg)}
    return [
        f"--{name.replace('_', '-')} {getattr(cfg, name)} does nothing without {needs}"
        for name, (acts, needs) in when.items()
        if not acts and getattr(cfg, name) != defaults[name]
    ]


def _bounded(cfg: TrainConfig, direction: str) -> bool:
    """Whether ``direction``'s codec takes an error bound from a bound policy."""
    codec = cfg.codec(direction)
    return codec.error_bounded and not codec.threshold
