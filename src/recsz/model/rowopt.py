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

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

ROW_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")

#: Default eps of each: torch's Adagrad, fbgemm's row-wise Adagrad.
_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8}

#: Row positions times batch positions must stay below this for the CPU kernel's sort keys.
_KEY_LIMIT = 2**62


@dataclass(frozen=True)
class RowOptimizer:
    """An optimizer of embedding rows: its kind, learning rate and eps."""

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
        """The accumulator for ``weight`` (rows, D): per element, per row, or none (0 rows).
        On the CPU it also loads the kernel for ``weight``'s dtype (~0.3 s from numba's
        cache), so that the first training step does not wait for it."""
        if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64):
            _load_kernel(weight.dtype)
        if self.kind == "adagrad":
            return torch.zeros_like(weight)
        n = weight.shape[0] if self.kind == "rowwise_adagrad" else 0
        return torch.zeros(n, dtype=weight.dtype, device=weight.device)

    @torch.no_grad()
    def step(
        self,
        weight: torch.Tensor,
        state: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        distinct: bool = False,
        keep_size: bool | None = None,
    ) -> None:
        """Update ``weight`` in place from ``grad`` (n, D), the gradient of rows ``rows`` (n,),
        which may repeat (``distinct``: the caller has summed them already). ``keep_size``
        (:func:`sum_by_row`; by default on a GPU) avoids a host sync. On the CPU, unless
        ``keep_size`` is given, one fused kernel does it all (:func:`_update_rows`)."""
        if not rows.numel():
            return
        eps = _EPS[self.kind] if self.eps is None else self.eps
        if keep_size is None and _fits_kernel(weight, state, rows, grad):
            st = state.view(state.shape[0], -1) if state.numel() else state.new_empty(0, 1)
            n = rows.numel()
            # Sorted row by row, each row's positions in batch order (numpy's sort: ~20x
            # numba's here).
            keys = np.sort(rows.numpy() * n + np.arange(n))
            kind = ROW_OPTIMIZERS.index(self.kind)
            _update_rows(weight.numpy(), st.numpy(), keys, grad.contiguous().numpy(),
                         self.lr, eps, kind)  # fmt: skip
            return
        keep = rows.is_cuda if keep_size is None else keep_size
        uniq, g = (rows, grad) if distinct else sum_by_row(rows, grad, keep)
        # Gather the rows, update them, scatter them back: index_select / index_copy_ are
        # several times faster on a large table than advanced indexing or index_add_.
        w = weight.index_select(0, uniq)
        if self.kind == "sgd":
            w.add_(g, alpha=-self.lr)
        else:
            s = state.index_select(0, uniq)
            if self.kind == "adagrad":
                s.addcmul_(g, g)
                w.add_(g / s.sqrt().add_(eps), alpha=-self.lr)
            else:
                s.add_(g.square().mean(1))
                w.add_(g * (self.lr / s.sqrt().add_(eps)).unsqueeze(1), alpha=-1)
            state.index_copy_(0, uniq, s)
        weight.index_copy_(0, uniq, w)


@functools.cache
def _load_kernel(dtype: torch.dtype) -> None:
    """Compile or load :func:`_update_rows` for ``dtype`` by updating a one-row table."""
    one = torch.zeros(1, 1, dtype=dtype).numpy()
    _update_rows(one, one.copy(), np.zeros(1, np.int64), one.copy(), 0.0, 0.0, 0)


def _fits_kernel(
    weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor
) -> bool:
    """The CPU kernel takes contiguous float32/float64 tables and row numbers whose sort
    keys (row * n + position) fit 63 bits."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.float64)
        and grad.dtype == state.dtype == weight.dtype
        and weight.is_contiguous()
        and state.is_contiguous()
        and rows.dtype == torch.int64
        and int(rows.max()) < _KEY_LIMIT // rows.numel()
    )


@njit(cache=True, nogil=True)
def _update_rows(
    weight: np.ndarray,
    state: np.ndarray,
    keys: np.ndarray,
    grad: np.ndarray,
    lr: float,
    eps: float,
    kind: int,
) -> None:
    """The update in one pass over the sorted keys (row * n + position; CPU): each row's
    gradients summed in batch order, then its update (kind: index into ROW_OPTIMIZERS),
    in the tables' precision, where torch's ops gather, update and scatter the rows in
    several passes."""
    n, d = grad.shape
    acc = np.empty(d, grad.dtype)
    zero = grad.dtype.type(0)
    lr_, eps_ = grad.dtype.type(lr), grad.dtype.type(eps)
    i = 0
    while i < n:
        r = keys[i] // n
        acc[:] = grad[keys[i] - r * n]
        i += 1
        while i < n and keys[i] // n == r:
            acc += grad[keys[i] - r * n]
            i += 1
        w = weight[r]
        if kind == 0:  # sgd
            for c in range(d):
                w[c] -= lr_ * acc[c]
        elif kind == 1:  # adagrad
            s = state[r]
            for c in range(d):
                s[c] += acc[c] * acc[c]
                w[c] -= lr_ * (acc[c] / (np.sqrt(s[c]) + eps_))
        else:  # rowwise_adagrad
            sq = zero
            for c in range(d):
                sq += acc[c] * acc[c]
            state[r, 0] += sq / d
            scale = lr_ / (np.sqrt(state[r, 0]) + eps_)
            for c in range(d):
                w[c] -= acc[c] * scale


def sum_by_row(
    rows: torch.Tensor, grad: torch.Tensor, keep_size: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their summed gradients): each distinct row once, or with ``keep_size`` (no
    host sync on a GPU: sizes known in advance) every position's row, sorted, with its
    row's whole sum. An update computed from those is the same for every copy of a row,
    so writing all copies back in any order leaves one result."""
    if not keep_size:
        uniq, inv = torch.unique(rows, return_inverse=True)
        return uniq, grad.new_zeros(uniq.numel(), grad.shape[1]).index_add_(0, inv, grad)
    srt, perm = torch.sort(rows)
    new = torch.ones_like(srt, dtype=torch.bool)
    new[1:] = srt[1:] != srt[:-1]
    run = torch.cumsum(new, 0) - 1
    return srt, grad.new_zeros(grad.shape).index_add_(0, run, grad[perm])[run]
