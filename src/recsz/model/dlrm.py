"""DLRM: Deep Learning Recommendation Model (Naumov et al., arXiv 1906.00091).

    dense (B, 13) ──► bottom MLP ──► x (B, D) ─┐
                                              ├─► interaction ──► top MLP ──► logit (B,)
    ids (B, T) ──► T embedding bags ──► e (B, T, D)

The interaction concatenates x with the strictly-lower triangle of the pairwise dot
products of [x, e_1, ..., e_T], as facebookresearch/dlrm does. The model is split into
:class:`SparseArch` (the tables: model parallel, sharded across ranks) and
:class:`DenseArch` (MLPs and interaction: data parallel), so the distributed step can put
an all-to-all between them without the model knowing about communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from recsz.model.config import ModelConfig


class Awaitable(Protocol):
    """Something that yields the pooled embeddings (B, T, D) when waited on."""

    def wait(self) -> torch.Tensor: ...


def create_mlp(n_in: int, widths: Sequence[int], last_activation: bool) -> nn.Sequential:
    """Linear+ReLU layers; the last layer's ReLU is optional (none before a logit)."""
    layers: list[nn.Module] = []
    for i, w in enumerate(widths):
        layers.append(nn.Linear(n_in, w))
        if i < len(widths) - 1 or last_activation:
            layers.append(nn.ReLU())
        n_in = w
    return nn.Sequential(*layers)


def interact_features(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """Dot-product interaction.

    Args:
        x: bottom MLP output, (B, D).
        emb: pooled embeddings, (B, T, D).
    Returns:
        (B, D + (T + 1) T / 2): x, then z[i, j] = <f_i, f_j> for i > j over f = [x, e].
    """
    b, d = x.shape
    feats = torch.cat([x.view(b, 1, d), emb], dim=1)  # (B, T+1, D)
    z = torch.bmm(feats, feats.transpose(1, 2))  # (B, T+1, T+1)
    n = feats.shape[1]
    li, lj = torch.tril_indices(n, n, offset=-1, device=x.device)
    return torch.cat([x, z[:, li, lj]], dim=1)


def init_table(rows: int, dim: int, seed: int, table: int) -> torch.Tensor:
    """The initial weights of one table, a function of (seed, table) only.

    Seeding per table makes a table's start independent of which rank owns it, so the
    sharded model starts exactly where the single-process one does. Uniform in
    +-sqrt(1/rows) as in facebookresearch/dlrm.
    """
    g = torch.Generator().manual_seed(seed * 1009 + table)
    bound = (1.0 / rows) ** 0.5
    return torch.empty(rows, dim).uniform_(-bound, bound, generator=g)


class SparseArch(nn.Module):
    """Some or all of the embedding tables; pools each sample's id(s) per table by sum."""

    def __init__(self, cfg: ModelConfig, tables: Sequence[int], seed: int) -> None:
        super().__init__()
        self.tables = list(tables)  # global table indices held here, in order
        self.bags = nn.ModuleList()
        for t in self.tables:
            bag = nn.EmbeddingBag(cfg.table_sizes[t], cfg.emb_dim, mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(init_table(cfg.table_sizes[t], cfg.emb_dim, seed, t))
            self.bags.append(bag)
        self.sizes = [cfg.table_sizes[t] for t in self.tables]
        # Row counts as a tensor beside the weights, for one range check of all tables.
        self.register_buffer("_rows", torch.tensor(self.sizes, dtype=torch.int64), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T_all) global ids of every table -> pooled (B, len(self.tables), D)."""
        if self.tables and ids.numel():
            mine = ids[:, self.tables]  # (B, T_r)
            rows = self._rows
            assert isinstance(rows, torch.Tensor)  # a buffer
            wrong = (mine < 0) | (mine >= rows)
            if bool(wrong.any()):  # one check (one host sync on a GPU) for every table
                j = int(wrong.any(0).nonzero()[0])
                bad = int(mine[:, j][wrong[:, j]][0])
                raise IndexError(f"table {self.tables[j]}: id {bad} outside [0, {self.sizes[j]})")
        out = []
        for bag, t in zip(self.bags, self.tables, strict=True):
            out.append(bag(ids[:, t : t + 1]))  # (B, 1) bags of one id each -> (B, D)
        if not out:
            return ids.new_zeros((ids.shape[0], 0, 0), dtype=torch.float32)
        return torch.stack(out, dim=1)


class DenseArch(nn.Module):
    """Bottom MLP, interaction and top MLP; replicated on every rank."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.bottom = create_mlp(cfg.n_dense, cfg.bottom_mlp, last_activation=True)
        n_feat = cfg.n_tables + 1
        n_int = cfg.emb_dim + n_feat * (n_feat - 1) // 2
        self.top = create_mlp(n_int, cfg.top_mlp, last_activation=False)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor | Awaitable) -> torch.Tensor:
        """dense (B, 13), emb (B, T, D) or an object whose ``wait()`` gives it -> logits (B,).

        Taking an awaitable lets the bottom MLP run while the embeddings are still in
        flight (the all-to-all overlap of facebookresearch/dlrm), inside DDP's forward.
        """
        x = self.bottom(dense)  # (B, D)
        if not isinstance(emb, torch.Tensor):
            emb = emb.wait()
        return self.top(interact_features(x, emb)).squeeze(1)


class DLRM(nn.Module):
    """The whole model in one process: all tables plus the dense part."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.sparse = SparseArch(cfg, range(cfg.n_tables), seed)
        self.dense = DenseArch(cfg, seed)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B,); the click probability is their sigmoid."""
        return self.dense(dense, self.sparse(ids))
