"""DLRM: Deep Learning Recommendation Model (Naumov et al., arXiv 1906.00091).

    dense (B, 13) ──► bottom MLP ──► x (B, D) ─┐
                                              ├─► interaction ──► top MLP ──► logit (B,)
    ids (B, T) ──► T embedding bags ──► e (B, T, D)

The interaction (``ModelConfig.interaction``) concatenates x with the strictly-lower
triangle of the pairwise dot products of [x, e_1, ..., e_T], as facebookresearch/dlrm does
(``dot``), or runs DCNv2's low-rank cross layers over [x, e_1, ..., e_T] flattened, as
MLPerf's DLRM-DCNv2 and TorchRec's ``DLRM_DCN`` do (``dcn``, :class:`CrossNet`). The model
is split into :class:`SparseArch` (the tables: model parallel, sharded across ranks) and
:class:`DenseArch` (MLPs and interaction: data parallel), so the distributed step can put
an all-to-all between them without the model knowing about communication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from recsz.model.config import ModelConfig
from recsz.model.rowopt import RowOptimizer
from recsz.model.tables import SparseArch
from recsz.model.ttrec import TTTables


class Awaitable(Protocol):
    """Something that yields the pooled embeddings (B, T, D) when waited on."""

    def wait(self) -> torch.Tensor: ...


#: How the MLPs start: ``dlrm`` as facebookresearch/dlrm, ``torch`` as ``nn.Linear``.
MLP_INITS = ("dlrm", "torch")


def create_mlp(
    n_in: int,
    widths: Sequence[int],
    last_activation: bool,
    g: torch.Generator,
    init: str = "dlrm",
) -> nn.Sequential:
    """Linear+ReLU layers; the last layer's ReLU is optional (none before a logit).

    ``dlrm``: initialized as facebookresearch/dlrm does, weights from N(0, sqrt(2 / (fan_in
    + fan_out))), biases from N(0, sqrt(1 / fan_out)) (PyTorch's default learned measurably
    less on the real sample in plain SGD). ``torch``: PyTorch's default, as TorchRec's DLRM
    (weights and biases uniform in +-sqrt(1/fan_in)), which learned more on multi-hot bags
    (benchmarks/README.md). Both drawn from ``g``: every rank starts the same.
    """
    if init not in MLP_INITS:
        raise ValueError(f"MLP init {init!r} is not one of {MLP_INITS}")
    layers: list[nn.Module] = []
    for i, w in enumerate(widths):
        lin = nn.Linear(n_in, w)
        with torch.no_grad():
            if init == "torch":
                bound = (1.0 / n_in) ** 0.5
                lin.weight.uniform_(-bound, bound, generator=g)
                lin.bias.uniform_(-bound, bound, generator=g)
            else:
                lin.weight.normal_(0.0, (2.0 / (n_in + w)) ** 0.5, generator=g)
                lin.bias.normal_(0.0, (1.0 / w) ** 0.5, generator=g)
        layers.append(lin)
        if i < len(widths) - 1 or last_activation:
            layers.append(nn.ReLU())
        n_in = w
    return nn.Sequential(*layers)


def interact_features(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """Dot-product interaction, in ``x``'s dtype (the bottom MLP's: bfloat16 under its
    autocast).

    Args:
        x: bottom MLP output, (B, D).
        emb: pooled embeddings, (B, T, D).
    Returns:
        (B, D + (T + 1) T / 2): x, then z[i, j] = <f_i, f_j> for i > j over f = [x, e].
    """
    b, d = x.shape
    feats = torch.cat([x.view(b, 1, d), emb.to(x.dtype)], dim=1)  # (B, T+1, D)
    return torch.cat([x, _PairDots.apply(feats)], dim=1)


@functools.cache
def _pairs(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions in an (n, n) matrix of the pairs i > j, row by row; and for each
    position of that matrix, its pair's index (for (i, j) and its mirror (j, i)), or the
    number of pairs on the diagonal."""
    li, lj = torch.tril_indices(n, n, offset=-1, device=device)
    pairs, k = li * n + lj, torch.arange(li.numel(), device=device)
    of = torch.full((n * n,), li.numel(), dtype=torch.int64, device=device)
    return pairs, of.index_copy_(0, pairs, k).index_copy_(0, lj * n + li, k)


class _PairDots(torch.autograd.Function):
    """feats (B, n, D) -> (B, n (n - 1) / 2): <f_i, f_j> for i > j, in feats' dtype.

    Its backward is one batched product, d/dF = (G + G^T) F, with G the pairs' gradients
    placed in an (n, n) matrix per sample; autograd's own (through the product with a
    transposed operand and the triangle's gather) takes two products, their sum and
    transposed copies: 1.4x the time in float32 and 1.7x in bfloat16 on the CPU for the
    bench preset's shape."""

    @staticmethod
    def forward(ctx: Any, feats: torch.Tensor) -> torch.Tensor:
        b, n, _ = feats.shape
        pairs = _pairs(n, feats.device)[0]
        ctx.save_for_backward(feats)
        with torch.autocast(feats.device.type, enabled=False):
            z = torch.bmm(feats, feats.transpose(1, 2))
        return z.view(b, n * n).index_select(1, pairs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (feats,) = ctx.saved_tensors
        b, n, _ = feats.shape
        of = _pairs(n, feats.device)[1]
        # one gather (a zero column for the diagonal) rather than zeros and two scatters
        sym = F.pad(g.to(feats.dtype), (0, 1)).index_select(1, of)
        with torch.autocast(feats.device.type, enabled=False):
            return torch.bmm(sym.view(b, n, n), feats)


class CrossNet(nn.Module):
    """DCNv2's low-rank cross layers (Wang et al., arXiv 2008.13535):
    x_{l+1} = x_0 * (W_l V_l x_l + b_l) + x_l, with W_l (n, rank), V_l (rank, n).

    Started as TorchRec's ``LowRankCrossNet`` (W and V Xavier-normal, b zero), drawn from
    ``g``; its parameters are in TorchRec's order (every W, every V, every b), so that its
    weights load as they are."""

    def __init__(self, n: int, layers: int, rank: int, g: torch.Generator) -> None:
        super().__init__()
        std = (2.0 / (n + rank)) ** 0.5  # Xavier-normal, either shape

        def normal(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape).normal_(0.0, std, generator=g))

        self.W = nn.ParameterList(normal(n, rank) for _ in range(layers))
        self.V = nn.ParameterList(normal(rank, n) for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(n)) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for w, v, b in zip(self.W, self.V, self.b, strict=True):
            x = x0 * torch.addmm(b, F.linear(x, v), w.t()) + x
        return x


def _received(pending: Awaitable) -> torch.Tensor:
    """The embeddings of an exchange in flight (never traced by torch.compile: it is
    communication and the codecs' own kernels; :meth:`DenseArch.compile`)."""
    return pending.wait()


class DenseArch(nn.Module):
    """Bottom MLP, interaction and top MLP; replicated on every rank, with the tables
    replicated beside them (``local``: TT-Rec tables small enough to hold everywhere,
    looked up for this rank's samples; their columns of ``emb`` are replaced).

    ``compute``: the MLPs and the interaction run under ``torch.autocast`` in this dtype
    (bfloat16: float32 weights, gradients and logits; None: float32 throughout).
    ``init``: how the MLPs start (:data:`MLP_INITS`, :func:`create_mlp`)."""

    local_pos: torch.Tensor  # the local tables' columns

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int,
        local: TTTables | None = None,
        compute: torch.dtype | None = None,
        init: str = "dlrm",
    ) -> None:
        super().__init__()
        self.compute = compute
        g = torch.Generator().manual_seed(seed)
        self.bottom = create_mlp(cfg.n_dense, cfg.bottom_mlp, True, g, init)
        n_feat = self.n_features = cfg.n_tables + 1
        self.cross: CrossNet | None = None
        if cfg.interaction == "dcn":
            n_int = n_feat * cfg.emb_dim
            self.cross = CrossNet(n_int, cfg.dcn_layers, cfg.dcn_rank, g)
        else:
            n_int = cfg.emb_dim + n_feat * (n_feat - 1) // 2
        self.top = create_mlp(n_int, cfg.top_mlp, False, g, init)
        self.local = local if local is not None and local.tables else None
        at = torch.tensor(self.local.tables if self.local else [], dtype=torch.int64)
        self.register_buffer("local_pos", at, persistent=False)
        self._received: Callable[[Awaitable], torch.Tensor] = _received

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile in place, the exchange's wait left out of the graph (wrapped only
        here: ``torch.compiler.disable`` imports dynamo, 1.5 s of a start here)."""
        self._received = torch.compiler.disable(_received)
        super().compile(*args, **kwargs)

    def mlp_parameters(self) -> list[nn.Parameter]:
        """The MLPs' parameters and the cross layers' (the local tables have optimizers of
        their own), in TorchRec's DLRM's order."""
        cross = [] if self.cross is None else list(self.cross.parameters())
        return [*self.bottom.parameters(), *cross, *self.top.parameters()]

    @torch.no_grad()
    def load_torchrec_mlps(self, params: Sequence[torch.Tensor]) -> None:
        """Start from the MLPs of TorchRec's ``torchrec.models.dlrm.DLRM`` or ``DLRM_DCN``
        (its dense, interaction and over arch's parameters, in their order): the same model
        as this one, but its dot interaction lists the pairs i < j row by row (the upper
        triangle), so the top MLP's first weights are reordered to ours."""
        mine = self.mlp_parameters()
        if [p.shape for p in params] != [m.shape for m in mine]:
            raise ValueError("TorchRec's MLPs have other shapes than this model's")
        for m, p in zip(mine, params, strict=True):
            m.copy_(p)
        if self.cross is not None:  # DLRM_DCN: the same order throughout
            return
        first_top, ours = self._their_pairs()
        top, theirs = mine[first_top], params[first_top]
        d = top.shape[1] - len(ours)  # the bottom MLP's output
        top[:, d:].index_copy_(1, ours.to(top.device), theirs[:, d:])

    @torch.no_grad()
    def torchrec_mlps(self) -> list[torch.Tensor]:
        """The MLPs' parameters as TorchRec's DLRM (or DLRM_DCN) holds them, in its order
        (the inverse of :meth:`load_torchrec_mlps`; copies)."""
        out = [p.detach().clone() for p in self.mlp_parameters()]
        if self.cross is None:
            first_top, ours = self._their_pairs()
            top = out[first_top]
            d = top.shape[1] - len(ours)
            top[:, d:] = top[:, d:].index_select(1, ours.to(top.device))
        return out

    def _their_pairs(self) -> tuple[int, torch.Tensor]:
        """The top MLP's first parameter's place in :meth:`mlp_parameters`, and for each
        of the dot interaction's pairs in TorchRec's order (i < j, row by row) its column
        among ours."""
        n = self.n_features
        iu, ju = torch.triu_indices(n, n, offset=1)
        ours = _pairs(n, torch.device("cpu"))[1][iu * n + ju]
        return len(list(self.bottom.parameters())), ours

    def forward(
        self,
        dense: torch.Tensor,
        emb: torch.Tensor | Awaitable,
        ids: torch.Tensor | None = None,
        checked: bool = False,
    ) -> torch.Tensor:
        """dense (B, 13), emb (B, T, D) or an object whose ``wait()`` gives it, ids (B, T)
        (needed with local tables; ``checked``: made for the tables' sizes, as
        :meth:`SparseArch.forward`'s) -> logits (B,).

        Taking an awaitable lets the bottom MLP run while the embeddings are still in
        flight (the all-to-all overlap of facebookresearch/dlrm), inside DDP's forward.
        """
        with self._autocast(dense):
            x = self.bottom(dense)  # (B, D)
        e: torch.Tensor = emb if isinstance(emb, torch.Tensor) else self._received(emb)
        e = e.reshape(e.shape[0], self.n_features - 1, -1)  # a table's column shards side by side
        if self.local is not None:
            assert ids is not None, "local tables need the samples' ids"
            e = e.index_copy(1, self.local_pos, self.local(ids, checked))
        with self._autocast(dense):
            if self.cross is None:
                z = interact_features(x, e)
            else:
                z = self.cross(torch.cat([x, e.to(x.dtype).flatten(1)], dim=1))
            logits = self.top(z).squeeze(1)
        return logits.float()

    def _autocast(self, like: torch.Tensor) -> torch.autocast:
        dtype = self.compute or torch.float32
        # No cache of cast weights: each is cast once a step anyway, and a cache would
        # outlive a CUDA graph's capture (PyTorch's notes on graphs and autocast).
        on = self.compute is not None
        return torch.autocast(like.device.type, dtype, enabled=on, cache_enabled=False)


class DLRM(nn.Module):
    """The whole model in one process: all tables plus the dense part. The tables train
    with ``emb_optimizer`` inside the backward (None: frozen); the MLPs' parameters are
    for any torch optimizer."""

    def __init__(
        self, cfg: ModelConfig, seed: int = 0, emb_optimizer: RowOptimizer | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.sparse = SparseArch(cfg, range(cfg.n_tables), seed, emb_optimizer)
        self.dense = DenseArch(cfg, seed)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B,); the click probability is their sigmoid."""
        return self.dense(dense, self.sparse(ids))
