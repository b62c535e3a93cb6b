"""TT-Rec: an embedding table as a tensor train (Yin et al., MLSys 2021, arXiv 2101.11714).

A table of N rows x D dims is held as d cores; core k has shape (R[k-1], p[k], q[k], R[k])
with R[0] = R[d] = 1, prod(p) >= N (the rows past N are never looked up) and prod(q) = D.
Row i, written in the mixed radix p (most significant digit first) as (i_1, ..., i_d), is
the chain product G_1[:, i_1] G_2[:, i_2] ... G_d[:, i_d]: a (1 x q_1 ... q_d x 1) tensor,
i.e. D values. Memory: sum_k R[k-1] p_k q_k R[k] instead of N x D.

Forward, in pure PyTorch: the batch's distinct ids only (on a GPU's path every id, its
row made again where it repeats: finding the distinct ones would read their count on the
host, a sync); per core one gather of the slices of their digits; the chain as batched
matrix products; the rows pooled into bags by ``embedding_bag`` over those rows (offsets
and per-sample weights as torch's). Ids come checked against the table's rows, where the
caller has not (one host read).
Backward by autograd through the same operations (the cores are ordinary parameters, so
any torch optimizer trains them).

Initialization ("sampled", TT-Rec's proposal): Gaussian cores scaled so that the rebuilt
rows have the variance of DLRM's uniform(-1/sqrt(N), 1/sqrt(N)) init; "normal" uses
N(0, 1/sqrt(N)) per core element and "uniform" uniform cores of the same per-element
spread, both unscaled for the chain (for comparison).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recsz.devicepath import device_path
from recsz.model.config import ModelConfig
from recsz.model.multihot import Bags, mlperf_draws
from recsz.model.rowopt import RowOptimizer
from recsz.model.ttcache import HotRows

TT_INITS = ("sampled", "normal", "uniform")


def factorize(n: int, parts: int) -> list[int]:
    """``parts`` integers, as equal as possible, whose product is at least n (row digits)."""
    if n < 1 or parts < 1:
        raise ValueError(f"cannot split {n} rows into {parts} factors")
    out: list[int] = []
    left = n
    for k in range(parts, 0, -1):
        f = max(1, math.ceil(left ** (1.0 / k) - 1e-9))
        out.append(f)
        left = math.ceil(left / f)
    return out


def split_dim(d: int, parts: int) -> list[int]:
    """``parts`` integers whose product is exactly d, as equal as possible (column digits)."""
    if d < 1 or parts < 1:
        raise ValueError(f"cannot split dim {d} into {parts} factors")
    primes, x, f = [], d, 2
    while f * f <= x:
        while x % f == 0:
            primes.append(f)
            x //= f
        f += 1
    if x > 1:
        primes.append(x)
    out = [1] * parts
    for pr in sorted(primes, reverse=True):  # largest prime to the smallest part
        out[out.index(min(out))] *= pr
    return sorted(out)


class TTEmbeddingBag(nn.Module):
    """A tensor-train table with ``nn.EmbeddingBag``'s lookup (mode "sum").

    Args:
        num_embeddings, embedding_dim: N and D.
        rank: the inner TT ranks R[1..d-1].
        cores: d (2 to 4).
        init: one of ``TT_INITS``.
        generator: for the initialization.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rank: int = 8,
        cores: int = 3,
        init: str = "sampled",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 2 <= cores <= 4:
            raise ValueError(f"a TT table has 2 to 4 cores, got {cores}")
        if rank < 1:
            raise ValueError(f"TT rank must be >= 1, got {rank}")
        if init not in TT_INITS:
            raise ValueError(f"TT init {init!r} is not one of {TT_INITS}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.p = factorize(num_embeddings, cores)
        self.q = split_dim(embedding_dim, cores)
        self.ranks = [1] + [rank] * (cores - 1) + [1]
        self.cores = nn.ParameterList(
            nn.Parameter(torch.empty(self.ranks[k], self.p[k], self.q[k], self.ranks[k + 1]))
            for k in range(cores)
        )
        # Mixed-radix place values of the row digits (most significant first).
        place = [math.prod(self.p[k + 1 :]) for k in range(cores)]
        self.place: torch.Tensor
        self.radix: torch.Tensor
        self.register_buffer("place", torch.tensor(place, dtype=torch.int64), persistent=False)
        self.register_buffer("radix", torch.tensor(self.p, dtype=torch.int64), persistent=False)
        self.reset_parameters(init, generator)
        #: TT-Rec's cache of hot rows (:mod:`recsz.model.ttcache`), when one is attached
        self.cache: HotRows | None = None

    def reset_parameters(
        self, init: str = "sampled", generator: torch.Generator | None = None
    ) -> None:
        bound = 1.0 / math.sqrt(self.num_embeddings)
        with torch.no_grad():
            for c in self.cores:
                if init == "uniform":
                    c.uniform_(-bound, bound, generator=generator)
                elif init == "normal":
                    c.normal_(0.0, bound, generator=generator)
                else:  # each row element: a sum over prod(R) chains of d Gaussian products
                    target = bound**2 / 3.0  # variance of uniform(-bound, bound)
                    paths = math.prod(self.ranks[1:-1])
                    std = (target / paths) ** (1.0 / (2 * len(self.cores)))
                    c.normal_(0.0, std, generator=generator)

    @property
    def bytes_held(self) -> int:
        """The cores' bytes, and the cache's."""
        cache = self.cache.bytes_held if self.cache is not None else 0
        return sum(c.numel() * c.element_size() for c in self.cores) + cache

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The (len(ids), D) rows of ``ids`` (int64, each in [0, N))."""
        digits = (ids.unsqueeze(1) // self.place) % self.radix
        v = self.cores[0][0].index_select(0, digits[:, 0])  # (U, q1, R1)
        for k in range(1, len(self.cores)):
            g = self.cores[k].index_select(1, digits[:, k]).permute(1, 0, 2, 3)  # (U, R, qk, R')
            u, r, qk, r2 = g.shape
            q_sofar = v.shape[1]
            v = torch.bmm(v, g.reshape(u, r, qk * r2)).reshape(u, q_sofar * qk, r2)
        return v.reshape(len(ids), self.embedding_dim)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
        checked: bool = False,
    ) -> torch.Tensor:
        """Pooled (sum) rows: ``ids`` 2-D (bags of equal size) or 1-D with ``offsets``;
        each id checked against the table's rows (on a GPU a host sync) unless the caller
        has (``checked``)."""
        inside = (
            checked or not ids.numel() or bool(((ids >= 0) & (ids < self.num_embeddings)).all())
        )
        if not inside:
            raise ValueError(f"TT table of {self.num_embeddings} rows: id out of range")
        if device_path(ids.device):  # no host sync: every id's row (a lookup each)
            flat, inverse = ids.reshape(-1), _positions(ids)
            if self.cache is None:
                rows = self.rows(flat)
            else:  # (each id a count of one: the cache's tallies and fills alike)
                flat = flat.contiguous()  # (searched in the cache's ids)
                rows = self.cache.rows(flat, torch.ones_like(flat), self.rows)
        elif self.cache is None:  # each distinct id's row once (its count read on the host)
            uniq, inverse = torch.unique(ids, return_inverse=True)
            rows = self.rows(uniq)
        else:
            uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            rows = self.cache.rows(uniq, counts, self.rows)
        return nn.functional.embedding_bag(
            inverse, rows, offsets, mode="sum", per_sample_weights=per_sample_weights
        )

    def full_weight(self) -> torch.Tensor:
        """The dense (N, D) table of the cores (for tests)."""
        return self.rows(torch.arange(self.num_embeddings, device=self.place.device))

    @torch.no_grad()
    def served_weight(self) -> torch.Tensor:
        """The dense (N, D) table as lookups see it: the cache's rows where it holds them,
        the cores' elsewhere (export)."""
        ids = torch.arange(self.num_embeddings, device=self.place.device)
        if self.cache is None:
            return self.rows(ids)
        return self.cache.rows(ids, torch.ones_like(ids), self.rows)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Each id's own position (``ids``' shape): the lookup of rows made for every id."""
    return torch.arange(ids.numel(), device=ids.device).view(ids.shape)


def tt_parameters(n: int, d: int, rank: int, cores: int) -> int:
    """The number of core values of an N x D table as ``cores`` cores of ``rank``."""
    p, q = factorize(n, cores), split_dim(d, cores)
    r = [1] + [rank] * (cores - 1) + [1]
    return sum(r[k] * p[k] * q[k] * r[k + 1] for k in range(cores))


@dataclass(frozen=True)
class TTSpec:
    """Which tables are tensor trains, and their shape and initialization."""

    tables: frozenset[int]
    rank: int = 8
    cores: int = 3
    init: str = "sampled"
    lr: float | None = None  # the cores' learning rate (None: the row optimizer's)
    cache_rows: int = 0  # hot rows kept dense per table (0: no cache)
    cache_interval: int = 100  # training lookups between cache fills
    #: "sharded": each TT table on one rank, in the all-to-all; "replicated": on every
    #: rank, looked up for its own samples, cores averaged with the MLPs' gradients
    placement: str = "sharded"

    @property
    def replicated(self) -> frozenset[int]:
        """The TT tables every rank holds (none when sharded)."""
        return self.tables if self.placement == "replicated" else frozenset()


class TTTables(nn.Module):
    """A rank's TT tables. Each core has its own optimizer (SGD, or Adagrad for both
    Adagrad kinds: a core has no rows), whose state travels in ``state_dict``. Sharded,
    like the dense tables, they update themselves in the backward (a core's optimizer
    steps as soon as its gradient is complete); ``in_backward=False`` (replicated tables,
    whose gradients DDP averages first) leaves that to :meth:`step`. ``hotness`` (every
    table's of the model; None: one id) and ``bag_draws``: the bags MLPerf's multi-hot
    Criteo makes of each one-hot id (:class:`recsz.model.multihot.Bags`, as the dense
    tables'), each table's looked up as bags of equal size."""

    def __init__(
        self,
        cfg: ModelConfig,
        tables: list[int],
        seed: int,
        optimizer: RowOptimizer | None,
        spec: TTSpec | None,
        in_backward: bool = True,
        hotness: Sequence[int] | None = None,
        bag_draws: str = "hash",
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.bags = nn.ModuleList()
        self._opts: list[torch.optim.Optimizer] = []
        #: each table's ids per bag, and the bags of their one-hot ids (None: one id each)
        self.hotness = [1 if hotness is None else hotness[t] for t in self.tables]
        self.multi_hot: Bags | None = None
        if max(self.hotness, default=1) > 1:
            assert hotness is not None
            sizes = [cfg.table_sizes[t] for t in self.tables]
            mlperf = bag_draws == "mlperf"
            draws = mlperf_draws(cfg.table_sizes, hotness, self.tables) if mlperf else None
            self.multi_hot = Bags(self.tables, hotness, sizes, [0] * len(sizes), draws)
        self.cols: torch.Tensor  # the tables' columns of the model's ids
        self.register_buffer("cols", torch.tensor(self.tables, dtype=torch.int64), persistent=False)
        if not self.tables:
            return
        assert spec is not None
        for t in self.tables:
            g = torch.Generator().manual_seed(seed * 1009 + t)
            bag = TTEmbeddingBag(cfg.table_sizes[t], cfg.emb_dim, spec.rank, spec.cores,
                                 spec.init, generator=g)  # fmt: skip
            if spec.cache_rows:
                rows = min(spec.cache_rows, cfg.table_sizes[t])
                bag.cache = HotRows(rows, cfg.emb_dim, spec.cache_interval, optimizer)
            self.bags.append(bag)
        for p in (c for bag in self.each for c in bag.cores):
            if optimizer is None:
                p.requires_grad_(False)
                continue
            opt: torch.optim.Optimizer
            lr = spec.lr or optimizer.lr
            if optimizer.kind == "sgd":
                opt = torch.optim.SGD([p], lr=lr)
            else:
                opt = torch.optim.Adagrad([p], lr=lr, eps=optimizer.eps or 1e-10)
            if in_backward:
                p.register_post_accumulate_grad_hook(_stepper(opt))
            self._opts.append(opt)

    def _apply(self, fn: Any, recurse: bool = True) -> TTTables:
        """Moves and casts (``.to(device)``) take the optimizers' per-core state along
        (Adagrad makes its sums when it is made, on the cores' device then)."""
        super()._apply(fn, recurse)
        for opt in self._opts:
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p, {})
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and v.shape == p.shape:
                            st[k] = fn(v)
        return self

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Each core's optimizer (a schedule sets their rates)."""
        return list(self._opts)

    def step(self) -> None:
        """Step every core's optimizer on its gradient (tables not stepped in backward)."""
        for opt in self._opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    @property
    def each(self) -> list[TTEmbeddingBag]:
        return [bag for bag in self.bags if isinstance(bag, TTEmbeddingBag)]

    @property
    def bytes_held(self) -> int:
        return sum(bag.bytes_held for bag in self.each)

    def weights(self) -> dict[int, torch.Tensor]:
        """Each table's dense (N, D) rows, by its index in the model."""
        return {t: bag.served_weight() for t, bag in zip(self.tables, self.each, strict=True)}

    @property
    def dense_bytes(self) -> int:
        """What dense float32 tables of the same shapes would hold."""
        return sum(4 * bag.num_embeddings * bag.embedding_dim for bag in self.each)

    def cache_hits(self) -> tuple[int, int]:
        """Lookups served by the caches, and all training lookups of these tables."""
        caches = [bag.cache for bag in self.each if bag.cache is not None]
        return sum(c.hits for c in caches), sum(c.lookups for c in caches)

    def forward(self, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """ids (B, T_all) -> pooled (B, |tables|, D) of these tables: each one-hot id's
        row, or with bags its bag's rows summed. The ids are checked against their tables'
        rows (on a GPU one host sync for all) unless the caller has (``checked``: ids
        from a source made for these tables' sizes; a bag's other ids are drawn within
        its table)."""
        mine = ids.index_select(1, self.cols)
        if not checked and mine.numel():
            self._check_range(mine)
        if self.multi_hot is None:
            bags = list(mine.split(1, dim=1))
        else:
            every = self.multi_hot.ids(mine)  # (B, sum of hotness): bag after bag
            bags = list(every.split(self.hotness, dim=1))
        return torch.stack([m(b, checked=True) for b, m in zip(bags, self.bags, strict=True)], 1)

    def _check_range(self, mine: torch.Tensor) -> None:
        rows = mine.new_tensor([bag.num_embeddings for bag in self.each])
        wrong = (mine < 0) | (mine >= rows)
        if bool(wrong.any()):
            i, j = (int(x) for x in wrong.nonzero()[0])
            t, n = self.tables[j], int(rows[j])  # (as SparseArch says of its dense tables)
            raise IndexError(f"table {t} (TT): id {int(mine[i, j])} outside [0, {n})")

    def get_extra_state(self) -> Any:
        return [o.state_dict() for o in self._opts]

    def set_extra_state(self, state: Any) -> None:
        for o, s in zip(self._opts, state, strict=True):
            o.load_state_dict(s)


def _stepper(opt: torch.optim.Optimizer) -> Any:
    def step(_: torch.Tensor) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
