"""Fused CPU kernels of the hybrid codec (numba): one pass per stage instead of ~20 torch ops.

They quantize, check the bound, hash and deduplicate rows, zig-zag and lay out byte planes
in a few loops, so what remains is zstd's entropy stage (a kept library) and the payload
header. tests/test_kernels.py holds them to a plain torch quantizer.

Exactness: the reconstruction is ``float(q) * float(2 eb)`` in the working precision
(float32 for float32 input, float64 for float64), one IEEE multiplication, bit-identical to
``torch.mul`` of the same values. The encoder checks every element's reconstruction against
the bound in float64 with ``>=`` (rounding is monotonic, so a true error above eb never
computes below eb) and hands every element that fails to the caller as an outlier.
No fastmath anywhere: contracting the check into an FMA would test a value the decoder
never produces.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

#: Largest code magnitude for float32 input (float32 holds integers exactly to 2^24) and
#: for float64 input (its zig-zag still fits 32 bits); larger codes travel as outliers.
QMAX32 = 2**24
QMAX64 = 2**30 - 1

# Decode status codes (the caller turns them into PayloadError messages).
OK, BAD_LITERAL_COUNT, BAD_REFERENCE, BAD_WIDTH = 0, 1, 2, 3


def _like(q: float, like: float) -> float:
    """``q`` rounded to the float type of ``like`` (typed by the overload below)."""
    raise NotImplementedError  # only called inside jitted code


@overload(_like)
def _like_impl(q, like):
    # numba matches these argument names to _like's; the lambdas are the typed bodies.
    if like == types.float32:
        return lambda q, like: np.float32(q)
    return lambda q, like: np.float64(q)


@njit(cache=True, nogil=True)
def width(top: int | np.integer) -> int:
    """Narrowest byte width (1, 2, 4 or 8) of a non-negative integer stream whose largest
    value is ``top``: the one rule for the fused and the torch packers."""
    if top < 256:
        return 1
    if top < 65536:
        return 2
    if top < 2**32:
        return 4
    return 8


@njit(cache=True, nogil=True)
def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for 1-D views that never overlap (numba's slice assignment checks for
    overlap and may copy through a temporary, which costs more than a row)."""
    for j in range(dst.size):
        dst[j] = src[j]


@njit(cache=True, nogil=True)
def put_planes(out: np.ndarray, base: int, vals: np.ndarray, n: int, w: int) -> None:
    """Write ``vals[:n]`` as ``w`` little-endian byte planes at ``out[base:]``.

    Loops run over slices: indexing ``out[base + i]`` makes numba guard every access
    against negative indices, which stops vectorization (10x slower here).
    """
    v = vals[:n]
    for b in range(w):
        o = out[base + b * n : base + (b + 1) * n]
        shift = 8 * b
        for i in range(n):
            o[i] = np.uint8((v[i] >> shift) & 0xFF)


@njit(cache=True, nogil=True)
def get_planes(raw: np.ndarray, base: int, n: int, w: int) -> np.ndarray:
    """Inverse of :func:`put_planes`: ``n`` values of ``w`` byte planes as int64."""
    v = np.zeros(n, np.int64)
    for b in range(w):
        p = raw[base + b * n : base + (b + 1) * n]
        shift = 8 * b
        for i in range(n):
            v[i] |= np.int64(p[i]) << shift
    return v


@njit(cache=True, nogil=True)
def encode_rows(
    x: np.ndarray, stepv: np.ndarray, eb: float, dedup: bool, qmax: int
) -> tuple[np.ndarray, int, int, int, int, np.ndarray]:
    """Quantize, check, deduplicate and lay out one chunk.

    Args:
        x: (N, D) C-contiguous float32 or float64 array, every element finite.
        stepv: one-element array of x's dtype holding 2 eb rounded once to that dtype (the
            decoder's step; an array so that the multiplication below runs in x's dtype).
        eb: absolute error bound (> 0).
        dedup: references to repeated rows where they save more than they cost.
        qmax: largest code magnitude (QMAX32 or QMAX64).
    Returns:
        planes (uint8: the refs stream's planes, if any, then the literal codes' planes),
        (w_refs, n_refs) with n_refs = 0 when no refs stream is written, (w_codes, n_codes),
        and the flat positions (int64) of elements that must travel exactly.
    """
    n, d = x.shape
    inv = 1.0 / (2.0 * eb)
    step = stepv[0]
    xf = x.reshape(n * d)
    zf = np.empty(n * d, np.uint32)
    n_miss = 0
    bits = np.uint32(0)  # OR of all codes: below 2^8 / 2^16 exactly when their maximum is
    # Branch-free so that LLVM vectorizes it; the rare misses are collected afterwards.
    for k in range(n * d):
        v = xf[k]
        q = min(max(np.rint(np.float64(v) * inv), -qmax), qmax)
        ok = abs(np.float64(_like(q, step) * step) - np.float64(v)) < eb
        qi = np.int64(q) if ok else np.int64(0)
        n_miss += not ok
        zz = np.uint32((qi << 1) ^ (qi >> 63))
        zf[k] = zz
        bits |= zz
    miss = np.empty(n_miss, np.int64)
    if n_miss:
        m = 0
        for k in range(n * d):
            v = xf[k]
            q = min(max(np.rint(np.float64(v) * inv), -qmax), qmax)
            if not abs(np.float64(_like(q, step) * step) - np.float64(v)) < eb:
                miss[m] = k
                m += 1
    # Rows: open-addressing table of row indices keyed by a hash of the codes; every hit is
    # verified element by element, so literal rows are exactly the first occurrences.
    refs = np.zeros(n, np.int64)
    lit_of = np.empty(n, np.int64)  # ordinal of each literal row, by row
    n_lit = n
    if dedup and n > 1:
        size = 1
        while size < 2 * n:
            size *= 2
        table = np.full(size, -1, np.int64)
        n_lit = 0
        # Hash = sum of codes times fixed odd 64-bit weights (wrapping): independent
        # products that vectorize, where a byte-serial hash would chain d multiplies.
        wts = np.empty(d, np.uint64)
        s64 = np.uint64(0x9E3779B97F4A7C15)
        for j in range(d):
            s64 = s64 * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
            wts[j] = s64 | np.uint64(1)
        for i in range(n):
            row = zf[i * d : (i + 1) * d]
            h = np.uint64(0)
            for j in range(d):
                h += np.uint64(row[j]) * wts[j]
            h ^= h >> np.uint64(31)
            slot = np.int64(h & np.uint64(size - 1))
            while True:
                r = table[slot]
                if r < 0:
                    table[slot] = i
                    lit_of[i] = n_lit
                    n_lit += 1
                    break
                other = zf[r * d : (r + 1) * d]
                diff = np.uint32(0)
                for j in range(d):
                    diff |= other[j] ^ row[j]
                if diff == 0:
                    refs[i] = lit_of[r] + 1
                    break
                slot = (slot + 1) & (size - 1)
        if (n - n_lit) * d <= n:
            n_lit = n
    use_refs = n_lit < n
    w_codes = width(np.int64(bits))  # repeated rows hold no code the literal ones lack
    n_codes = n_lit * d if use_refs else n * d
    top_ref = np.int64(0)
    if use_refs:
        for i in range(n):
            top_ref = max(top_ref, refs[i])
    w_refs = width(top_ref) if use_refs else 1
    n_refs = n if use_refs else 0
    planes = np.empty(w_refs * n_refs + w_codes * n_codes, np.uint8)
    base = w_refs * n_refs
    if use_refs:
        put_planes(planes, 0, refs, n, w_refs)
        lit = np.empty(n_codes, np.uint32)
        k = 0
        for i in range(n):
            if refs[i] == 0:
                _copy(lit[k : k + d], zf[i * d : i * d + d])
                k += d
        put_planes(planes, base, lit, n_codes, w_codes)
    else:
        put_planes(planes, base, zf, n_codes, w_codes)
    return planes, w_refs, n_refs, w_codes, n_codes, miss


@njit(cache=True, nogil=True)
def _dequantize_planes(
    raw: np.ndarray, base: int, n: int, w: int, step: float, out: np.ndarray
) -> None:
    """Zig-zagged codes in ``w`` byte planes -> code * step, in one pass for one-byte codes
    (the usual width at the paper's bounds) instead of through an int64 array."""
    if w == 1:
        p = raw[base : base + n]
        for i in range(n):
            zz = int(p[i])
            out[i] = _like((zz >> 1) ^ -(zz & 1), step) * step
        return
    codes = get_planes(raw, base, n, w)
    for i in range(n):
        zz = codes[i]
        out[i] = _like((zz >> 1) ^ -(zz & 1), step) * step


@njit(cache=True, nogil=True)
def decode_rows(
    raw: np.ndarray,
    w_refs: int,
    n_refs: int,
    w_codes: int,
    n_codes: int,
    out: np.ndarray,
    stepv: np.ndarray,
) -> int:
    """Inverse of :func:`encode_rows` into ``out`` (N, D); returns a status code.

    The literal rows are dequantized once; then every row is copied from the literal it is
    (the k-th literal row) or refers to, in one pass."""
    n, d = out.shape
    if n_refs == 0:
        if n_codes != n * d:
            return BAD_LITERAL_COUNT
        _dequantize_planes(raw, 0, n_codes, w_codes, stepv[0], out.reshape(n * d))
        return OK
    if n_refs != n or d == 0 or n_codes % d:
        return BAD_LITERAL_COUNT
    n_lit = n_codes // d
    vals = np.empty((n_lit, d), out.dtype)
    _dequantize_planes(raw, w_refs * n_refs, n_codes, w_codes, stepv[0], vals.reshape(n_codes))
    refs = get_planes(raw, 0, n_refs, w_refs)
    k = 0
    for i in range(n):
        r = refs[i]
        if r == 0:
            src = k
            k += 1
            if src >= n_lit:
                return BAD_LITERAL_COUNT
        else:
            src = r - 1
            if src >= k:  # a reference may only name a literal already sent
                return BAD_REFERENCE
        for j in range(d):
            out[i, j] = vals[src, j]
    if k != n_lit:
        return BAD_LITERAL_COUNT
    return OK
