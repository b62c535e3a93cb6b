"""The DLRM model, split into a sharded sparse part and a replicated dense part."""

from recsz.model.config import (
    DENSE_OPTIMIZERS,
    INTERACTIONS,
    PRESETS,
    ModelConfig,
    Preset,
    dense_optimizer,
    get_preset,
)
from recsz.model.dlrm import DLRM, MLP_INITS, DenseArch, interact_features
from recsz.model.fiited import FiitedSpec, FiitedStore
from recsz.model.rowopt import ROW_OPTIMIZERS, RowOptimizer
from recsz.model.tables import SparseArch
from recsz.model.ttrec import TT_INITS, TTEmbeddingBag, TTSpec, tt_parameters

__all__ = [
    "DENSE_OPTIMIZERS",
    "DLRM",
    "INTERACTIONS",
    "MLP_INITS",
    "PRESETS",
    "ROW_OPTIMIZERS",
    "TT_INITS",
    "DenseArch",
    "FiitedSpec",
    "FiitedStore",
    "ModelConfig",
    "Preset",
    "RowOptimizer",
    "SparseArch",
    "TTEmbeddingBag",
    "TTSpec",
    "dense_optimizer",
    "get_preset",
    "interact_features",
    "tt_parameters",
]
