"""Training configuration: one typed dataclass, validated on construction, surfaced by the CLI."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from recsz.codecs import available_codecs
from recsz.model.config import PRESETS, get_preset

EB_POLICIES = ("none", "fixed", "table", "dual")
CONFIG_VERSION = 1


@dataclass
class TrainConfig:
    """Everything a run depends on. ``None`` means "the preset's default"."""

    preset: str = "tiny"  # model shape and training defaults (tiny, kaggle, terabyte, bench)
    data: str = "synthetic"  # "synthetic", a raw Criteo TSV, or a `recsz preprocess` dir
    steps: int | None = None  # optimizer steps; file data: one pass; synthetic: 1000
    batch_size: int | None = None  # global batch (all ranks together), samples
    lr: float | None = None  # MLP learning rate (SGD)
    emb_lr: float | None = None  # embedding learning rate
    emb_optimizer: str | None = None  # "sgd" or "adagrad"
    seed: int = 0  # model init, data order, synthetic teacher
    eval_every: int = 0  # steps between evaluations; 0: only at the end
    eval_batch_size: int = 4096  # evaluation batch (rounded up to a multiple of the ranks)
    synthetic_eval: int = 20_000  # size of the synthetic evaluation set, samples
    log_every: int = 20  # steps between metrics.jsonl rows
    out: str | None = None  # run directory: config.json, metrics.jsonl, summary.json
    skip_bad_lines: bool = False  # count and report malformed lines instead of failing
    nproc: int = 1  # local ranks to launch (torchrun); under torchrun the env decides
    fwd_codec: str = "none"  # codec of the forward (embedding) all-to-all
    bwd_codec: str = "none"  # codec of the backward (gradient) all-to-all
    eb_policy: str = "fixed"  # error-bound policy for bounded codecs (both directions)
    fwd_eb: float = 0.03  # forward bound (relative to the slice's range in rel mode)
    bwd_eb: float = 0.03  # backward bound
    eb_mode: str = "rel"  # "rel" (x range of the table's slice) or "abs"
    fwd_class_eb: str = "0.01,0.03,0.05"  # table/dual: tight,base,loose forward bounds
    bwd_class_eb: str = "0.01,0.03,0.05"  # table/dual: tight,base,loose backward bounds
    table_class: str | None = None  # manual classes, e.g. "3=tight,8=loose"
    hindex_probe_steps: int = 10  # iterations of traffic behind each homogenization index
    hindex_every: int = 1000  # iterations between re-classifications (0: classify once)
    decay_schedule: str = "step"  # dual: step | linear | log | constant
    decay_c: float = 2.0  # dual: bound multiplier at iteration 0
    decay_t: int = 65_536  # dual: iteration where the multiplier reaches 1
    id_dedup: bool = True  # forward: one vector per distinct id of a destination's slice
    bwd_coalesce: bool = True  # backward: sum gradients of samples sharing an id first
    fwd_refs: bool = False  # forward: reference vectors the receiver holds within the bound
    ref_cache_rows: int = 8192  # rows per table in each reference cache (LRU)
    dp_comm: str = "allreduce"  # MLP gradients: "allreduce" (DDP) or "dct" (DCT-DP)
    dct_keep: float = 0.01  # DCT: fraction of entries kept (top-k by magnitude)
    dct_refresh: int = 1000  # DCT: iterations between threshold refreshes
    device: str = "cpu"  # "cpu", or "cuda": one GPU a rank (LOCAL_RANK), payloads over NCCL
    dist_timeout: float = 120.0  # seconds before a stuck collective fails the job
    checkpoint_every: int = 0  # steps between checkpoints in the run dir; 0: none
    resume: str | None = None  # run dir to continue from its last complete checkpoint
    check_bounds: bool = False  # decode every payload on the sender and assert the bound
    progress: bool = True  # show a progress bar
    inject_failure: str | None = None  # "RANK:STEP": raise there (tests of fail-fast)
    config_version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        for name in ("steps", "batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("lr", "emb_lr"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")
        if self.emb_optimizer not in (None, "sgd", "adagrad"):
            raise ValueError(f"--emb-optimizer must be sgd or adagrad, got {self.emb_optimizer!r}")
        for name in ("fwd_codec", "bwd_codec"):
            if getattr(self, name) not in available_codecs():
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} is not a codec; "
                    f"available: {', '.join(available_codecs())}"
                )
        if self.eb_policy not in EB_POLICIES:
            raise ValueError(f"--eb-policy must be one of {', '.join(EB_POLICIES)}")
        if self.eb_mode not in ("rel", "abs"):
            raise ValueError(f"--eb-mode must be rel or abs, got {self.eb_mode!r}")
        if not (self.fwd_eb > 0 and self.bwd_eb > 0):
            raise ValueError("error bounds must be positive")
        if self.dp_comm not in ("allreduce", "dct"):
            raise ValueError(f"--dp-comm must be allreduce or dct, got {self.dp_comm!r}")
        if not 0.0 < self.dct_keep <= 1.0:
            raise ValueError(f"--dct-keep must be in (0, 1], got {self.dct_keep}")
        if self.dct_refresh < 1:
            raise ValueError(f"--dct-refresh must be >= 1, got {self.dct_refresh}")
        if self.bwd_codec == "dct-mask" and self.fwd_codec != "dct":
            raise ValueError(
                "--bwd-codec dct-mask sends the forward's kept entries; it needs --fwd-codec dct"
            )
        if self.ref_cache_rows < 1:
            raise ValueError(f"--ref-cache-rows must be >= 1, got {self.ref_cache_rows}")
        if self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda, but torch sees no CUDA device here")
            if self.fwd_refs:
                raise ValueError(
                    "--fwd-refs keeps its reference caches on the CPU: not with --device cuda"
                )
            if self.dp_comm == "dct":
                raise ValueError("--dp-comm dct runs on the CPU only: not with --device cuda")
        if self.dist_timeout <= 0:
            raise ValueError("--dist-timeout must be positive")
        for name in ("eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.log_every == 0:
            self.log_every = 1

    # Resolved values (preset defaults filled in).
    @property
    def resolved_batch_size(self) -> int:
        return self.batch_size or get_preset(self.preset).batch_size

    @property
    def resolved_lr(self) -> float:
        return self.lr or get_preset(self.preset).lr

    @property
    def resolved_emb_lr(self) -> float:
        return self.emb_lr or get_preset(self.preset).emb_lr

    @property
    def resolved_emb_optimizer(self) -> str:
        return self.emb_optimizer or get_preset(self.preset).emb_optimizer

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        return cls(**d)


_HELP = {f.name: f.name for f in fields(TrainConfig)}


def build_parser() -> argparse.ArgumentParser:
    """The `recsz train` flags, one per TrainConfig field."""
    p = argparse.ArgumentParser(
        prog="recsz train",
        description="Train DLRM with a compressed embedding all-to-all.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a("--preset", default="tiny", choices=PRESETS, help="model size and training defaults")
    a("--data", default="synthetic", help="synthetic | raw Criteo TSV | preprocessed dir")
    a("--steps", type=int, help="optimizer steps (default: one pass over a file, 1000 synthetic)")
    a("--batch-size", type=int, help="global batch size, all ranks together (default: preset)")
    a("--lr", type=float, help="MLP learning rate (default: preset)")
    a("--emb-lr", type=float, help="embedding learning rate (default: preset)")
    a("--emb-optimizer", choices=("sgd", "adagrad"), help="embedding optimizer")
    a("--seed", type=int, default=0)
    a("--eval-every", type=int, default=0, help="steps between evaluations (0: at the end)")
    a("--eval-batch-size", type=int, default=4096)
    a("--synthetic-eval", type=int, default=20_000, help="synthetic evaluation samples")
    a("--log-every", type=int, default=20)
    a("--out", help="run directory for config.json, metrics.jsonl, summary.json")
    a("--skip-bad-lines", action="store_true", help="count malformed lines instead of failing")
    a("--nproc", type=int, default=1, help="local ranks to launch with torchrun")
    a("--fwd-codec", default="none", help=f"one of {', '.join(available_codecs())}")
    a("--bwd-codec", default="none", help="codec of the gradient all-to-all")
    a("--eb-policy", default="fixed", choices=EB_POLICIES)
    a("--fwd-eb", type=float, default=0.03, help="forward error bound")
    a("--bwd-eb", type=float, default=0.03, help="backward error bound")
    a(
        "--eb-mode",
        default="rel",
        choices=("rel", "abs"),
        help="bound relative to range or absolute",
    )
    a("--fwd-class-eb", default="0.01,0.03,0.05", help="table/dual: tight,base,loose forward")
    a("--bwd-class-eb", default="0.01,0.03,0.05", help="table/dual: tight,base,loose backward")
    a("--table-class", help="manual table classes, e.g. 3=tight,8=loose")
    a("--hindex-probe-steps", type=int, default=10, help="iterations per homogenization index")
    a("--hindex-every", type=int, default=1000, help="iterations between re-classifications")
    a("--decay-schedule", default="step", choices=("step", "linear", "log", "constant"))
    a("--decay-c", type=float, default=2.0, help="dual: multiplier at iteration 0")
    a("--decay-t", type=int, default=65_536, help="dual: iteration where the multiplier is 1")
    a(
        "--fwd-refs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="forward: send a bit for ids the receiver holds within the bound",
    )
    a("--ref-cache-rows", type=int, default=8192, help="rows per table per reference cache")
    a(
        "--id-dedup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="forward: send one vector per distinct id (both ends know the ids)",
    )
    a(
        "--bwd-coalesce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="backward: sum the gradients of samples sharing an id before sending",
    )
    a(
        "--dp-comm",
        default="allreduce",
        choices=("allreduce", "dct"),
        help="MLP gradient exchange: DDP all-reduce or DCT-DP thresholding",
    )
    a("--dct-keep", type=float, default=0.01, help="DCT: fraction of entries kept")
    a("--dct-refresh", type=int, default=1000, help="DCT: iterations between thresholds")
    a(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where model, batches and payloads live; cuda: one GPU a rank (LOCAL_RANK), "
        "payload bytes over NCCL, small CPU collectives over gloo",
    )
    a("--dist-timeout", type=float, default=120.0, help="collective timeout, seconds")
    a("--checkpoint-every", type=int, default=0)
    a("--resume", help="run directory to resume from")
    a("--check-bounds", action="store_true", help="verify every payload's bound on the sender")
    a("--inject-failure", metavar="RANK:STEP", help="raise on RANK at STEP (fail-fast tests)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def parse_train_args(argv: list[str] | None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns))
