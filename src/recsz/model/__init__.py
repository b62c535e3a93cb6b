"""The DLRM model, split into a sharded sparse part and a replicated dense part."""

from recsz.model.config import PRESETS, ModelConfig, Preset, get_preset
from recsz.model.dlrm import DLRM, DenseArch, SparseArch, interact_features

__all__ = [
    "DLRM",
    "PRESETS",
    "DenseArch",
    "ModelConfig",
    "Preset",
    "SparseArch",
    "get_preset",
    "interact_features",
]
