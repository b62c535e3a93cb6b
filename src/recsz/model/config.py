"""Model configuration and the named presets.

The ``kaggle`` preset is the configuration of the published compression study
(arXiv 2407.04272, after facebookresearch/dlrm's Kaggle benchmark); ``terabyte`` follows
the MLPerf DLRM reference, ``dcnv2`` MLPerf's DLRM-DCNv2 (its successor); ``tiny`` is small
enough for CI and the 2-core demo.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# Distinct values of C1..C26 in the full Criteo Kaggle data (facebookresearch/dlrm).
KAGGLE_COUNTS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Distinct values in Criteo Terabyte (MLPerf DLRM), before the index-range cap.
TERABYTE_COUNTS = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346,
    10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip

# MLPerf's DLRM-DCNv2 reference: its tables' rows (Criteo 1TB, capped at 40M; its
# ``--num_embeddings_per_feature``), the dcnv2 preset's as they are.
MLPERF_DCNV2_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip


def table_sizes_for(
    counts: tuple[int, ...], max_index_range: int, oversize: int = 1
) -> tuple[int, ...]:
    """Rows per table: ``oversize`` x the distinct count (fewer hash collisions), capped,
    plus row 0 for "missing"."""
    return tuple(min(c * oversize, max_index_range) + 1 for c in counts)


#: ``dot``: the pairwise dot products of [x, e_1, ..., e_T] beside x (DLRM); ``dcn``: DCNv2's
#: low-rank cross layers over their concatenation (MLPerf's DLRM-DCNv2, TorchRec's DLRM_DCN).
INTERACTIONS = ("dot", "dcn")


@dataclass(frozen=True)
class ModelConfig:
    """DLRM shape. Units: rows, vector dims and layer widths."""

    table_sizes: tuple[int, ...]  # rows per embedding table (26 for Criteo)
    emb_dim: int  # D: every table's vector length; the bottom MLP ends in D too
    bottom_mlp: tuple[int, ...]  # hidden widths after the 13 dense inputs, last == emb_dim
    top_mlp: tuple[int, ...]  # widths after the interaction, last == 1 (the logit)
    n_dense: int = 13
    #: how the bottom MLP's output and the embeddings meet (:data:`INTERACTIONS`)
    interaction: str = "dot"
    dcn_layers: int = 3  # dcn: cross layers (MLPerf's DLRM-DCNv2: 3)
    dcn_rank: int = 512  # dcn: rank of each layer's weights (MLPerf's: 512)

    def __post_init__(self) -> None:
        if not self.table_sizes or min(self.table_sizes) < 2:
            raise ValueError("every table needs at least 2 rows (row 0 means missing)")
        if self.emb_dim < 1:
            raise ValueError(f"emb_dim must be positive, got {self.emb_dim}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.emb_dim:
            raise ValueError(
                f"bottom MLP must end in emb_dim={self.emb_dim} (it meets the embeddings), "
                f"got {self.bottom_mlp}"
            )
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"top MLP must end in 1 (the logit), got {self.top_mlp}")
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction {self.interaction!r} is not one of {INTERACTIONS}")
        if self.dcn_layers < 1 or self.dcn_rank < 1:
            raise ValueError(
                f"DCN needs a layer and rank 1 at least, got {self.dcn_layers}, {self.dcn_rank}"
            )

    @property
    def n_tables(self) -> int:
        return len(self.table_sizes)


@dataclass(frozen=True)
class Preset:
    """A model plus the training defaults that were measured to suit it."""

    model: ModelConfig
    batch_size: int  # global batch, samples per step across all ranks
    lr: float  # MLP learning rate
    emb_lr: float  # embedding learning rate
    emb_optimizer: str  # a row optimizer (model/rowopt.py): sgd, adagrad, rowwise_adagrad
    dense_optimizer: str  # the MLPs' (:data:`DENSE_OPTIMIZERS`)
    notes: str = field(default="", compare=False)
    #: the tables' rate with bags of several ids, where the preset was tuned with them
    #: (None: the trainer scales ``emb_lr``)
    bags_emb_lr: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


#: The MLPs' optimizers: torch's SGD, or its Adagrad (MLPerf's DLRM-DCNv2).
DENSE_OPTIMIZERS = ("sgd", "adagrad")


def dense_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """The MLPs' optimizer of that name (:data:`DENSE_OPTIMIZERS`) over ``params``."""
    if name not in DENSE_OPTIMIZERS:
        raise ValueError(f"dense optimizer {name!r} is not one of {DENSE_OPTIMIZERS}")
    kind = torch.optim.Adagrad if name == "adagrad" else torch.optim.SGD
    return kind(params, lr=lr)


# name: (distinct counts, row cap, oversize, dim, bottom MLP, top MLP, interaction), batch
# (global), lr, emb_lr, emb_optimizer, dense_optimizer, notes[, bags_emb_lr]. bench: Terabyte
# dims on small hashed tables, link-bound rather than memory-bound on CPU.
_PRESETS: dict[str, tuple[Any, ...]] = {
    "tiny": (
        (KAGGLE_COUNTS, 20_000, 4, 16, (64, 32, 16), (64, 32, 1), "dot"),
        32, 0.1, 0.05, "adagrad", "sgd",
        "CI and demo size; defaults measured on the real 10k Criteo sample",
    ),
    "kaggle": (
        (KAGGLE_COUNTS, 10**9, 1, 32, (512, 256, 64, 32), (512, 256, 1), "dot"),
        128, 0.1, 0.1, "sgd", "sgd", "the published compression study's Kaggle configuration",
    ),
    "terabyte": (
        (TERABYTE_COUNTS, 10_000_000, 1, 64, (512, 256, 64), (512, 512, 256, 1), "dot"),
        2048, 0.1, 0.1, "sgd", "sgd", "MLPerf-style Terabyte model, max index range 10M",
    ),
    "bench": (
        (TERABYTE_COUNTS, 50_000, 1, 64, (512, 256, 64), (512, 512, 256, 1), "dot"),
        2048, 0.1, 0.05, "rowwise_adagrad", "sgd",
        "terabyte dims with tables hashed to 50k rows, for the link benchmarks",
    ),
    "dcnv2": (
        (MLPERF_DCNV2_ROWS, None, 1, 128, (512, 256, 128), (1024, 1024, 512, 256, 1), "dcn"),
        65536, 0.005, 0.005, "rowwise_adagrad", "adagrad",
        "MLPerf's DLRM-DCNv2 reference (its shapes, 3 cross layers of rank 512, Adagrad at "
        "0.005 on both parts, batch 65536); its bags: --multi-hot mlperf",
        0.005,  # its rate is the bags' own
    ),
}  # fmt: skip
PRESETS = tuple(_PRESETS)


def get_preset(name: str) -> Preset:
    """The preset of that name (``tiny``, ``kaggle``, ``terabyte``, ``bench``, ``dcnv2``)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    (counts, cap, oversize, dim, bottom, top, inter), *defaults = _PRESETS[name]
    # cap None: the counts are the rows, as they are (dcnv2: MLPerf's, whose ids are a
    # preprocessed day's modulo these, and whose bags' draws take them)
    rows = counts if cap is None else table_sizes_for(counts, cap, oversize)
    model = ModelConfig(rows, dim, bottom, top, interaction=inter)
    return Preset(model, *defaults)
