"""Relative bounds on a GPU in two Triton launches (CI runs them under ``TRITON_INTERPRET=1``
against the torch path of :func:`recsz.policy.base.absolute_bounds`): one pass over the
step tensor for each table's finite range, one program per table for its bound; no
copies, no host sync."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from recsz.codecs.payload import constant
from recsz.devicepath import device_path
from recsz.interpreter import interpreted

#: Rows of one table per program: on a GPU, and under Triton's interpreter (fewer, wider
#: programs: there a program costs about its operations' count whatever their width).
GPU_ROWS, WIDE_ROWS = 64, 1024
ROWS = WIDE_ROWS if interpreted() else GPU_ROWS


@triton.jit(do_not_specialize=["s_t", "s_b", "n_b", "n_chunks"])
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


@triton.jit(do_not_specialize=["n_chunks"])
def bound_kernel(lo_ptr, hi_ptr, f_ptr, clamp_ptr, out_ptr, n_chunks, CH: tl.constexpr):
    """Table t's bound: factor x its finite range (its magnitude where the range is 0, 0
    where nothing is finite), clamped to [clamp[0], clamp[1]], in float64 (the torch
    path's operations; the clamps come from memory: float arguments would be float32)."""
    t = tl.program_id(0).to(tl.int64)
    lo = tl.full([CH], float("inf"), tl.float32)
    hi = tl.full([CH], -float("inf"), tl.float32)
    at = 0
    while at < n_chunks:
        c = at + tl.arange(0, CH)
        m = c < n_chunks
        lo = tl.minimum(lo, tl.load(lo_ptr + t * n_chunks + c, mask=m, other=float("inf")))
        hi = tl.maximum(hi, tl.load(hi_ptr + t * n_chunks + c, mask=m, other=-float("inf")))
        at += CH
    lo64 = tl.min(lo, axis=0).to(tl.float64)
    hi64 = tl.max(hi, axis=0).to(tl.float64)
    r = hi64 - lo64
    r = tl.where(r > 0, r, tl.maximum(tl.abs(lo64), tl.abs(hi64)))
    r = tl.where(tl.abs(r) < float("inf"), r, 0.0)
    b = tl.load(f_ptr + t) * r
    tl.store(out_ptr + t, tl.minimum(tl.maximum(b, tl.load(clamp_ptr)), tl.load(clamp_ptr + 1)))


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel takes x: (tables, rows, dim), dim contiguous, on a GPU (or on the
    CPU with the device path, RECSZ_DEVICE_PATH_ON_CPU)."""
    return device_path(x.device) and x.dim() == 3 and x.stride(2) == 1 and x.numel() > 0


def bounds(f: torch.Tensor, x: torch.Tensor, lo_clamp: float, hi_clamp: float) -> torch.Tensor:
    """Per table j, ``f[j]`` (float64) relative to the finite range of x[j], clamped."""
    lo, hi, n_chunks = _partial_ranges(x)
    out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    clamp = constant(np.array([lo_clamp, hi_clamp], np.float64), torch.float64, x.device)
    bound_kernel[(x.shape[0],)](lo, hi, f, clamp, out, n_chunks, CH=128)
    return out


def finite_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per table j, the smallest and largest finite value of x[j] (float64; +inf / -inf
    where x[j] holds none)."""
    lo, hi, _ = _partial_ranges(x)
    return lo.amin(1).double(), hi.amax(1).double()


def _partial_ranges(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
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
    return lo, hi, max(n_chunks, 1)
