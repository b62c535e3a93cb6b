"""Triton kernels of the format-3 block coder (:mod:`recsz.codecs.blockformat` defines the
bytes; :mod:`recsz.codecs.blockcoder` launches these). They run on a GPU, and on the CPU
under ``TRITON_INTERPRET=1``, where CI checks them against the numpy reference.

Blocks are addressed through a *source map*: entry b >= 0 is code block b of the step's
element stream, entry b < 0 is reference block -b - 1, so a group's reference and code
blocks sit together in its payload while the kernels read two plain streams.
Floating point: the only products are q x 2eb, each rounded before any sum (no fused
multiply-add can change a result); x / 2eb is a correctly rounded float64 division.
"""

from __future__ import annotations

import triton
import triton.language as tl

LANES = tl.constexpr(32)
MAX_WIDTH = tl.constexpr(14)  # wider blocks are stored raw
RAW = tl.constexpr(15)
F32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def quantize_kernel(x_ptr, eb_ptr, zz_ptr, bad_ptr, n, dim, qmax, BLOCK: tl.constexpr):
    """Zig-zagged codes and miss flags of n float32 elements; eb per row (float64)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float64)
    eb = tl.load(eb_ptr + offs // dim, mask=m, other=1.0)
    step = eb * 2.0
    qf = tl.floor(x / step + 0.5)
    ok = tl.abs(qf) <= qmax
    prod = tl.where(ok, qf * step, 0.0)
    ok = ok & (tl.abs(prod) <= F32_MAX)  # beyond it float32 holds no reconstruction
    qf = tl.where(ok, qf, 0.0)
    y = tl.where(ok, prod, 0.0).to(tl.float32).to(tl.float64)
    ok = ok & (tl.abs(x - y) <= eb)
    q = qf.to(tl.int32)
    zz = (q << 1) ^ (q >> 31)
    tl.store(zz_ptr + offs, tl.where(ok, zz, 0), mask=m)
    tl.store(bad_ptr + offs, (~ok).to(tl.int8), mask=m)


@triton.jit
def _values(src, mb, code_ptr, ref_ptr):
    """[B, 32] values of the blocks named by the source map entries ``src``."""
    lane = tl.arange(0, LANES)
    is_code = src >= 0
    code_at = src[:, None] * LANES + lane[None, :]
    ref_at = (-src - 1)[:, None] * LANES + lane[None, :]
    cv = tl.load(code_ptr + code_at, mask=(mb & is_code)[:, None], other=0)
    rv = tl.load(ref_ptr + ref_at, mask=(mb & ~is_code)[:, None], other=0)
    return tl.where(is_code[:, None], cv, rv).to(tl.uint32)


@triton.jit
def widths_kernel(src_ptr, code_ptr, ref_ptr, raw_ptr, w_ptr, nb, B: tl.constexpr):
    """Width of each block: the bit length of its largest value; RAW where that exceeds
    MAX_WIDTH or the block holds an element the quantizer missed."""
    b = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mb = b < nb
    src = tl.load(src_ptr + b, mask=mb, other=0).to(tl.int64)
    v = _values(src, mb, code_ptr, ref_ptr)
    top = tl.max(v, axis=1)
    w = tl.zeros([B], dtype=tl.int32)
    for j in tl.static_range(26):
        w += ((top >> j) != 0).to(tl.int32)
    raw = (tl.load(raw_ptr + src, mask=mb & (src >= 0), other=0) != 0) | (w > MAX_WIDTH)
    tl.store(w_ptr + b, tl.where(raw, RAW, w).to(tl.uint8), mask=mb)


@triton.jit
def pack_kernel(
    src_ptr, code_ptr, ref_ptr, xbits_ptr, w_ptr, off_ptr, base_ptr, out32_ptr, part_ptr,
    nb, B: tl.constexpr,
):  # fmt: skip
    """Write each block's planes, or its raw words (float32 bits, or the references), at
    its byte offset; ``part`` gets the checksum's share of the block's data words."""
    b = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mb = b < nb
    lane = tl.arange(0, LANES)
    src = tl.load(src_ptr + b, mask=mb, other=0).to(tl.int64)
    w = tl.load(w_ptr + b, mask=mb, other=0).to(tl.int32)
    off = tl.load(off_ptr + b, mask=mb, other=0)
    base = tl.load(base_ptr + b, mask=mb, other=0)  # the payload's first byte
    raw = w == RAW
    v = _values(src, mb, code_ptr, ref_ptr)
    word0 = off // 4
    i0 = ((off - base - 8) // 4).to(tl.uint32)  # checksum index of the first word
    part = tl.zeros([B], dtype=tl.uint32)
    for j in tl.static_range(MAX_WIDTH):
        plane = tl.sum((((v >> j) & 1) << lane[None, :].to(tl.uint32)), axis=1).to(tl.uint32)
        keep = mb & (j < w) & ~raw
        tl.store(out32_ptr + word0 + j, plane.to(tl.int32, bitcast=True), mask=keep)
        part += tl.where(keep, plane * (2 * (i0 + j) + 1), 0)
    is_code = (src >= 0)[:, None]
    rm = (mb & raw)[:, None]
    xb = tl.load(xbits_ptr + src[:, None] * LANES + lane[None, :], mask=rm & is_code, other=0)
    xu = tl.where(is_code, xb.to(tl.uint32, bitcast=True), v)
    tl.store(out32_ptr + word0[:, None] + lane[None, :], xu.to(tl.int32, bitcast=True), mask=rm)
    part += tl.sum(tl.where(rm, xu * (2 * (i0[:, None] + lane[None, :]) + 1), 0), axis=1)
    tl.store(part_ptr + b, part.to(tl.int32, bitcast=True), mask=mb)


@triton.jit
def unpack_kernel(
    src_ptr, w_ptr, off_ptr, base_ptr, in32_ptr, n_words, eb_ptr, dim,
    out_ptr, ref_ptr, part_ptr, nb, B: tl.constexpr,
):  # fmt: skip
    """Decode each block into the element stream (dequantized, or raw words as they are)
    or the reference stream; ``part`` gets the checksum's share of its data words."""
    b = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mb = b < nb
    lane = tl.arange(0, LANES)
    src = tl.load(src_ptr + b, mask=mb, other=0).to(tl.int64)
    w = tl.load(w_ptr + b, mask=mb, other=0).to(tl.int32)
    off = tl.load(off_ptr + b, mask=mb, other=0)
    base = tl.load(base_ptr + b, mask=mb, other=0)
    raw = w == RAW
    word0 = off // 4
    i0 = ((off - base - 8) // 4).to(tl.uint32)
    v = tl.zeros([B, LANES], dtype=tl.uint32)
    part = tl.zeros([B], dtype=tl.uint32)
    for j in tl.static_range(MAX_WIDTH):
        at = word0 + j
        keep = mb & (j < w) & ~raw & (at < n_words)
        plane = tl.load(in32_ptr + at, mask=keep, other=0).to(tl.uint32, bitcast=True)
        v |= ((plane[:, None] >> lane[None, :].to(tl.uint32)) & 1) << j
        part += tl.where(keep, plane * (2 * (i0 + j) + 1), 0)
    ra = word0[:, None] + lane[None, :]
    rm = (mb & raw)[:, None] & (ra < n_words)
    xb = tl.load(in32_ptr + ra, mask=rm, other=0)
    xu = xb.to(tl.uint32, bitcast=True)
    part += tl.sum(tl.where(rm, xu * (2 * (i0[:, None] + lane[None, :]) + 1), 0), axis=1)
    tl.store(part_ptr + b, part.to(tl.int32, bitcast=True), mask=mb)
    v = tl.where(raw[:, None], xu, v)
    is_code = src >= 0
    at = src[:, None] * LANES + lane[None, :]
    zi = v.to(tl.int32, bitcast=True)
    q = (zi >> 1) ^ -(zi & 1)
    eb = tl.load(eb_ptr + at // dim, mask=(mb & is_code)[:, None], other=1.0)
    # Clamped: a valid payload never needs it; a damaged one must not overflow (its
    # checksum fails).
    y = tl.minimum(tl.maximum(q.to(tl.float64) * (eb * 2.0), -F32_MAX), F32_MAX).to(tl.float32)
    y = tl.where(raw[:, None], xb.to(tl.float32, bitcast=True), y)
    tl.store(out_ptr + at, y, mask=(mb & is_code)[:, None])
    ref_at = (-src - 1)[:, None] * LANES + lane[None, :]
    tl.store(ref_ptr + ref_at, zi, mask=(mb & ~is_code)[:, None])
