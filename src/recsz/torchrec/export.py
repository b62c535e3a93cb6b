"""A run's model as TorchRec's DLRM: ``recsz export RUN --out model.pt``, then
``recsz.torchrec.load_dlrm("model.pt")`` anywhere TorchRec runs.

The model recsz trains is TorchRec's ``torchrec.models.dlrm.DLRM`` (``DLRM_DCN`` with
``--interaction dcn``): the same MLPs, the same dot interaction (TorchRec lists its pairs
in another order, which the export puts right), one ``EmbeddingBagCollection`` table per
Criteo category, named as TorchRec's own DLRM example names them (table ``t_cat_i``,
feature ``cat_i``). The export joins what the training kept apart: every rank's tables
(the checkpoint is loaded on one process), a table's column shards, a TT table's cores
multiplied out (its cache's rows where it holds them), a FIITED table's pruned chunks as
zeros; half-precision tables come out float32. The result can be scored, sharded by
TorchRec's ``DistributedModelParallel`` and trained on, or packaged for TorchRec's
inference.

Its inputs are recsz's: dense features as log(1 + count) (what ``recsz.data`` makes), each
category's id as recsz hashed it (``recsz.data.criteo``; a preprocessed day's ids modulo
the table's rows), one id a bag; with ``--multi-hot`` each id's bag as
``recsz.model.multihot.Bags`` makes it (the file records the hotness and the draws: with
``mlperf``'s, the bags of MLPerf's reference).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from recsz.model import modelfile
from recsz.model.config import ModelConfig

if TYPE_CHECKING:
    from recsz.step import Parts


def tables_of(parts: Parts, n_tables: int) -> list[torch.Tensor]:
    """Every table of the model, whole and float32, from one process's parts (which
    hold them all): column shards side by side, replicated TT tables from the dense
    part."""
    got = parts.sparse.table_weights()
    local = parts.dense_module.local
    if local is not None:
        got.update(local.weights())
    k = parts.sparse.shards
    missing = [t for t in range(n_tables * k) if t not in got]
    if missing:
        raise ValueError(f"tables {sorted({t // k for t in missing})} are not on this process")
    return [torch.cat([got[t * k + c] for c in range(k)], 1) for t in range(n_tables)]


def exported(
    cfg: ModelConfig,
    tables: list[torch.Tensor],
    mlps: list[torch.Tensor],
    hotness: Sequence[int] | None = None,
    draws: str = "hash",
) -> dict[str, Any]:
    """What ``recsz export`` writes (:mod:`recsz.model.modelfile`): the shape
    :func:`load_dlrm` builds, and its state dict (``mlps``:
    :meth:`recsz.model.DenseArch.torchrec_mlps`); the bags' ``hotness`` and ``draws``."""
    shape = modelfile.shape_of(cfg, hotness, draws)
    names = _mlp_names(_module(shape, torch.device("meta")))
    if len(names) != len(mlps):
        raise ValueError(
            f"{len(mlps)} MLP parameters, TorchRec's {shape['model']} has {len(names)}"
        )
    return {**shape, "state_dict": modelfile.state_of(tables, dict(zip(names, mlps, strict=True)))}


def load_dlrm(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The TorchRec DLRM (or DLRM_DCN) a ``recsz export`` file holds, its weights loaded,
    on ``device``."""
    f = modelfile.read(path)
    model = _module(f.shape, torch.device("meta"))
    names = _mlp_names(model)
    if len(names) != len(f.mlps):
        raise ValueError(f"{path}: {len(f.mlps)} MLP parameters, its {f.shape['model']} has "
                         f"{len(names)}")  # fmt: skip
    state = modelfile.state_of(f.tables, dict(zip(names, f.mlps, strict=True)))
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: its weights do not fit its model: {e}") from e
    return model.to(device)


def save_dlrm(
    model: nn.Module,
    path: str | Path,
    hotness: Sequence[int] | None = None,
    draws: str = "hash",
) -> None:
    """Write TorchRec's ``DLRM`` or ``DLRM_DCN`` (unsharded; or a module holding it as
    ``.model``, as TorchRec's ``DLRMTrain``) as a model file, which ``recsz train
    --init-from`` starts a run from: its tables in their order as tables 0, 1, ... (one
    feature a table, one dim), its MLPs; ``hotness``: the bags it was trained on, if any
    (``draws``: "mlperf" for those of MLPerf's reference, :mod:`recsz.model.multihot`)."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    inner = getattr(model, "model", model) if not isinstance(model, DLRM) else model
    if not isinstance(inner, DLRM):
        raise ValueError(f"not TorchRec's DLRM or DLRM_DCN: {type(model).__name__}")
    ebc = inner.sparse_arch.embedding_bag_collection
    configs = ebc.embedding_bag_configs()
    if any(len(c.feature_names) != 1 for c in configs):
        raise ValueError("a table of several features: recsz's model has one a table")
    if len({c.embedding_dim for c in configs}) != 1:
        raise ValueError("tables of several dims: recsz's model has one")
    bottom = [m for m in inner.dense_arch.modules() if isinstance(m, nn.Linear)]
    top = [m for m in inner.over_arch.modules() if isinstance(m, nn.Linear)]
    dcn = {}
    if isinstance(inner, DLRM_DCN):
        kernels = inner.inter_arch.crossnet.W_kernels
        dcn = {"interaction": "dcn", "dcn_layers": len(kernels), "dcn_rank": kernels[0].shape[1]}
    cfg = ModelConfig(
        tuple(c.num_embeddings for c in configs), configs[0].embedding_dim,
        tuple(m.out_features for m in bottom), tuple(m.out_features for m in top),
        n_dense=bottom[0].in_features, **dcn,
    )  # fmt: skip
    tables = [ebc.embedding_bags[c.name].weight.detach() for c in configs]
    params = dict(inner.named_parameters())
    mlps = [params[n].detach() for n in _mlp_names(inner)]
    torch.save(exported(cfg, tables, mlps, hotness, draws), path)


def _mlp_names(model: nn.Module) -> list[str]:
    """TorchRec's names of its DLRM's MLP (and cross layer) parameters, in its order."""
    return [n for n, _ in model.named_parameters() if not n.startswith(modelfile.EBC)]


_MLPS = ("dense_in_features", "dense_arch_layer_sizes", "over_arch_layer_sizes")


def _module(shape: dict[str, Any], device: torch.device) -> nn.Module:
    """TorchRec's model of ``shape``, its tensors on ``device``."""
    import torchrec
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t_cat_{t}", embedding_dim=shape["emb_dim"], num_embeddings=n,
            feature_names=[f"cat_{t}"],
        )
        for t, n in enumerate(shape["table_sizes"])
    ]  # fmt: skip
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=device)
    mlps = [shape[k] for k in _MLPS]
    if shape["model"] == "DLRM_DCN":
        dcn = (shape["dcn_num_layers"], shape["dcn_low_rank_dim"])
        return DLRM_DCN(ebc, *mlps, *dcn, dense_device=device)
    return DLRM(ebc, *mlps, dense_device=device)


def build_parser() -> argparse.ArgumentParser:
    from recsz.evaluation import RUN_HELP

    p = argparse.ArgumentParser(
        prog="recsz export",
        description="Write a run's model (its newest complete checkpoint, or the one named) "
        "as TorchRec's DLRM: load it with recsz.torchrec.load_dlrm(FILE).",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--out", required=True, help="the file to write (torch.save)")
    return p


def main(argv: list[str]) -> int:
    """``recsz export``: the checkpoint loaded on this one process (its tables joined from
    every rank's files), written as :func:`exported`."""
    from recsz.evaluation import restored, writable

    args = build_parser().parse_args(argv)
    writable(args, ("out",))
    out = Path(args.out)
    args.device = "cpu"
    with restored(args, ("device",)) as r:
        model = r.cfg.model()
        tables = tables_of(r.parts, model.n_tables)
        mlps = r.parts.dense_module.torchrec_mlps()
        blob = exported(model, tables, mlps, r.cfg.hotness(), r.cfg.multi_hot_draws)
        part = out.with_name(out.name + ".part")  # a file cut short is never taken for it
        torch.save(blob, part)
        part.replace(out)
        print(
            f"recsz: {r.ckpt} (step {r.step}) written to {out} as TorchRec's {blob['model']} "
            f"({len(tables)} tables, {out.stat().st_size / 1e6:.1f} MB)",
            flush=True,
        )
    return 0
