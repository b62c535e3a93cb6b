"""FIITED: per-vector embedding dimensions pruned during training (Luo et al. 2024,
arXiv 2401.04408), over a chunked table store.

A rank's tables (N rows in all, D dims) are held as chunks of c dims in one pool: the
pointer table ``ptr`` (N, k = D / c) maps each (row, chunk) to a pool slot, or to -1 when
the chunk is pruned; a lookup reads the allocated chunks and zeros for the others, and
the backward updates allocated chunks only (the row optimizer runs on pool slots, so
``rowwise_adagrad`` keeps one accumulator per chunk). A row keeps a prefix of its chunks,
side by side in the pool, so the table is held as each row's first slot (int32) and chunk
count (uint8): 5 bytes a row where a full int32 table costs 4 k (20 B at dim 64 and
chunks of 16, 32 B with chunks of 8; measured first, it was half of FIITED's memory at
the budgets that matter).

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
any sharding of the tables prunes the same chunks) and the pool is laid out anew, exactly
its kept chunks: the slots freed by pruning are what revived chunks (starting from zeros)
and moved rows take, which is the free list's job done once per pruning. Memory held:
pool + pointers + scores; the optimizer's state is not counted (as for dense tables).
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

    def chunks_of(self, dim: int) -> int:
        """Chunks a row of ``dim`` dims splits into (the chunk must divide it)."""
        if dim % self.chunk:
            raise ValueError(f"--fiited-chunk {self.chunk} does not divide the tables' dim {dim}")
        return dim // self.chunk


class FiitedStore(nn.Module):
    """Rows of several tables over one pool of chunks; ``ptr`` (N, k) is the pointer table
    (row x chunk -> pool slot or -1), held as each row's first slot and chunk count.

    Args:
        weight: (N, D) initial rows, tables one after another.
        sizes: rows per table (sum N).
        spec: pruning settings; D must be a multiple of ``spec.chunk``.
        optimizer: the row optimizer run on pool slots (None: frozen).
    """

    pool: nn.Parameter
    base: torch.Tensor
    count: torch.Tensor
    score: torch.Tensor
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
        k = spec.chunks_of(d)
        if sum(sizes) != n:
            raise ValueError(f"table sizes add up to {sum(sizes)}, weight has {n} rows")
        self.spec, self.optimizer, self.sizes = spec, optimizer, list(sizes)
        #: the optimizer keeps state per slot (Adagrad kinds), moved with the chunks
        self.slot_state = optimizer is not None and optimizer.kind != "sgd"
        self.k, self.c, self.dim = k, spec.chunk, d
        chunks = weight.reshape(n * self.k, self.c).clone()
        self.pool = nn.Parameter(chunks, requires_grad=optimizer is not None)
        self.register_buffer("base", torch.arange(n, dtype=torch.int32) * self.k)
        self.register_buffer("count", torch.full((n,), self.k, dtype=torch.uint8))
        self.register_buffer("score", torch.zeros(n))
        self.register_buffer("state", optimizer.new_state(chunks) if optimizer else torch.zeros(0))
        if spec.rule == "uniform":  # a smaller dimension from the start
            self.prune()

    @property
    def bytes_held(self) -> int:
        """Pool, pointers (first slot and count per row) and scores, in bytes."""
        held = (self.pool, self.base, self.count, self.score)
        return sum(t.numel() * t.element_size() for t in held)

    def allocated(self) -> torch.Tensor:
        """(N, k) True where a chunk has a slot (a prefix of each row)."""
        return torch.arange(self.k, device=self.count.device) < self.count.unsqueeze(1)

    @property
    def ptr(self) -> torch.Tensor:
        """The pointer table (N, k): each chunk's pool slot, -1 where it is pruned."""
        slots = self.base.unsqueeze(1) + torch.arange(self.k, device=self.base.device)
        return torch.where(self.allocated(), slots, -1).to(torch.int32)

    def _slots(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (n, k) slots of ``rows``' chunks and which of them exist."""
        j = torch.arange(self.k, device=rows.device)
        return self.base[rows].long().unsqueeze(1) + j, j < self.count[rows].unsqueeze(1)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) row indices -> (n, D) rows, pruned chunks zero."""
        if not self.pool.shape[0]:  # everything pruned
            return self.pool.new_zeros(rows.numel(), self.dim)
        slots, held = self._slots(rows)
        slots = torch.where(held, slots, 0).view(-1)
        got = self.pool.detach().index_select(0, slots).view(-1, self.k, self.c)
        return (got * held.unsqueeze(-1)).view(-1, self.dim)

    @torch.no_grad()
    def update(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Score the rows by the norm of their step's gradient (summed over the lookups,
        so a sharded batch scores as a whole one); step the allocated chunks."""
        uniq, inv = torch.unique(rows, return_inverse=True)
        total = grad.new_zeros(uniq.numel(), grad.shape[1]).index_add_(0, inv, grad)
        if self.spec.rule == "frequency":  # how often the row was looked up
            self.score.index_add_(0, uniq, torch.bincount(inv).to(self.score.dtype))
        else:
            # + 1e-30: a looked-up row scores above zero even when its gradient was
            # masked to zero (no chunks), so the pruning still sees it was looked up.
            self.score.index_add_(0, uniq, total.norm(dim=1) + 1e-30)
        if self.optimizer is None:
            return
        slots, held = self._slots(uniq)  # distinct rows: distinct slots
        g = total.view(-1, self.k, self.c)[held]
        self.optimizer.step(self.pool.data, self.state, slots[held], g, distinct=True)

    @torch.no_grad()
    def prune(self) -> dict[str, Any]:
        """Keep each table's most important chunks, and lay the pool out anew: each row's
        chunks side by side, the kept ones moved, the revived ones zero (a revived chunk
        reads as it did while pruned). Returns what changed."""
        imp = self._importance().reshape(-1)
        keep = torch.zeros_like(imp, dtype=torch.bool)
        start = 0
        for n in self.sizes:
            span = slice(start * self.k, (start + n) * self.k)
            keep[span] = top_mask(imp[span], round(self.spec.budget * n * self.k))
            start += n
        old = self.count.long()
        new = keep.view(-1, self.k).sum(1)  # the importance keeps a prefix of each row
        self.score.mul_(self.spec.decay)
        freed, revived = int((old - new).clamp(min=0).sum()), int((new - old).clamp(min=0).sum())
        if not freed and not revived:  # the same chunks: the layout stands
            return {"freed": 0, "revived": 0, "slots": len(self.pool)}
        base = torch.cumsum(new, 0) - new
        # Each new slot's row and chunk, and where that chunk lived (if it did).
        row = torch.repeat_interleave(torch.arange(len(new), device=new.device), new)
        j = torch.arange(len(row), device=new.device) - base[row]
        live = j < old[row]
        src = (self.base[row].long() + j).masked_fill_(~live, 0)
        self.pool = nn.Parameter(_moved(self.pool.data, src, live), self.pool.requires_grad)
        if self.slot_state:
            self.state = _moved(self.state, src, live)
        self.base, self.count = base.to(torch.int32), new.to(torch.uint8)
        return {"freed": freed, "revived": revived, "slots": len(row)}

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

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # The pool and its optimizer state change size as the store prunes: take the
        # saved sizes before loading the values.
        for name in ("pool", "state"):
            saved = state_dict.get(prefix + name)
            mine = getattr(self, name)
            if saved is not None and saved.shape != mine.shape:
                fresh = mine.new_empty(saved.shape)
                if name == "pool":
                    self.pool = nn.Parameter(fresh, requires_grad=self.pool.requires_grad)
                else:
                    self.state = fresh
        super()._load_from_state_dict(state_dict, prefix, *args)


class HeldMask:
    """Zeroes the dims of each gradient row past its row's held chunks (``counts[t][row]``
    chunks of ``chunk`` dims, every pruned table of every owner; tables not named, e.g. TT
    tables, keep every dim): the exchange's ``grad_filter``, so the sample owner sends
    zeros where the row's owner would discard the gradient."""

    def __init__(self, counts: dict[int, torch.Tensor], chunk: int) -> None:
        tables = sorted(counts)
        self.flat = torch.cat([counts[t].long() for t in tables])  # rows end to end
        n = torch.tensor([len(counts[t]) for t in tables], device=self.flat.device)
        self.at = torch.tensor(tables, device=self.flat.device)
        self.first = torch.cumsum(n, 0) - n  # each table's first row in ``flat``
        self.chunk = chunk

    def __call__(self, grad: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """grad (b, T, D) of samples with ids (b, T) -> the masked gradient (one gather)."""
        held = self.flat[ids[:, self.at] + self.first]  # (b, |at|)
        keep = torch.arange(grad.shape[2], device=grad.device) // self.chunk < held[..., None]
        return grad.index_copy(1, self.at, grad.index_select(1, self.at) * keep)


def _moved(x: torch.Tensor, src: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Rows ``src`` of x where ``live``, zeros elsewhere (x may have no rows)."""
    if not len(x):
        return x.new_zeros(len(src), *x.shape[1:])
    return torch.where(live.view(-1, *[1] * (x.dim() - 1)), x.index_select(0, src), 0)


def top_mask(x: torch.Tensor, q: int) -> torch.Tensor:
    """A mask of the ``q`` largest values of ``x``, ties taken in index order: what the
    first q of a stable descending sort pick, found by one selection (no sort)."""
    if q >= x.numel() or q <= 0:
        return torch.full_like(x, q > 0, dtype=torch.bool)
    v = torch.kthvalue(x, x.numel() - q + 1).values  # the q-th largest
    above, tie = x > v, x == v
    return above | (tie & (torch.cumsum(tie, 0) <= q - int(above.sum())))


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
