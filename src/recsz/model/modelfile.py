"""A model as one file: what ``recsz export`` writes and ``recsz train --init-from`` reads.

The file (``torch.save``) holds the model's shape and a state dict laid out as TorchRec's
``DLRM`` / ``DLRM_DCN`` lays out its own (tables ``t_cat_i`` of an
``EmbeddingBagCollection``, then the MLPs' parameters in TorchRec's order), so that
:func:`recsz.torchrec.load_dlrm` builds TorchRec's model from it; this module reads and
writes it with torch alone. A run started from it (``--init-from``) takes each table's
rows (its column shards' columns, rounded to the tables' dtype) and the MLPs; optimizer
state starts afresh, as a day's model warm-started from yesterday's does.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recsz.model.config import ModelConfig

#: what the file holds: this string, the model's shape and its state dict
FORMAT = "recsz-torchrec-dlrm/1"
EBC = "sparse_arch.embedding_bag_collection.embedding_bags"
#: the shape's keys, beside "format", "model", "hotness", "bag_draws" and "state_dict"
SHAPE = ("table_sizes", "emb_dim", "dense_in_features", "dense_arch_layer_sizes",
         "over_arch_layer_sizes", "dcn_num_layers", "dcn_low_rank_dim")  # fmt: skip


def table_key(t: int) -> str:
    """Table ``t``'s weight in the state dict (TorchRec's DLRM example's name)."""
    return f"{EBC}.t_cat_{t}.weight"


def shape_of(
    cfg: ModelConfig, hotness: Sequence[int] | None = None, draws: str = "hash"
) -> dict[str, Any]:
    """The file's description of ``cfg``'s model (TorchRec's constructor arguments), and
    the bags it was trained on (``hotness`` ids, their other ids ``draws``:
    :mod:`recsz.model.multihot`), which its inputs are made into."""
    return {
        "format": FORMAT,
        "model": "DLRM_DCN" if cfg.interaction == "dcn" else "DLRM",
        "table_sizes": list(cfg.table_sizes),
        "emb_dim": cfg.emb_dim,
        "dense_in_features": cfg.n_dense,
        "dense_arch_layer_sizes": list(cfg.bottom_mlp),
        "over_arch_layer_sizes": list(cfg.top_mlp),
        "dcn_num_layers": cfg.dcn_layers,
        "dcn_low_rank_dim": cfg.dcn_rank,
        "hotness": None if hotness is None else list(hotness),
        "bag_draws": None if hotness is None else draws,
    }


def state_of(tables: Sequence[torch.Tensor], mlps: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict: the tables by :func:`table_key`, then ``mlps`` (TorchRec's names,
    in its order), on the CPU."""
    state = {table_key(t): w.detach().cpu() for t, w in enumerate(tables)}
    return {**state, **{k: p.detach().cpu() for k, p in mlps.items()}}


@dataclass
class ModelFile:
    """A file's model: its shape, whole tables (memory-mapped) and MLP parameters in
    TorchRec's order (:meth:`recsz.model.DenseArch.load_torchrec_mlps` takes them)."""

    path: Path
    shape: dict[str, Any]
    tables: list[torch.Tensor]
    mlps: list[torch.Tensor]

    def check(self, cfg: ModelConfig) -> None:
        """A ValueError naming the file and what differs where ``cfg`` is another model."""
        want = shape_of(cfg)
        if want["model"] != self.shape["model"]:
            raise ValueError(f"{self.path}: a {self.shape['model']} model, this run's is a "
                             f"{want['model']} (--interaction)")  # fmt: skip
        keys = SHAPE if want["model"] == "DLRM_DCN" else SHAPE[:-2]
        for k in keys:
            if self.shape[k] != want[k]:
                raise ValueError(f"{self.path}: its {k} are {self.shape[k]}, this run's model "
                                 f"has {want[k]}")  # fmt: skip


def read(path: str | Path) -> ModelFile:
    """A model file, checked to be one (its tables' and MLPs' shapes included)."""
    path = Path(path)
    if path.is_dir():  # a run (its checkpoints are not a model file)
        export = f"`recsz export {path} --out FILE`, then --init-from FILE"
        raise FileNotFoundError(f"{path}: a directory, not a model file (a run's model: {export})")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # cut short, not torch's
        raise ValueError(f"{path}: not a model file torch can read ({e})") from e
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"{path}: not a recsz model file ({FORMAT}), found {got!r}")
    state: dict[str, torch.Tensor] = blob["state_dict"]
    sizes, dim = blob["table_sizes"], blob["emb_dim"]
    tables = []
    for t, n in enumerate(sizes):
        w = state.get(table_key(t))
        if w is None or tuple(w.shape) != (n, dim):
            got = "none" if w is None else tuple(w.shape)
            raise ValueError(f"{path}: table {t} is {got}, its shape says ({n}, {dim})")
        tables.append(w)
    mlps = [v for k, v in state.items() if not k.startswith(EBC)]
    return ModelFile(path, {k: v for k, v in blob.items() if k != "state_dict"}, tables, mlps)
