"""The finite range of each table's values on a GPU, by one Triton kernel (CI runs it under
``TRITON_INTERPRET=1`` against the torch reduction of :func:`recsz.policy.base.
absolute_bounds`): one pass over the step tensor, no copies, no host sync."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64  # rows of one table per program


@triton.jit
def range_kernel(x_ptr, s_t, s_b, n_b, lo_ptr, hi_ptr, n_chunks, DIM: tl.constexpr,
                 DP: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Smallest and largest finite value of rows [c ROWS, (c + 1) ROWS) of table t (+inf
    and -inf where there is none), at lo/hi[t, c]."""
    t = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0).to(tl.int64)
    r = c * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DP)
    m = (r < n_b)[:, None] & (d < DIM)[None, :]
    v = tl.load(x_ptr + t * s_t + r[:, None] * s_b + d[None, :], mask=m, other=0.0)
    v = v.to(tl.float32)
    fin = m & (tl.abs(v) < float("inf"))  # NaN compares false
    lo = tl.min(tl.min(tl.where(fin, v, float("inf")), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(fin, v, -float("inf")), axis=1), axis=0)
    tl.store(lo_ptr + t * n_chunks + c, lo)
    tl.store(hi_ptr + t * n_chunks + c, hi)


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel takes x: (tables, rows, dim), dim contiguous, on a GPU."""
    return x.is_cuda and x.dim() == 3 and x.stride(2) == 1 and x.numel() > 0


def finite_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per table j, the smallest and largest finite value of x[j] (float64; +inf / -inf
    where x[j] holds none)."""
    n_t, n_b, dim = x.shape
    n_chunks = triton.cdiv(n_b, ROWS)
    lo = torch.empty(n_t, max(n_chunks, 1), dtype=torch.float32, device=x.device)
    hi = torch.empty_like(lo)
    if n_chunks:
        dp = triton.next_power_of_2(dim)
        range_kernel[(n_chunks, n_t)](x, x.stride(0), x.stride(1), n_b, lo, hi, n_chunks,
                                      DIM=dim, DP=dp, ROWS=ROWS)  # fmt: skip
    else:
        lo.fill_(float("inf"))
        hi.fill_(-float("inf"))
    return lo.amin(1).double(), hi.amax(1).double()
