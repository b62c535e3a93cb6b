"""Sparse optimizers fused into the embedding backward: they touch only the batch's rows.

DLRM's tables hold millions of rows of which a batch reads a few thousand, so their
update is a scatter into the rows the batch looked up (fbgemm's TableBatchedEmbeddingBags
fuses it into the lookup's backward the same way). Duplicate rows are summed first, so
each row gets one update from its whole gradient, as torch's sparse optimizers do.

- ``sgd``: w -= lr g.
- ``adagrad``: s += g*g (one accumulator per element); w -= lr g / (sqrt(s) + eps), as
  ``torch.optim.Adagrad`` does with sparse gradients.
- ``rowwise_adagrad``: s += mean(g*g) (one accumulator per row, D times less state);
  w -= lr g / (sqrt(s) + eps), as fbgemm's ``EXACT_ROWWISE_ADAGRAD`` (TorchRec's and
  MLPerf DLRM's default for the tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recsz.devicepath import device_path
from recsz.model.multihot import mix32

ROW_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")

#: Default eps of each: torch's Adagrad, fbgemm's row-wise Adagrad.
_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8}

#: the dtypes rows may be stored in (``--table-dtype``); the half ones are updated in
#: float32, with float32 state, and rounded back (:func:`round_stochastic`)
TABLE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class RowOptimizer:
    """An optimizer of embedding rows: its kind, learning rate and eps. One object serves
    every table kind of a rank, so a schedule sets its rate once a step
    (:class:`recsz.model.schedule.ScheduledRates`)."""

    kind: str
    lr: float
    eps: float | None = None  # None: the kind's default

    def __post_init__(self) -> None:
        if self.kind not in ROW_OPTIMIZERS:
            raise ValueError(
                f"embedding optimizer {self.kind!r} is not one of: {', '.join(ROW_OPTIMIZERS)}"
            )
        if not self.lr > 0:
            raise ValueError(f"embedding learning rate must be positive, got {self.lr}")

    def new_state(self, weight: torch.Tensor) -> torch.Tensor:
        """The accumulator for ``weight`` (rows, D): per element, per row, or none (0 rows);
        float32 for half-precision rows."""
        half = weight.dtype in HALF_DTYPES
        dtype = torch.float32 if half else weight.dtype
        if self.kind == "adagrad":
            return torch.zeros_like(weight, dtype=dtype)
        n = weight.shape[0] if self.kind == "rowwise_adagrad" else 0
        return torch.zeros(n, dtype=dtype, device=weight.device)

    @torch.no_grad()
    def step(
        self,
        weight: torch.Tensor,
        state: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        distinct: bool = False,
        keep_size: bool | None = None,
        source: torch.Tensor | None = None,
    ) -> None:
        """Update ``weight`` in place from ``grad`` (n, D), the gradient of rows ``rows`` (n,),
        which may repeat (``distinct``: the caller has summed them already), or with
        ``source`` (n,) from ``grad[source]`` (the ids of bags: one gradient a bag, never
        copied to each id). ``keep_size`` (:func:`sum_by_row`; by default on a GPU's path)
        avoids a host sync."""
        if not rows.numel():
            return
        keep = device_path(rows.device) if keep_size is None else keep_size
        if distinct:
            uniq, g = rows, (grad if source is None else grad.index_select(0, source))
        else:
            uniq, g = sum_by_row(rows, grad, keep, source)
        # Gather the rows, update them, scatter them back: index_select / index_copy_ are
        # several times faster on the CPU than advanced indexing or index_add_ into a large
        # table (measured: 26k rows of a 325k x 64 table, 2.2 ms against 5.3 ms).
        stored = weight.index_select(0, uniq)
        half = weight.dtype in HALF_DTYPES
        w = stored.float() if half else stored  # a half row's update in float32
        if self.kind == "sgd":
            w.add_(g, alpha=-self.lr)
        else:
            eps = _EPS[self.kind] if self.eps is None else self.eps
            s = state.index_select(0, uniq)
            if self.kind == "adagrad":
                s.addcmul_(g, g)
                w.add_(g / s.sqrt().add_(eps), alpha=-self.lr)
            else:  # no (rows, D) temporaries: bags' update 39-44 -> 27-29 ms (bench_step)
                s.add_(torch.linalg.vector_norm(g, dim=1).square_().div_(g.shape[1]))
                w.addcmul_(g, (self.lr / s.sqrt().add_(eps)).unsqueeze(1), value=-1)
            state.index_copy_(0, uniq, s)
        if half:
            w = round_stochastic(w, weight.dtype, stored)
        weight.index_copy_(0, uniq, w)


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, salt: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` in ``dtype`` (float16, bfloat16): each value one of its two nearest
    neighbours there, the farther with the probability of its share of the gap, so that
    the expected value is ``x`` (an update smaller than the gap still moves a row, on
    average, as fbgemm's stochastic rounding of half-precision tables does). The draws are
    a hash of each value's bits and ``salt``'s (the stored values it replaces), not a
    generator's: the same run rounds alike on any number of ranks. NaN and inf stay."""
    near = x.to(dtype)
    nf = near.float()
    other = _next(near, x > nf)
    share = ((x - nf) / (other.float() - nf)).nan_to_num_(0.0)  # exact, inf, nan: 0
    bits = x.view(torch.int32).long() ^ (salt.view(torch.int16).long() << 16)
    draw = (mix32(bits.bitwise_and_(0xFFFFFFFF)) >> 8).float().mul_(2.0**-24)  # in [0, 1)
    return torch.where(draw < share, other, near)


def sum_by_row(
    rows: torch.Tensor,
    grad: torch.Tensor,
    keep_size: bool = False,
    source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their summed gradients): each distinct row once, or with ``keep_size`` (no
    host sync on a GPU: sizes known in advance) every position's row, sorted, with its
    row's whole sum. An update computed from those is the same for every copy of a row,
    so writing all copies back in any order leaves one result. With ``source``, the
    gradients are ``grad[source]``, never made (the ids of bags: one gradient a bag).
    Each row is summed in the order of its positions (a stable sort), each distinct row's
    by one ``embedding_bag`` over ``grad`` (1.3-2.3x faster than ``torch.unique`` and
    ``index_add_`` on one-hot rows, bit for bit the same sums)."""
    srt, perm = torch.sort(rows, stable=True)
    at = perm if source is None else source.index_select(0, perm)
    if keep_size:
        new = torch.ones_like(srt, dtype=torch.bool)
        new[1:] = srt[1:] != srt[:-1]
        run = torch.cumsum(new, 0) - 1
        sums = grad.new_zeros(rows.numel(), grad.shape[1]).index_add_(0, run, grad[at])
        return srt, sums[run]
    uniq, counts = torch.unique_consecutive(srt, return_counts=True)
    return uniq, F.embedding_bag(at, grad, torch.cumsum(counts, 0) - counts, mode="sum")


def _next(h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The neighbour of each 16-bit float ``h`` above it (``up``) or below it, found on its
    bits (sign and magnitude, as float16's and bfloat16's are): any device, no nextafter."""
    b = h.view(torch.int16)
    step = (up ^ (b < 0)).to(torch.int16).mul_(2).sub_(1)  # a negative's magnitude: down
    zero = (b & 0x7FFF) == 0  # +0 or -0: the smallest subnormal on the side asked
    first = torch.where(up, 1, -0x7FFF).to(torch.int16)
    return torch.where(zero, first, b + step).view(h.dtype)
