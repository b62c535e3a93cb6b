"""Triton kernels of the format-3 block coder that make payloads (the bytes:
:mod:`recsz.codecs.blockformat`; index spaces and the device functions shared with the
decoding kernels: :mod:`recsz.codecs.blocklayout`; :mod:`recsz.codecs.blockcoder` launches
these in order). They run on a GPU, and on the CPU under ``TRITON_INTERPRET=1``, where CI
checks them against the CPU coder (:mod:`recsz.codecs.blockcpu`).

Floating point: the only products are q x 2eb, each rounded before any sum (no fused
multiply-add can change a result); x / 2eb is a correctly rounded float64 division.
"""

from __future__ import annotations

import triton
import triton.language as tl

from recsz.codecs.blocklayout import (
    F32_MAX,
    LANES,
    MAX_WIDTH,
    RAW,
    add_per_group,
    block_offset,
    block_size,
    byte_hash,
    copy_bounds,
    group_extent,
    group_of_block,
    literal_ranks,
)


@triton.jit
def _width(v, missed):
    """Width of [B, 32] blocks of codes: bit length of the largest, RAW if too wide/missed."""
    top = tl.max(v, axis=1)
    w = tl.zeros(top.shape, dtype=tl.int32)
    for j in tl.static_range(26):
        w += ((top >> j) != 0).to(tl.int32)
    return tl.where(missed | (w > MAX_WIDTH), RAW, w)


# ---- deduplication ----------------------------------------------------------------------
@triton.jit
def _slot(key, mask):
    """Home slot of a row key in a table of ``mask + 1`` (a power of two) slots."""
    return ((key * -7046029254386353131) >> 29) & mask


@triton.jit(do_not_specialize=["n_rows", "mask"])
def row_insert_kernel(
    bits_ptr, mult_ptr, rseg_ptr, tab_ptr, key_ptr, map_ptr, n_rows, mask,
    DIM: tl.constexpr, ROWS: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """Each row's key (its segment above the low 32 bits of sum_d uint32 bits x mult[d],
    int64 arithmetic, wrapping; -1 for pad rows) into ``key`` (and -1 into ``map``, which
    the rows' placement fills later), and into an open-addressing
    table (``tab``: mask + 1 key slots holding key + 1, 0 when free, then as many slots
    holding n_rows - the first row of the key, by atomic max: the same whatever order the
    rows arrive in). Plain loads skip the atomics a hot key would queue up on."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mr = r < n_rows
    h = tl.zeros([ROWS], dtype=tl.int64)
    for d0 in tl.static_range(0, DIM, DB):
        d = d0 + tl.arange(0, DB)
        md = d < DIM
        v = tl.load(
            bits_ptr + r[:, None] * DIM + d[None, :], mask=mr[:, None] & md[None, :], other=0
        )
        m = tl.load(mult_ptr + d, mask=md, other=0)
        h += tl.sum((v.to(tl.int64) & 0xFFFFFFFF) * m[None, :], axis=1)
    seg = tl.load(rseg_ptr + r, mask=mr, other=-1).to(tl.int64)
    key = tl.where(seg >= 0, (seg << 32) | (h & 0xFFFFFFFF), -1)
    tl.store(key_ptr + r, key, mask=mr)
    tl.store(map_ptr + r, tl.full([ROWS], -1, tl.int64), mask=mr)
    slot = _slot(key, mask)
    todo = mr & (seg >= 0)
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        held = tl.load(tab_ptr + slot, mask=todo, other=0, volatile=True)
        free = todo & (held == 0)
        # Rows not inserting compare with -1, which no slot holds: no write.
        old = tl.atomic_cas(tab_ptr + slot, tl.where(free, 0, -1).to(tl.int64), key + 1)
        held = tl.where(free, old, held)
        found = todo & ((held == 0) | (held == key + 1))
        score = n_rows - r
        best = tl.load(tab_ptr + mask + 1 + slot, mask=found, other=0, volatile=True)
        tl.atomic_max(tab_ptr + mask + 1 + slot, score, mask=found & (best < score))
        todo = todo & ~found
        slot = tl.where(todo, (slot + 1) & mask, slot)


@triton.jit(do_not_specialize=["n_rows", "mask"])
def row_match_kernel(
    bits_ptr, tab_ptr, key_ptr, dup_ptr, lit_ptr, n_rows, mask,
    DIM: tl.constexpr, ROWS: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """Each row's first row of its key (from the table ``row_insert_kernel`` filled):
    dup[row] = that row where the bits are equal (and it is another row), else -1;
    lit[row] = whether the row is coded."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mr = r < n_rows
    key = tl.load(key_ptr + r, mask=mr, other=-1)
    slot = _slot(key, mask)
    todo = mr & (key >= 0)
    first = r
    probes = tl.full([], 0, tl.int64)  # a key not found (never, if inserted) ends as literal
    while (tl.max(todo.to(tl.int32), axis=0) > 0) & (probes <= mask):
        probes += 1
        held = tl.load(tab_ptr + slot, mask=todo, other=0)
        found = todo & (held == key + 1)
        best = tl.load(tab_ptr + mask + 1 + slot, mask=found, other=0)
        first = tl.where(found, n_rows - best, first)
        todo = todo & ~found
        slot = tl.where(todo, (slot + 1) & mask, slot)
    diff = tl.zeros([ROWS], dtype=tl.int32)
    for d0 in tl.static_range(0, DIM, DB):
        d = d0 + tl.arange(0, DB)
        m = mr[:, None] & (d < DIM)[None, :]
        va = tl.load(bits_ptr + r[:, None] * DIM + d[None, :], mask=m, other=0)
        vb = tl.load(bits_ptr + first[:, None] * DIM + d[None, :], mask=m, other=0)
        diff += tl.sum((va != vb).to(tl.int32), axis=1)
    same = (diff == 0) & (first != r)
    tl.store(dup_ptr + r, tl.where(same, first, -1), mask=mr)
    tl.store(lit_ptr + r, (~same).to(tl.int32), mask=mr)


@triton.jit(do_not_specialize=["n_rows"])
def encode_rows_kernel(
    dup_ptr, lit_ptr, cz_ptr, rgroup_ptr, rfirst_ptr, rslot_ptr, row0_ptr, npad_ptr,
    map_ptr, refs_ptr, nlit_ptr, n_rows, B: tl.constexpr,
):  # fmt: skip
    """Literal row r goes to slot row0 + rank (map[slot] = r); a duplicate's reference is
    its target's rank within the segment + 1; each group's last row writes its literal
    count."""
    r = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mr = r < n_rows
    g = tl.load(rgroup_ptr + r, mask=mr, other=0)
    rank, before, r0, lit = literal_ranks(r, mr, g, lit_ptr, cz_ptr, row0_ptr)
    tl.store(map_ptr + r0 + rank, r, mask=mr & (lit != 0))
    rep = tl.load(dup_ptr + r, mask=mr, other=0)
    rf = tl.load(rfirst_ptr + r, mask=mr, other=0)
    rank_rep = tl.load(cz_ptr + rep, mask=mr & (lit == 0), other=1) - 1
    rank_f = tl.load(cz_ptr + rf, mask=mr, other=0) - tl.load(lit_ptr + rf, mask=mr, other=0)
    ref = tl.where(lit != 0, 0, rank_rep - rank_f + 1)
    tl.store(refs_ptr + tl.load(rslot_ptr + r, mask=mr, other=0), ref.to(tl.int32), mask=mr)
    last = r == r0 + tl.load(npad_ptr + g, mask=mr, other=0) - 1
    tl.store(nlit_ptr + g, (tl.load(cz_ptr + r, mask=mr, other=0) - before).to(tl.int64),
             mask=mr & last)  # fmt: skip


# ---- encoding ---------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n"])
def quantize_kernel(
    x_ptr, map_ptr, seg_ptr, ebs_ptr, zz_ptr, w_ptr, size_ptr, rgroup_ptr, bs_ptr, nrb_ptr,
    row0_ptr, n, qmax, DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Zig-zagged codes of the code stream (slot s holds row map[s] of x, float32; -1: a
    zero row; bound ebs[segment of the row], 1.0 for pad rows), and each code block's
    width and byte size at its place among its group's blocks."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = tl.load(map_ptr + offs // DIM, mask=m, other=-1)
    m2 = m & (row >= 0)
    x = tl.load(x_ptr + row * DIM + offs % DIM, mask=m2, other=0.0).to(tl.float64)
    seg = tl.load(seg_ptr + row, mask=m2, other=-1)
    eb = tl.load(ebs_ptr + seg, mask=m2 & (seg >= 0), other=1.0)
    step = eb * 2.0
    qf = tl.floor(x / step + 0.5)
    ok = tl.abs(qf) <= qmax
    prod = tl.where(ok, qf * step, 0.0)
    ok = ok & (tl.abs(prod) <= F32_MAX)  # beyond it float32 holds no reconstruction
    qf = tl.where(ok, qf, 0.0)
    y = tl.where(ok, prod, 0.0).to(tl.float32).to(tl.float64)
    ok = ok & (tl.abs(x - y) <= eb)
    q = qf.to(tl.int32)
    zz = tl.where(ok, (q << 1) ^ (q >> 31), 0)
    tl.store(zz_ptr + offs, zz, mask=m)
    nb: tl.constexpr = BLOCK // LANES
    v = tl.reshape(zz.to(tl.uint32), (nb, LANES))
    missed = tl.max(tl.reshape((~ok).to(tl.int32), (nb, LANES)), axis=1) != 0
    w = _width(v, missed)
    c = tl.program_id(0).to(tl.int64) * nb + tl.arange(0, nb)
    mc = c * LANES < n
    g = tl.load(rgroup_ptr + (c * LANES) // DIM, mask=mc, other=0)
    c0 = tl.load(row0_ptr + g, mask=mc, other=0) * DIM // LANES
    b = tl.load(bs_ptr + g, mask=mc, other=0) + tl.load(nrb_ptr + g, mask=mc, other=0) + c - c0
    tl.store(w_ptr + b, w.to(tl.uint8), mask=mc)
    tl.store(size_ptr + b, block_size(w).to(tl.int64), mask=mc)


@triton.jit(do_not_specialize=["n_ref"])
def ref_widths_kernel(refs_ptr, refg_ptr, rb0_ptr, bs_ptr, w_ptr, size_ptr, n_ref,
                      B: tl.constexpr):  # fmt: skip
    """Width and byte size of each reference block, at its place among its group's."""
    rb = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = rb < n_ref
    lane = tl.arange(0, LANES)
    v = tl.load(refs_ptr + rb[:, None] * LANES + lane[None, :], mask=m[:, None], other=0)
    w = _width(v.to(tl.uint32), rb < 0)
    g = tl.load(refg_ptr + rb, mask=m, other=0)
    b = tl.load(bs_ptr + g, mask=m, other=0) + rb - tl.load(rb0_ptr + g, mask=m, other=0)
    tl.store(w_ptr + b, w.to(tl.uint8), mask=m)
    tl.store(size_ptr + b, block_size(w).to(tl.int64), mask=m)


@triton.jit(do_not_specialize=["nb"])
def pack_kernel(
    bgid_ptr, bs_ptr, base_ptr, wat_ptr, nrb_ptr, lit_ptr, rb0_ptr, row0_ptr,
    w_ptr, size_ptr, cs_ptr, zz_ptr, refs_ptr, xbits_ptr, map_ptr, out8_ptr, out32_ptr,
    ck_ptr, nb, DIM: tl.constexpr, B: tl.constexpr,
):  # fmt: skip
    """Each block's planes, or its raw words (float32 bits, or the references), at its
    byte offset; the width nibbles; the checksum parts of both, added per group."""
    b = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mb = b < nb
    g, local, nrb, nbl, base, start = group_of_block(b, mb, bgid_ptr, bs_ptr, base_ptr,
                                                      wat_ptr, nrb_ptr, lit_ptr, DIM)  # fmt: skip
    mb = mb & (local < nbl)
    w = tl.load(w_ptr + b, mask=mb, other=0).to(tl.int32)
    off = block_offset(b, mb, g, start, cs_ptr, size_ptr, bs_ptr)
    # The width nibbles: byte local // 2 of the widths, from the block pair (2k, 2k + 1).
    even = mb & (local % 2 == 0)
    hi = tl.load(w_ptr + b + 1, mask=even & (local + 1 < nbl), other=0).to(tl.int32)
    nib = w | (hi << 4)
    q = tl.load(wat_ptr + g, mask=mb, other=0) + local // 2
    tl.store(out8_ptr + base + q, nib.to(tl.uint8), mask=even)
    part = tl.where(even, byte_hash(nib, q), 0)
    # The values.
    lane = tl.arange(0, LANES)
    is_ref = local < nrb
    rb = tl.load(rb0_ptr + g, mask=mb, other=0) + local
    c = tl.load(row0_ptr + g, mask=mb, other=0) * DIM // LANES + local - nrb
    rv = tl.load(refs_ptr + rb[:, None] * LANES + lane[None, :], mask=(mb & is_ref)[:, None],
                 other=0)  # fmt: skip
    e = c[:, None] * LANES + lane[None, :]
    cv = tl.load(zz_ptr + e, mask=(mb & ~is_ref)[:, None], other=0)
    v = tl.where(is_ref[:, None], rv, cv).to(tl.uint32)
    raw = w == RAW
    word0 = off // 4
    i0 = ((off - base - 8) // 4).to(tl.uint32)
    packed = mb & ~raw & (w > 0)
    # Plane after plane, up to the program's widest block.
    wmax = tl.max(tl.where(packed, w, 0), axis=0)
    j = wmax * 0
    while j < wmax:
        ju = j.to(tl.uint32)
        plane = tl.sum(((v >> ju) & 1) << lane[None, :].to(tl.uint32), axis=1)
        plane = plane.to(tl.uint32)
        keep = packed & (j < w)
        tl.store(out32_ptr + word0 + j, plane.to(tl.int32, bitcast=True), mask=keep)
        part += tl.where(keep, plane * (2 * (i0 + ju) + 1), 0)
        j += 1
    rm = (mb & raw)[:, None]
    row = tl.load(map_ptr + e // DIM, mask=rm & ~is_ref[:, None], other=-1)
    xb = tl.load(xbits_ptr + row * DIM + e % DIM, mask=rm & (row >= 0), other=0)
    xu = tl.where(is_ref[:, None], v, xb.to(tl.uint32, bitcast=True))
    tl.store(out32_ptr + word0[:, None] + lane[None, :], xu.to(tl.int32, bitcast=True), mask=rm)
    part += tl.sum(tl.where(rm, xu * (2 * (i0[:, None] + lane[None, :]) + 1), 0), axis=1)
    add_per_group(ck_ptr, g, part, mb)


@triton.jit
def head_kernel(
    base_ptr, wat_ptr, fat_ptr, ebat_ptr, nrb_ptr, bs_ptr, nbmax_ptr, k_ptr, seg0_ptr,
    hfix_ptr, lit_ptr, cs_ptr, size_ptr, ebs_ptr, ck_ptr, out8_ptr, out32_ptr, used_ptr,
    DIM: tl.constexpr,
):  # fmt: skip
    """Group g's header fields (L, data_len), bounds, the zeros after its widths, its
    checksum (the header's fixed words' share comes from the plan) and used length."""
    g = tl.program_id(0)
    base = tl.load(base_ptr + g)
    lit = tl.load(lit_ptr + g)
    wat = tl.load(wat_ptr + g)
    nbl, data_at, dlen = group_extent(g, lit, wat, nrb_ptr, bs_ptr, nbmax_ptr, cs_ptr,
                                      size_ptr, DIM)  # fmt: skip
    fat = tl.load(fat_ptr + g) + 20
    i_l = ((fat - 8) // 4).to(tl.uint32)
    ck = tl.load(hfix_ptr + g).to(tl.uint32)
    ck += lit.to(tl.uint32) * (2 * i_l + 1) + dlen.to(tl.uint32) * (2 * i_l + 3)
    tl.store(out32_ptr + (base + fat) // 4, lit.to(tl.int32))
    tl.store(out32_ptr + (base + fat) // 4 + 1, dlen.to(tl.int32))
    pad = wat + (nbl + 1) // 2 + tl.arange(0, 4)
    tl.store(out8_ptr + base + pad, tl.zeros([4], dtype=tl.uint8), mask=pad < data_at)
    ck += copy_bounds(g, base, ebat_ptr, k_ptr, seg0_ptr, ebs_ptr, out32_ptr, True)
    ck += tl.load(ck_ptr + g).to(tl.uint32, bitcast=True)
    tl.store(out32_ptr + base // 4 + 1, ck.to(tl.int32, bitcast=True))
    tl.store(used_ptr + g, data_at + dlen)


# ---- plans ---------------------------------------------------------------------------------
@triton.jit
def _last_at_most(starts_ptr, n, x, steps, mask):
    """Per lane, the last j < n with starts[j] <= x (starts ascending, starts[0] <= x):
    ``steps`` >= n.bit_length() halvings."""
    lo = tl.zeros(x.shape, dtype=tl.int64)
    hi = tl.zeros(x.shape, dtype=tl.int64) + n
    k = steps * 0
    while k < steps:
        mid = (lo + hi) // 2
        take = tl.load(starts_ptr + mid, mask=mask, other=0) <= x
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
        k += 1
    return lo


@triton.jit(do_not_specialize=["rows", "n_pieces", "g", "n_blocks", "n_ref", "p_steps", "g_steps"])
def plan_kernel(
    pfirst_ptr, pseg_ptr, row0_ptr, rb0_ptr, bs_ptr, arange_ptr, rgroup_ptr, rseg_ptr,
    rfirst_ptr, rslot_ptr, bgid_ptr, refg_ptr, rows, n_pieces, g, n_blocks, n_ref, p_steps,
    g_steps, B: tl.constexpr,
):  # fmt: skip
    """A plan's indices (:func:`recsz.codecs.blockplan.build`) from its pieces' and groups'
    first rows and blocks, for index i of each space: row i's own index, group, segment
    (-1: pad), its piece's first row and its reference slot; block i's group; reference
    block i's group. Pieces and groups tile their spaces in order, so each is found by a
    binary search of the firsts (an empty one shares its successor's first)."""
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mr = i < rows
    p = _last_at_most(pfirst_ptr, n_pieces, i, p_steps, mr)
    gr = _last_at_most(row0_ptr, g, i, g_steps, mr)
    tl.store(arange_ptr + i, i, mask=mr)
    tl.store(rgroup_ptr + i, gr.to(tl.int32), mask=mr)
    tl.store(rseg_ptr + i, tl.load(pseg_ptr + p, mask=mr, other=0).to(tl.int32), mask=mr)
    tl.store(rfirst_ptr + i, tl.load(pfirst_ptr + p, mask=mr, other=0), mask=mr)
    first = tl.load(row0_ptr + gr, mask=mr, other=0)
    tl.store(rslot_ptr + i, tl.load(rb0_ptr + gr, mask=mr, other=0) * LANES + i - first, mask=mr)
    mb = i < n_blocks
    tl.store(bgid_ptr + i, _last_at_most(bs_ptr, g, i, g_steps, mb).to(tl.int32), mask=mb)
    mf = i < n_ref
    tl.store(refg_ptr + i, _last_at_most(rb0_ptr, g, i, g_steps, mf).to(tl.int32), mask=mf)


# ---- format 4 -----------------------------------------------------------------------------
@triton.jit
def word_sum_kernel(words_ptr, first_ptr, len_ptr, out_ptr, CHUNK: tl.constexpr):
    """The checksum share of words [c CHUNK, (c + 1) CHUNK) of span g (words first[g] +
    i, each times 2i + 1), added to out[g]."""
    g = tl.program_id(1)
    c = tl.program_id(0).to(tl.int64) * CHUNK
    i = c + tl.arange(0, CHUNK)
    n = tl.load(len_ptr + g)
    m = i < n
    v = tl.load(words_ptr + tl.load(first_ptr + g) + i, mask=m, other=0)
    v = v.to(tl.uint32, bitcast=True)
    s = tl.sum(tl.where(m, v * (2 * i.to(tl.uint32) + 1), 0), axis=0).to(tl.uint32)
    tl.atomic_add(out_ptr + g, s.to(tl.int32, bitcast=True), mask=c < n)
