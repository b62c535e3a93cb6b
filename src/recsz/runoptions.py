"""The options of a run's model, data and schedule (:class:`ModelOptions`) and of its job
(:class:`JobOptions`: device, checkpoints, where it resumes from), each a dataclass of fields
(:func:`recsz.fields.opt`) that :class:`recsz.config.TrainConfig` inherits, beside the
communication's (:mod:`recsz.commoptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from recsz.data.source import DATA_ORDERS, EVAL_FRACTION
from recsz.fields import opt
from recsz.model import DENSE_OPTIMIZERS, INTERACTIONS, MLP_INITS, PRESETS, ROW_OPTIMIZERS, TT_INITS
from recsz.model.fiited import RULES
from recsz.model.multihot import BAG_DRAWS
from recsz.model.rowopt import TABLE_DTYPES

CONFIG_VERSION = 19  # 2: --fwd-refs removed; 3: batched tables; 4: --dp-comm hooks;
# 5: --tt-cache-rows/-interval, --tt-placement, --dp-eb-collective; 6: --table-class and
# the linear/log decays removed, --dense-dtype; 7: --cuda-graph; 8: --multi-hot, --mlp-init;
# 9: --mlp-init and (with bags) --emb-lr default to the data's, --host-memory;
# 10: --compress auto; 11: --interaction, --dcn-layers, --dcn-rank, --dense-optimizer;
# 12: --eval-fraction, --eval-data, --data-order; 13: --lr-warmup-steps, --lr-decay-start,
# --lr-decay-steps, --lr-decay-power, --target-auc; 14: --table-dtype; 15: --column-shards;
# 16: --init-from; 17: --multi-hot-draws; 18: --emb-dim, --bottom-mlp, --top-mlp, --max-rows;
# 19: --table-rows, --dense-features


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
        "uniform, as TorchRec's DLRM) (default: dlrm, torch with --multi-hot bags or more "
        "than 26 tables: what learned more on each)",
        MLP_INITS,
    )
    dense_optimizer: str | None = opt(
        None, "the MLPs' optimizer (default: preset's; dcnv2: adagrad)", DENSE_OPTIMIZERS
    )
    emb_dim: int | None = opt(
        None,
        "every table's vector length (default: preset's; the bottom MLP's last width "
        "follows it unless --bottom-mlp is given)",
        ge=1,
    )
    table_rows: str | None = opt(
        None,
        "rows of each embedding table, comma-separated, COUNTxROWS for several alike "
        "(40x1000000,5000): a model of other tables than the preset's 26 of Criteo, whose "
        "data is synthetic or TorchRec-layout .npy days with a sparse column a table "
        "(default: preset's; --max-rows caps them)",
        sep=",",
    )
    dense_features: int | None = opt(
        None,
        "dense inputs a sample (default: Criteo's 13; with other than 13, the data is "
        "synthetic or .npy days with as many dense columns)",
        ge=1,
    )
    bottom_mlp: str | None = opt(
        None,
        "the bottom MLP's widths after the dense inputs, dash-separated, the last the "
        "embedding dim (default: preset's; bench: 512-256-64)",
        sep="-",
    )
    top_mlp: str | None = opt(
        None,
        "the top MLP's widths after the interaction, dash-separated, the last 1 (the logit) "
        "(default: preset's; bench: 512-512-256-1)",
        sep="-",
    )
    max_rows: int | None = opt(
        None,
        "rows of each table at most, its ids hashed into them (the reference DLRM's "
        "--max-ind-range; default: preset's; a `recsz preprocess` dir is hashed alike: "
        "preprocess it with the same --max-rows)",
        ge=2,
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
    patience: int = opt(
        0,
        "stop once this many evaluations in a row (--eval-every) have not raised the best "
        "held-out AUC, as early stopping does (0: never); the summary names the kept "
        "checkpoint whose evaluation scored best",
        ge=0,
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
    # (no new CONFIG_VERSION: it changes nothing that trains, a record without it reads 0)
    max_restarts: int = opt(
        0,
        "torchrun's restarts of the job's ranks after a failure (`recsz train --nproc N`'s "
        "launcher; torchrun's own flag where you launch it): each restart resumes from the "
        "run's last checkpoint (--out, --checkpoint-every), or starts over where it has none",
        ge=0,
    )
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
    tensorboard: bool = opt(
        False,
        "also write metrics.jsonl's rows as TensorBoard scalars in RUN/tensorboard/ "
        "(`tensorboard --logdir RUN`; needs the tensorboard package)",
    )
    profile: int = opt(
        0,
        "steps to profile (torch profiler) after the first 3, a bound policy's probes and "
        "--compress auto's first trial: "
        "ms a step per stage said, "
        "each rank's trace in RUN/profile/ (Perfetto), the numbers in RUN/profile.json",
        ge=0,
    )
    profile_from: int | None = opt(
        None,
        "--profile's first step (default: past the first 3, a bound policy's probes and "
        "--compress auto's first trial; earlier where the run ends before N more steps)",
        ge=0,
    )
    inject_failure: str | None = opt(
        None, "RANK:STEP: raise there (tests of fail-fast; not in a restarted job)"
    )
    config_version: int = opt(CONFIG_VERSION, "format of this record", cli=False)
