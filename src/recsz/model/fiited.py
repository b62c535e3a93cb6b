"""FIITED: per-vector embedding dimensions pruned during training (Luo et al. 2024,
arXiv 2401.04408), over a chunked table store.

A rank's tables (N rows in all, D dims) are held as chunks of c dims: a pointer table
``ptr`` (N, D / c) maps each (row, chunk) to a slot of one chunk pool, or to -1 when the
chunk is pruned; a lookup reads the allocated chunks and zeros for the others, and the
backward updates allocated chunks only (the row optimizer runs on pool slots, so
``rowwise_adagrad`` keeps one accumulator per chunk).

Importance (our choice where the paper's details are not at hand): one running score per
row, the sum over steps of the norm of the row's gradient (so frequency and gradient
magnitude both count), decayed by ``decay`` at each pruning. Chunks are ranked rows that
were looked up first, then by position (a row's j-th chunk before any (j+1)-th), then by
score: a row loses its last chunks first and its vector keeps a prefix of its dimensions,
every looked-up row keeps its leading chunk before a busy row keeps a second one, and the
rows never looked up go first. (A first version ranked score x (k - j) / k: at half the
chunks it lost 0.008 AUC where the uniform baseline lost 0.001, since busy rows' last
chunks took the leading chunks of rows about to be looked up.) Every ``interval`` steps
each table keeps its ``budget`` x (rows x chunks) most important chunks (per table, so
any sharding of the tables prunes the same chunks); freed slots go to a free list from
which chunks that became important again (revived rows, starting from zeros) take
theirs; then the pool is compacted to exactly its allocated chunks. Memory held: pool +
pointers (int32) + scores; the optimizer's state is not counted (as for dense tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recsz.model.rowopt import RowOptimizer

#: What decides which chunks stay: FIITED's importance (gradient norms, last chunks
#: first), or the two baselines on the same store and memory: the same leading chunks of
#: every row from the start (a uniformly smaller dimension), or whole rows by how often
#: they were looked up (frequency-threshold pruning).
RULES = ("fiited", "uniform", "frequency")


@dataclass(frozen=True)
class FiitedSpec:
    """How the store prunes: kept fraction of each table's chunks, chunk width, steps
    between prunings, the decay of the importance scores at each, and the rule."""

    budget: float
    chunk: int = 8
    interval: int = 100
    decay: float = 0.5
    rule: str = "fiited"

    def __post_init__(self) -> None:
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"FIITED budget must be in (0, 1], got {self.budget}")
        if self.rule not in RULES:
            raise ValueError(f"FIITED rule {self.rule!r} is not one of: {', '.join(RULES)}")
        if self.chunk < 1 or self.interval < 1 or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"bad FIITED chunk/interval/decay: {self}")


class FiitedStore(nn.Module):
    """Rows of several tables as a pointer table over one pool of chunks.

    Args:
        weight: (N, D) initial rows, tables one after another.
        sizes: rows per table (sum N).
        spec: pruning settings; D must be a multiple of ``spec.chunk``.
        optimizer: the row optimizer run on pool slots (None: frozen).
    """

    pool: nn.Parameter
    ptr: torch.Tensor
    score: torch.Tensor
    free: torch.Tensor
    state: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        sizes: Sequence[int],
        spec: FiitedSpec,
        optimizer: RowOptimizer | None,
    ) -> None:
        super().__init__()
        n, d = weight.shape
        if d % spec.chunk:
            raise ValueError(f"FIITED chunk {spec.chunk} does not divide the dim {d}")
        if sum(sizes) != n:
            raise ValueError(f"table sizes add up to {sum(sizes)}, weight has {n} rows")
        self.spec, self.optimizer, self.sizes = spec, optimizer, list(sizes)
        #: the optimizer keeps state per slot (Adagrad kinds), moved with the chunks
        self.slot_state = optimizer is not None and optimizer.kind != "sgd"
        self.k, self.c, self.dim = d // spec.chunk, spec.chunk, d
        chunks = weight.reshape(n * self.k, self.c).clone()
        self.pool = nn.Parameter(chunks, requires_grad=optimizer is not None)
        self.register_buffer("ptr", torch.arange(n * self.k, dtype=torch.int32).view(n, self.k))
        self.register_buffer("score", torch.zeros(n))
        self.register_buffer("free", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("state", optimizer.new_state(chunks) if optimizer else torch.zeros(0))
        if spec.rule == "uniform":  # a smaller dimension from the start
            self.prune()

    @property
    def bytes_held(self) -> int:
        """Pool, pointers, scores and free list, in bytes."""
        return sum(
            t.numel() * t.element_size() for t in (self.pool, self.ptr, self.score, self.free)
        )

    def allocated(self) -> torch.Tensor:
        """(N, k) True where a chunk has a slot."""
        return self.ptr >= 0

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) row indices -> (n, D) rows, pruned chunks zero."""
        p = self.ptr[rows]
        if not self.pool.shape[0]:  # everything pruned
            return self.pool.new_zeros(rows.numel(), self.dim)
        got = self.pool.detach().index_select(0, p.clamp(min=0).view(-1).long())
        return (got.view(-1, self.k, self.c) * (p >= 0).unsqueeze(-1)).view(-1, self.dim)

    @torch.no_grad()
    def update(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Score the rows by the norm of their step's gradient (summed over the lookups,
        so a sharded batch scores as a whole one); step the allocated chunks."""
        uniq, inv = torch.unique(rows, return_inverse=True)
        if self.spec.rule == "frequency":  # how often the row was looked up
            self.score.index_add_(0, uniq, torch.bincount(inv).to(self.score.dtype))
        else:
            total = grad.new_zeros(uniq.numel(), grad.shape[1]).index_add_(0, inv, grad)
            self.score.index_add_(0, uniq, total.norm(dim=1))
        if self.optimizer is None:
            return
        p = self.ptr[rows]
        kept = p >= 0
        slots = p[kept].long()
        self.optimizer.step(self.pool.data, self.state, slots, grad.view(-1, self.k, self.c)[kept])

    @torch.no_grad()
    def prune(self) -> dict[str, Any]:
        """Keep each table's most important chunks; returns what changed."""
        imp = self._importance().reshape(-1)
        keep = torch.zeros_like(imp, dtype=torch.bool)
        start = 0
        for n in self.sizes:
            span = slice(start * self.k, (start + n) * self.k)
            order = torch.sort(imp[span], descending=True, stable=True).indices
            keep[span][order[: round(self.spec.budget * n * self.k)]] = True
            start += n
        keep = keep.view(-1, self.k)
        alloc = self.allocated()
        freed, new = alloc & ~keep, keep & ~alloc
        free = torch.cat([self.free, self.ptr[freed].long().sort().values])
        self.ptr[freed] = -1
        n_new = int(new.sum())
        slots = free[:n_new]
        if n_new > slots.numel():  # more revived than freed: the pool grows
            grow = n_new - slots.numel()
            top = self.pool.shape[0]
            slots = torch.cat([slots, torch.arange(top, top + grow, device=slots.device)])
            self._resize(top + grow)
        self.free = free[n_new:]
        self.ptr[new] = slots.to(torch.int32)
        self.pool.data[slots] = 0.0  # a revived chunk starts at zero: lookups read no jump
        if self.slot_state:
            self.state[slots] = 0.0
        self.score.mul_(self.spec.decay)
        self._compact()
        return {"freed": int(freed.sum()), "revived": n_new, "slots": self.pool.shape[0]}

    def _importance(self) -> torch.Tensor:
        """(N, k) sortable importance of each chunk under the store's rule."""
        pos = torch.arange(self.k, 0, -1, dtype=torch.float64, device=self.score.device)
        s = self.score.double().unsqueeze(1)
        squash = s / (1.0 + s)  # in [0, 1): a tiebreak below one step of position
        if self.spec.rule == "uniform":  # every row alike: the leading chunks
            return pos.expand(len(s), -1)
        if self.spec.rule == "frequency":  # whole rows (a row's chunks tie: kept in order)
            return squash.expand(-1, self.k)
        # FIITED: rows that were looked up (score > 0) before the others; among them a
        # chunk before any chunk further right in another row, the busier row first.
        return (s > 0) * (self.k + 2.0) + pos + squash

    def kept_fraction(self) -> list[float]:
        """Per table, the fraction of its chunks that have slots."""
        out, start = [], 0
        alloc = self.allocated()
        for n in self.sizes:
            out.append(float(alloc[start : start + n].float().mean()) if n else 0.0)
            start += n
        return out

    def _compact(self) -> None:
        """Move the chunks above the allocated count into the free slots below it."""
        n_alloc = int(self.allocated().sum())
        holes = self.free[self.free < n_alloc]
        owner = torch.full((self.pool.shape[0],), -1, dtype=torch.int64, device=self.ptr.device)
        flat = self.ptr.view(-1)
        where = torch.nonzero(flat >= 0).view(-1)
        owner[flat[where].long()] = where
        movers = torch.nonzero(owner[n_alloc:] >= 0).view(-1) + n_alloc
        self.pool.data[holes] = self.pool.data[movers]
        if self.slot_state:
            self.state[holes] = self.state[movers]
        flat[owner[movers]] = holes.to(torch.int32)
        self._resize(n_alloc)
        self.free = self.free[:0]

    def _resize(self, slots: int) -> None:
        old = self.pool.shape[0]
        pool = self.pool.data
        if slots < old:
            pool = pool[:slots].clone()
        elif slots > old:
            pool = torch.cat([pool, pool.new_zeros(slots - old, self.c)])
        self.pool = nn.Parameter(pool, requires_grad=self.pool.requires_grad)
        if self.slot_state:
            st = self.state
            pad = st.new_zeros(slots - old, *st.shape[1:]) if slots > old else None
            self.state = st[:slots].clone() if pad is None else torch.cat([st, pad])

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # The pool, its state and the free list change size as the store prunes: take the
        # saved sizes before loading the values.
        for name in ("pool", "state", "free"):
            saved = state_dict.get(prefix + name)
            mine = getattr(self, name)
            if saved is not None and saved.shape != mine.shape:
                fresh = mine.new_empty(saved.shape)
                if name == "pool":
                    self.pool = nn.Parameter(fresh, requires_grad=self.pool.requires_grad)
                else:
                    setattr(self, name, fresh)
        super()._load_from_state_dict(state_dict, prefix, *args)


class FiitedLookup(torch.autograd.Function):
    """The store's rows forward; backward hands their gradient to the store (which scores
    and updates the allocated chunks) and returns no gradient for the pool."""

    @staticmethod
    def forward(
        ctx: Any, pool: torch.Tensor, rows: torch.Tensor, store: FiitedStore
    ) -> torch.Tensor:
        ctx.rows, ctx.store = rows, store
        return store.lookup(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.store.update(ctx.rows, grad.contiguous())
        return None, None, None
