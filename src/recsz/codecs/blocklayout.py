"""The format-3 layout as Triton device functions, shared by the kernels that make payloads
(:mod:`recsz.codecs.blockkernels`) and those that read them (:mod:`recsz.codecs.blockunpack`):
where a group's blocks and data start, each block's byte offset, a row's literal rank, the
bounds' words, the checksum's shares (:mod:`recsz.codecs.blockformat` defines the bytes).

Index spaces (all groups of a call laid end to end, :mod:`recsz.codecs.blockplan`):
*rows* (each group's rows, padded), *slots* (the same space: group g's literal rows
compacted to its first slots), the *code stream* (the slots' elements, 32 to a code
block), *ref blocks* (32 references each) and *blocks* (per group: its ref blocks, then
its code blocks). Each group's checksum parts are added with integer atomics (exact and
order-free modulo 2^32), one per group a program touches.
"""

from __future__ import annotations

import triton
import triton.language as tl

LANES = tl.constexpr(32)
MAX_WIDTH = tl.constexpr(14)  # wider blocks are stored raw
RAW = tl.constexpr(15)
F32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def block_size(w):
    return tl.where(w == RAW, 4 * LANES, 4 * w)


@triton.jit
def add_per_group(ck_ptr, g, part, valid):
    """Atomically add ``part`` of each valid lane into ck[g] (one atomic per group)."""
    g0 = tl.min(tl.where(valid, g, 2147483647), axis=0)
    g1 = tl.max(tl.where(valid, g, -1), axis=0)
    gg = g0
    while gg <= g1:
        s = tl.sum(tl.where(valid & (g == gg), part, 0).to(tl.uint32), axis=0)
        tl.atomic_add(ck_ptr + gg, s.to(tl.int32, bitcast=True))
        gg += 1


@triton.jit
def byte_hash(v, q):
    """Checksum share of byte value v at payload byte q (>= 8): its word's index i,
    v << 8 (q mod 4) times 2i + 1."""
    i = ((q - 8) // 4).to(tl.uint32)
    return (v.to(tl.uint32) << (8 * (q % 4)).to(tl.uint32)) * (2 * i + 1)


@triton.jit
def block_count(nrb, lit, wat, DIM: tl.constexpr):
    """A group's block count (its nrb reference blocks, then the code blocks of its L
    literal rows) and its data's first byte (after the width nibbles, 4-aligned)."""
    nbl = nrb + (lit * DIM + LANES - 1) // LANES
    return nbl, wat + ((nbl + 1) // 2 + 3) // 4 * 4


@triton.jit
def group_of_block(b, mb, bgid_ptr, bs_ptr, base_ptr, wat_ptr, nrb_ptr, lit_ptr,
                    DIM: tl.constexpr):  # fmt: skip
    """Block b's group, index in it, ref block count, block count, the payload's first
    byte and its data's."""
    g = tl.load(bgid_ptr + b, mask=mb, other=0)
    local = b - tl.load(bs_ptr + g, mask=mb, other=0)
    nrb = tl.load(nrb_ptr + g, mask=mb, other=0)
    nbl, data_at = block_count(nrb, tl.load(lit_ptr + g, mask=mb, other=0),
                               tl.load(wat_ptr + g, mask=mb, other=0), DIM)  # fmt: skip
    base = tl.load(base_ptr + g, mask=mb, other=0)
    return g, local, nrb, nbl, base, base + data_at


@triton.jit
def block_offset(b, mb, g, start, cs_ptr, size_ptr, bs_ptr):
    """Byte offset of block b: its group's data start plus the sizes before it."""
    before = tl.load(cs_ptr + b, mask=mb, other=0) - tl.load(size_ptr + b, mask=mb, other=0)
    first = tl.load(bs_ptr + g, mask=mb, other=0)
    first_before = tl.load(cs_ptr + first, mask=mb, other=0) - tl.load(
        size_ptr + first, mask=mb, other=0
    )
    return start + before - first_before


@triton.jit
def group_extent(g, lit, wat, nrb_ptr, bs_ptr, nbmax_ptr, cs_ptr, size_ptr, DIM: tl.constexpr):
    """Group g's block count and data start (given its L literal rows), and the bytes its
    blocks take (from the inclusive prefix sum ``cs`` of the blocks' sizes)."""
    nbl, data_at = block_count(tl.load(nrb_ptr + g), lit, wat, DIM)
    first = tl.load(bs_ptr + g)
    n = tl.load(nbmax_ptr + g)
    before = tl.load(cs_ptr + first, mask=n > 0, other=0) - tl.load(
        size_ptr + first, mask=n > 0, other=0
    )
    return nbl, data_at, tl.load(cs_ptr + first + n - 1, mask=n > 0, other=0) - before


@triton.jit
def copy_bounds(g, base, ebat_ptr, k_ptr, seg0_ptr, ebs_ptr, words_ptr, TO_PAYLOAD: tl.constexpr):
    """Group g's bounds (int64 bits at ebs[seg0 + j]) into its payload's words, or out of
    them; returns those words' checksum share."""
    ebat = tl.load(ebat_ptr + g)
    k = tl.load(k_ptr + g)
    s0 = tl.load(seg0_ptr + g)
    share = tl.zeros([32], dtype=tl.uint32)
    at = 0
    while at < k:
        j = at + tl.arange(0, 32)
        ms = j < k
        wd = (base + ebat) // 4 + 2 * j
        if TO_PAYLOAD:
            e = tl.load(ebs_ptr + s0 + j, mask=ms, other=0)
            lo = (e & 0xFFFFFFFF).to(tl.uint32)
            hi = ((e >> 32) & 0xFFFFFFFF).to(tl.uint32)
            tl.store(words_ptr + wd, lo.to(tl.int32, bitcast=True), mask=ms)
            tl.store(words_ptr + wd + 1, hi.to(tl.int32, bitcast=True), mask=ms)
        else:
            lo = tl.load(words_ptr + wd, mask=ms, other=0).to(tl.uint32, bitcast=True)
            hi = tl.load(words_ptr + wd + 1, mask=ms, other=0).to(tl.uint32, bitcast=True)
            tl.store(ebs_ptr + s0 + j, lo.to(tl.int64) | (hi.to(tl.int64) << 32), mask=ms)
        i = ((ebat - 8) // 4 + 2 * j).to(tl.uint32)
        share += tl.where(ms, lo * (2 * i + 1) + hi * (2 * i + 3), 0)
        at += 32
    return tl.sum(share, axis=0)


@triton.jit
def literal_ranks(r, mr, g, lit_ptr, cz_ptr, row0_ptr):
    """Literal rank of row r within its group, and the literal count before the group."""
    r0 = tl.load(row0_ptr + g, mask=mr, other=0)
    before = tl.load(cz_ptr + r0 - 1, mask=mr & (r0 > 0), other=0)
    lit = tl.load(lit_ptr + r, mask=mr, other=0)
    return tl.load(cz_ptr + r, mask=mr, other=0) - lit - before, before, r0, lit
