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
def quantize_kernel(x_ptr, map_ptr, eb_ptr, zz_ptr, raw_ptr, n, dim, qmax, BLOCK: tl.constexpr):
    """Zig-zagged codes of the n elements of the literal rows (row c is row map[c] of x,
    float32; -1: a zero row; eb per row of x, float64), and per 32-value block whether
    the quantizer missed any of its elements (then the block is stored raw)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = tl.load(map_ptr + offs // dim, mask=m, other=-1)
    m2 = m & (row >= 0)
    x = tl.load(x_ptr + row * dim + offs % dim, mask=m2, other=0.0).to(tl.float64)
    eb = tl.load(eb_ptr + row, mask=m2, other=1.0)
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
    missed = tl.max(tl.reshape((~ok).to(tl.int8), (BLOCK // LANES, LANES)), axis=1)
    blk = tl.program_id(0).to(tl.int64) * (BLOCK // LANES) + tl.arange(0, BLOCK // LANES)
    tl.store(raw_ptr + blk, missed, mask=blk * LANES < n)


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
def _blocks_of(src_ptr, w_ptr, off_ptr, base_ptr, nb, B: tl.constexpr):
    """This program's blocks: index, mask, source map entry, width, byte offset, and the
    checksum index of its first word (from its payload's first byte)."""
    b = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mb = b < nb
    src = tl.load(src_ptr + b, mask=mb, other=0).to(tl.int64)
    w = tl.load(w_ptr + b, mask=mb, other=0).to(tl.int32)
    off = tl.load(off_ptr + b, mask=mb, other=0)
    base = tl.load(base_ptr + b, mask=mb, other=0)
    return b, mb, src, w, off, ((off - base - 8) // 4).to(tl.uint32)


@triton.jit
def pack_kernel(
    src_ptr, code_ptr, ref_ptr, xbits_ptr, map_ptr, dim, w_ptr, off_ptr, base_ptr, out32_ptr,
    part_ptr, nb, B: tl.constexpr,
):  # fmt: skip
    """Write each block's planes, or its raw words (float32 bits, or the references), at
    its byte offset; ``part`` gets the checksum's share of the block's data words."""
    b, mb, src, w, off, i0 = _blocks_of(src_ptr, w_ptr, off_ptr, base_ptr, nb, B)
    lane = tl.arange(0, LANES)
    raw = w == RAW
    v = _values(src, mb, code_ptr, ref_ptr)
    word0 = off // 4
    part = tl.zeros([B], dtype=tl.uint32)
    for j in tl.static_range(MAX_WIDTH):
        plane = tl.sum((((v >> j) & 1) << lane[None, :].to(tl.uint32)), axis=1).to(tl.uint32)
        keep = mb & (j < w) & ~raw
        tl.store(out32_ptr + word0 + j, plane.to(tl.int32, bitcast=True), mask=keep)
        part += tl.where(keep, plane * (2 * (i0 + j) + 1), 0)
    is_code = (src >= 0)[:, None]
    rm = (mb & raw)[:, None]
    at = src[:, None] * LANES + lane[None, :]  # literal element: row map[at // dim] of x
    row = tl.load(map_ptr + at // dim, mask=rm & is_code, other=-1)
    xb = tl.load(xbits_ptr + row * dim + at % dim, mask=rm & is_code & (row >= 0), other=0)
    xu = tl.where(is_code, xb.to(tl.uint32, bitcast=True), v)
    tl.store(out32_ptr + word0[:, None] + lane[None, :], xu.to(tl.int32, bitcast=True), mask=rm)
    part += tl.sum(tl.where(rm, xu * (2 * (i0[:, None] + lane[None, :]) + 1), 0), axis=1)
    tl.store(part_ptr + b, part.to(tl.int32, bitcast=True), mask=mb)


@triton.jit
def unpack_kernel(
    src_ptr, w_ptr, off_ptr, base_ptr, in32_ptr, n_words, eb_ptr, dim,
    out_ptr, ref_ptr, part_ptr, nb, B: tl.constexpr, CODES: tl.constexpr, REFS: tl.constexpr,
):  # fmt: skip
    """Decode each block into the element stream (dequantized, or raw words as they are)
    or the reference stream; ``part`` gets the checksum's share of its data words."""
    b, mb, src, w, off, i0 = _blocks_of(src_ptr, w_ptr, off_ptr, base_ptr, nb, B)
    lane = tl.arange(0, LANES)
    raw = w == RAW
    word0 = off // 4
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
    if CODES:
        tl.store(out_ptr + at, y, mask=(mb & is_code)[:, None])
    if REFS:
        ref_at = (-src - 1)[:, None] * LANES + lane[None, :]
        tl.store(ref_ptr + ref_at, zi, mask=(mb & ~is_code)[:, None])


@triton.jit
def row_key_kernel(
    bits_ptr, mult_ptr, piece_ptr, pad_ptr, key_ptr, n_rows, hash_mask, shift,
    dim: tl.constexpr, ROWS: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """Each row's dedup key: (sum_d uint32 bits x mult[d]) & mask | piece << shift,
    int64 arithmetic wrapping; -(row + 1) for pad rows (never matched)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mr = r < n_rows
    h = tl.zeros([ROWS], dtype=tl.int64)
    for d0 in tl.static_range(0, dim, DB):
        d = d0 + tl.arange(0, DB)
        md = d < dim
        v = tl.load(
            bits_ptr + r[:, None] * dim + d[None, :], mask=mr[:, None] & md[None, :], other=0
        )
        m = tl.load(mult_ptr + d, mask=md, other=0)
        h += tl.sum((v.to(tl.int64) & 0xFFFFFFFF) * m[None, :], axis=1)
    piece = tl.load(piece_ptr + r, mask=mr, other=0)
    pad = tl.load(pad_ptr + r, mask=mr, other=1)
    key = tl.where(pad != 0, -(r + 1), (h & hash_mask) | (piece << shift))
    tl.store(key_ptr + r, key, mask=mr)


@triton.jit
def same_rows_kernel(
    bits_ptr, a_ptr, b_ptr, out_ptr, n, dim: tl.constexpr, ROWS: tl.constexpr, DB: tl.constexpr
):  # fmt: skip
    """out[i] = row a[i] of bits equals row b[i], bit for bit."""
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mi = i < n
    ra = tl.load(a_ptr + i, mask=mi, other=0)
    rb = tl.load(b_ptr + i, mask=mi, other=0)
    diff = tl.zeros([ROWS], dtype=tl.int32)
    for d0 in tl.static_range(0, dim, DB):
        d = d0 + tl.arange(0, DB)
        m = mi[:, None] & (d < dim)[None, :]
        va = tl.load(bits_ptr + ra[:, None] * dim + d[None, :], mask=m, other=0)
        vb = tl.load(bits_ptr + rb[:, None] * dim + d[None, :], mask=m, other=0)
        diff += tl.sum((va != vb).to(tl.int32), axis=1)
    tl.store(out_ptr + i, (diff == 0).to(tl.int8), mask=mi)
