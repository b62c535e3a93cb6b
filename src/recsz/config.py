"""Training configuration: one typed dataclass, validated on construction.

Each field is declared once, with its default, help and allowed values
(:func:`recsz.fields.opt`); the `recsz train` command line is built from these fields
(:func:`build_parser`), so a flag, its default and its help cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from recsz.commoptions import DenseCommOptions, ExchangeOptions
from recsz.configcheck import refused
from recsz.data.source import DATA_ORDERS, EVAL_FRACTION
from recsz.fields import blamed, check, flag, opt, parser, read_values
from recsz.model import (
    DENSE_OPTIMIZERS,
    INTERACTIONS,
    MLP_INITS,
    PRESETS,
    ROW_OPTIMIZERS,
    TT_INITS,
    FiitedSpec,
    ModelConfig,
    TTSpec,
    get_preset,
)
from recsz.model.fiited import RULES
from recsz.model.multihot import BAG_DRAWS, parse_hotness
from recsz.model.rowopt import TABLE_DTYPES
from recsz.model.schedule import LRSchedule
from recsz.model.sharding import column_shards

#: The tables' default learning rate with bags, as a share of the preset's: at the preset's
#: the first steps' sums of up to 100 moved rows blew the logits up (bench: AUC 0.62 after 30
#: steps against 0.71 at 0.4x; tiny, 400 steps: 0.713 against 0.731).
BAG_EMB_LR = 0.4

CONFIG_VERSION = 17  # 2: --fwd-refs removed; 3: batched tables; 4: --dp-comm hooks;
# 5: --tt-cache-rows/-interval, --tt-placement, --dp-eb-collective; 6: --table-class and
# the linear/log decays removed, --dense-dtype; 7: --cuda-graph; 8: --multi-hot, --mlp-init;
# 9: --mlp-init and (with bags) --emb-lr default to the data's, --host-memory;
# 10: --compress auto; 11: --interaction, --dcn-layers, --dcn-rank, --dense-optimizer;
# 12: --eval-fraction, --eval-data, --data-order; 13: --lr-warmup-steps, --lr-decay-start,
# --lr-decay-steps, --lr-decay-power, --target-auc; 14: --table-dtype; 15: --column-shards;
# 16: --init-from; 17: --multi-hot-draws


@dataclass
class ModelOptions:
    """the model, its data and its schedule"""

    preset: str = opt("tiny", "model shape and training defaults", PRESETS)
    data: str = opt(
        "synthetic",
        "synthetic | a raw Criteo TSV | a `recsz preprocess` dir | a dir of TorchRec's "
        "preprocessed day_N_{dense,sparse,labels}.npy",
    )
    steps: int | None = opt(None, "optimizer steps (default: one epoch, 1000 synthetic)", ge=1)
    batch_size: int | None = opt(None, "global batch, all ranks (default: preset's)", ge=1)
    lr: float | None = opt(None, "MLP learning rate (default: preset's)", gt=0)
    emb_lr: float | None = opt(
        None,
        "embedding learning rate (default: preset's; with --multi-hot bags 0.4x it, since "
        "a bag's sum moves with all its rows)",
        gt=0,
    )
    emb_optimizer: str | None = opt(None, "embedding optimizer (default: preset's)", ROW_OPTIMIZERS)
    table_dtype: str = opt(
        "fp32",
        "what the tables' rows are stored in: fp16 or bf16 hold half the bytes (looked up "
        "into fp32, updated in fp32 and rounded stochastically, as fbgemm's half-precision "
        "tables; not with FIITED)",
        tuple(TABLE_DTYPES),
    )
    column_shards: int = opt(
        1,
        "split every table's columns into K shards of dim/K, each planned, looked up and "
        "exchanged as a table of its own (TorchRec's column-wise sharding: a large table's "
        "memory and lookups spread over K ranks; not with TT or FIITED tables)",
        ge=1,
    )
    lr_warmup_steps: int = opt(
        0,
        "steps over which every learning rate rises linearly to its own, from 1/N of it "
        "(the reference DLRM's warm-up; 0: none)",
        ge=0,
    )
    lr_decay_start: int = opt(
        0, "the step from which every learning rate decays (with --lr-decay-steps)", ge=0
    )
    lr_decay_steps: int = opt(
        0,
        "steps over which every learning rate decays polynomially to 1/N**power of itself, "
        "then stays there (the reference DLRM's decay; 0: none)",
        ge=0,
    )
    lr_decay_power: float = opt(2.0, "the decay's power (the reference DLRM's: 2)", gt=0)
    mlp_init: str | None = opt(
        None,
        "MLP weights' start: dlrm (facebookresearch/dlrm's normal) or torch (PyTorch's "
        "uniform, as TorchRec's DLRM) (default: dlrm, torch with --multi-hot bags: what "
        "learned more on each)",
        MLP_INITS,
    )
    dense_optimizer: str | None = opt(
        None, "the MLPs' optimizer (default: preset's; dcnv2: adagrad)", DENSE_OPTIMIZERS
    )
    interaction: str | None = opt(
        None,
        "how the MLP and the embeddings meet: dot (DLRM's pairwise dot products) or dcn "
        "(DCNv2's low-rank cross layers, MLPerf's DLRM-DCNv2) (default: preset's; dcnv2: dcn)",
        INTERACTIONS,
    )
    dcn_layers: int | None = opt(None, "dcn: cross layers (default: preset's, 3)", ge=1)
    dcn_rank: int | None = opt(
        None, "dcn: rank of each cross layer's weights (default: preset's, 512)", ge=1
    )
    tt_tables: int = opt(0, "TT-Rec: the K largest tables as tensor trains (0: none)", ge=0)
    tt_rank: int = opt(8, "TT-Rec: rank of the tensor-train tables", ge=1)
    tt_cores: int = opt(3, "TT-Rec: cores per tensor-train table", ge=2, le=4)
    tt_init: str = opt("sampled", "TT-Rec: initialization of the cores", TT_INITS)
    fiited_budget: float | None = opt(
        None,
        "FIITED: fraction of each table's dimension chunks kept (default: no pruning)",
        gt=0,
        le=1,
    )
    fiited_chunk: int = opt(8, "FIITED: dims per chunk (divides the embedding dim)", ge=1)
    fiited_interval: int = opt(100, "FIITED: steps between prunings", ge=1)
    fiited_decay: float = opt(0.5, "FIITED: importance kept at each pruning", ge=0, le=1)
    fiited_mask_backward: bool = opt(
        False, "FIITED: send zeros for the pruned chunks' gradients (all ranks know them)"
    )
    fiited_rule: str = opt(
        "fiited", "FIITED: what chooses the chunks (uniform, frequency: baselines)", RULES
    )
    tt_lr: float | None = opt(None, "TT-Rec: the cores' learning rate (default: emb-lr)", gt=0)
    tt_cache_rows: int = opt(0, "TT-Rec: hot rows kept dense per TT table (0: none)", ge=0)
    tt_cache_interval: int = opt(100, "TT-Rec: training steps between cache fills", ge=1)
    tt_placement: str = opt(
        "sharded",
        "TT-Rec: sharded (each TT table on one rank, in the all-to-all) or replicated (on "
        "every rank, cores averaged with the MLP gradients, out of the all-to-all)",
        ("sharded", "replicated"),
    )
    multi_hot: str = opt(
        "",
        "ids per bag of each feature, made from its one-hot id as MLPerf's DLRM-DCNv2 makes "
        "multi-hot Criteo: '' (one), mlperf (its 26 sizes, 214 ids a sample), K or h1,...,hT",
    )
    multi_hot_draws: str = opt(
        "hash",
        "where a bag's other ids come from: hash (of table, slot and id: nothing held) or "
        "mlperf (MLPerf's reference's draws, numpy seeded 0: with TorchRec's one-hot days "
        "and the dcnv2 preset, the bags of its materialized multi-hot Criteo; each rank "
        "holds its tables' draws, rows x (bag - 1) int32: 15.8 GB for dcnv2's feature 20, "
        "drawn in about a minute)",
        BAG_DRAWS,
    )
    seed: int = opt(0, "model init, data order, synthetic teacher")
    eval_every: int = opt(0, "steps between evaluations (0: only at the end)", ge=0)
    target_auc: float | None = opt(
        None,
        "stop at the first evaluation (--eval-every) whose AUC reaches this, as MLPerf's "
        "time-to-train runs do (its DLRM: 0.8025; DLRM-DCNv2: 0.80275); --steps the most",
        gt=0,
        le=1,
    )
    eval_batch_size: int = opt(4096, "evaluation batch (rounded up to ranks' multiple)", ge=1)
    synthetic_eval: int = opt(20_000, "samples in the synthetic evaluation set", ge=1)
    eval_fraction: float | None = opt(
        None,
        f"the share of --data's rows held out for evaluation, its last rows (default: "
        f"{EVAL_FRACTION})",
        gt=0,
        le=0.99,
    )
    data_order: str = opt(
        "auto",
        "a file's training rows each epoch: rows (a permutation of all, 8 bytes a row), "
        "batches (a permutation of its batches of contiguous rows: data preprocessed "
        "shuffled, or too large for rows) or auto (rows up to 2^27 training rows)",
        DATA_ORDERS,
    )
    eval_data: str | None = opt(
        None,
        "a raw Criteo TSV, a `recsz preprocess` dir or a dir of TorchRec's .npy days to "
        "evaluate on (e.g. Terabyte's day_23); all of --data trains then",
    )
    log_every: int = opt(20, "steps between metrics.jsonl rows", ge=0)
    out: str | None = opt(None, "run directory: config.json, metrics.jsonl, summary.json")
    skip_bad_lines: bool = opt(False, "count and report malformed data lines instead of failing")
    nproc: int = opt(1, "local ranks to launch (under torchrun its env decides)", ge=1)
    prefetch: int = opt(2, "batches a thread makes ahead (0: in the loop, no thread)", ge=0)
    dense_dtype: str = opt(
        "fp32",
        "bf16: MLPs and interaction under autocast (pays on Ampere+ GPUs, AVX-512 BF16)",
        ("fp32", "bf16"),
    )
    compile: bool = opt(
        False, "the MLPs and interaction under torch.compile (fewer launches on a GPU)"
    )
    cuda_graph: bool = opt(
        False,
        "one GPU: replay the whole step as a CUDA graph (fixed-size traffic: with "
        "--no-id-dedup --no-bwd-coalesce)",
    )


@dataclass
class JobOptions:
    """the job"""

    device: str = opt("cpu", "cuda: one GPU a rank (LOCAL_RANK), NCCL payloads", ("cpu", "cuda"))
    dist_timeout: float = opt(120.0, "seconds before a stuck collective fails the job", gt=0)
    host_memory: str = opt(
        "keep",
        "host memory a step frees: keep it for the next step (glibc's malloc: no page "
        "faults on large tensors every step) or return it to the system (glibc's default)",
        ("keep", "return"),
    )
    checkpoint_every: int = opt(0, "steps between checkpoints in the run dir (0: none)", ge=0)
    resume: str | None = opt(
        None,
        "run dir to continue from its last complete checkpoint, or one checkpoint "
        "(RUN/checkpoints/step-N)",
    )
    init_from: str | None = opt(
        None,
        "a model file (recsz export) whose tables and MLPs this run starts from, optimizer "
        "state afresh (a warm start: yesterday's model on today's data, other rates)",
    )
    resume_fallback: bool = opt(
        False, "resume from the newest intact checkpoint if the last is damaged"
    )
    keep_checkpoints: int = opt(3, "complete checkpoints kept in the run dir (0: all)", ge=0)
    check_bounds: bool = opt(False, "decode every payload on the sender and assert the bound")
    progress: bool = opt(True, "show a progress bar")
    inject_failure: str | None = opt(None, "RANK:STEP: raise there (tests of fail-fast)")
    config_version: int = opt(CONFIG_VERSION, "format of this record", cli=False)


@dataclass
class TrainConfig(JobOptions, DenseCommOptions, ExchangeOptions, ModelOptions):
    """Everything a run depends on (its options' groups in the order of the command line's
    help). ``None`` means "the preset's default"."""

    def model(self) -> ModelConfig:
        """The preset's model with this run's interaction (what it leaves None, the
        preset's)."""
        m = get_preset(self.preset).model
        mine: dict[str, Any] = {"interaction": self.interaction, "dcn_layers": self.dcn_layers,
                                "dcn_rank": self.dcn_rank}  # fmt: skip
        return replace(m, **{k: v for k, v in mine.items() if v is not None})

    def sharded_tables(self) -> tuple[list[int], int]:
        """The tables as the plan, the exchange and the bound policies see them: their rows
        and width (``--column-shards``: each table's shards, :func:`column_shards`)."""
        m = self.model()
        return column_shards(m.table_sizes, m.emb_dim, self.column_shards)

    def tt_spec(self) -> TTSpec | None:
        """The TT-Rec tables: the ``tt_tables`` largest of the preset (None: no TT)."""
        if not self.tt_tables:
            return None
        sizes = get_preset(self.preset).model.table_sizes
        largest = sorted(range(len(sizes)), key=lambda t: (-sizes[t], t))[: self.tt_tables]
        shape = (self.tt_rank, self.tt_cores, self.tt_init, self.tt_lr)
        cache = (self.tt_cache_rows, self.tt_cache_interval)
        return TTSpec(frozenset(largest), *shape, *cache, self.tt_placement)

    def hotness(self) -> tuple[int, ...] | None:
        """Ids per bag of every table (None: one id, no bags)."""
        return parse_hotness(self.multi_hot, get_preset(self.preset).model.n_tables)

    def lr_schedule(self) -> LRSchedule:
        """The learning rates' warm-up and decay (constant by default)."""
        return LRSchedule(
            self.lr_warmup_steps, self.lr_decay_start, self.lr_decay_steps, self.lr_decay_power
        )

    def fiited_spec(self) -> FiitedSpec | None:
        """FIITED's pruning of the dense tables (None: not asked for)."""
        if self.fiited_budget is None:
            return None
        f = (self.fiited_budget, self.fiited_chunk, self.fiited_interval, self.fiited_decay)
        return FiitedSpec(*f, self.fiited_rule)

    def failure_at(self) -> tuple[int, int] | None:
        """``--inject-failure`` as (rank, step), or None."""
        if not self.inject_failure:
            return None
        try:
            r, s = self.inject_failure.split(":")
            return int(r), int(s)
        except ValueError:
            raise ValueError(
                f"--inject-failure wants RANK:STEP, got {self.inject_failure!r}"
            ) from None

    @classmethod
    def taking(cls, who: str, taken: set[str], **options: Any) -> TrainConfig:
        """A configuration of ``options`` for ``who``, which reads the fields ``taken``
        only: any other option is refused by name, not dropped silently."""
        if unused := sorted(set(options) - taken):
            ours = {f.name for f in fields(cls)}
            known = "options of `recsz train`" if set(unused) <= ours else "not options"
            raise ValueError(
                f"recsz: {who} does not use {', '.join(unused)} ({known}); it takes "
                f"{', '.join(sorted(taken))}"
            )
        return cls(**options)

    def __post_init__(self) -> None:
        check(self)  # each field's own limits
        refused(self)  # what the fields allow together
        if self.log_every == 0:
            self.log_every = 1

    def resolved(self, name: str) -> Any:
        """A field whose None means a default of its own (``batch_size``, ``lr``, ``emb_lr``,
        ``emb_optimizer``, ``dense_optimizer``: the preset's, ``emb_lr`` scaled with bags
        unless the preset has a rate for them; ``mlp_init``: the data's): its value or that."""
        v = getattr(self, name)
        if v is not None:
            return v
        if name == "mlp_init":  # measured: benchmarks/README.md, "Multi-hot bags"
            return "dlrm" if self.hotness() is None else "torch"
        preset = get_preset(self.preset)
        if name == "emb_lr" and self.hotness() is not None:  # (same section)
            return preset.bags_emb_lr or preset.emb_lr * BAG_EMB_LR
        return getattr(preset, name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        return cls(**d)


def build_parser(only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The `recsz train` flags: one per TrainConfig field (``only``: these, no defaults),
    and --config."""
    p = parser(TrainConfig, "recsz train", "Train DLRM with a compressed embedding all-to-all.",
               only)  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="a run's directory or config.json, or a "
                   "JSON / TOML (.toml) file of options (batch_size = 4096): flags given "
                   "override it; --out comes from the command line")  # fmt: skip
    return p


def parse_train_args(argv: list[str] | None) -> TrainConfig:
    """`recsz train`'s configuration: each flag of ``argv`` given, else --config's file's
    value, else the field's default."""
    return configured(given_args(sys.argv[1:] if argv is None else argv))


#: what a resumed run never takes from the run it resumes: where it resumes from and
#: writes (its run directory, whatever the saved path said), a test's injected failure
NOT_RESUMED = ("resume", "out", "resume_fallback", "inject_failure", "config_version")


def given_args(argv: list[str]) -> dict[str, Any]:
    """The flags ``argv`` gives, by field (parsed, not yet checked together), and
    ``config``: --config's file, if given. Parsed by :func:`build_parser` first, so that
    ``--help`` shows every flag's default and a bad flag is named as `recsz train` names it."""
    build_parser().parse_args(argv)
    names = tuple(f.name for f in fields(TrainConfig) if f.metadata["cli"])
    return vars(build_parser(names).parse_args(argv))


def configured(given: dict[str, Any]) -> TrainConfig:
    """The flags ``given`` (:func:`given_args`) over the values of their ``config`` file (a
    run's record: the places in :data:`NOT_RESUMED` its own, not taken; elsewhere refused)."""
    given = dict(given)
    if (path := given.pop("config", None)) is None:
        return TrainConfig(**given)
    if os.path.isdir(path):  # a run's directory: its record
        path = os.path.join(path, "config.json")
    values = read_values(TrainConfig, path)
    record = values.pop("config_version", None) is not None
    for k in set(NOT_RESUMED) & set(values):
        if values.pop(k) is not None and not record:
            raise ValueError(f"{path}: {k!r} is the command line's ({flag(k)}), not a file's")
    try:
        return TrainConfig.from_dict({**values, **given})
    except ValueError as e:
        raise blamed(e, {k: v for k, v in values.items() if k not in given}, path) from None


def resumed_config(given: dict[str, Any], saved: dict[str, Any]) -> TrainConfig:
    """``recsz train --resume RUN [flags]``: the configuration of the run resumed
    (``saved``) but for the flags ``given`` (a checkpoint then refuses what may not
    change) and :data:`NOT_RESUMED`."""
    kept = {k: v for k, v in saved.items() if k not in NOT_RESUMED}
    return TrainConfig.from_dict({**kept, **given})
