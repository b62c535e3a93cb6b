"""Triton kernels of the format-3 block coder that read payloads: headers, widths, blocks,
references, rows, and one verdict per payload (:mod:`recsz.codecs.blocklayout` names the
index spaces, :mod:`recsz.codecs.blockkernels` makes the payloads). They run on a GPU, and
on the CPU under ``TRITON_INTERPRET=1``, where CI checks them against the CPU coder
(:mod:`recsz.codecs.blockcpu`)."""

from __future__ import annotations

import triton
import triton.language as tl

from recsz.codecs import blocklayout as lay


@triton.jit(do_not_specialize=["n_bytes"])
def read_head_kernel(
    buf_ptr, words_ptr, n_bytes, base_ptr, fat_ptr, ebat_ptr, npad_ptr, nrb_ptr, wat_ptr,
    k_ptr, seg0_ptr, ipos_ptr, ival_ptr, ibounds_ptr, lit_ptr, dlen_ptr, ebs_ptr, ck_ptr,
    bad_ptr, DIM: tl.constexpr,
):  # fmt: skip
    """Group g's header: the bytes the shapes fix compared, L and data_len read (L beyond
    the rows is flagged), the bounds copied out, the header words' checksum share."""
    g = tl.program_id(0)
    base = tl.load(base_ptr + g)
    wrong = tl.zeros([64], dtype=tl.int32)
    at = tl.load(ibounds_ptr + g)
    stop = tl.load(ibounds_ptr + g + 1)
    while at < stop:
        i = at + tl.arange(0, 64)
        m = i < stop
        pos = base + tl.load(ipos_ptr + i, mask=m, other=0)  # (the decoder's: relative)
        got = tl.load(buf_ptr + pos, mask=m & (pos < n_bytes), other=0)
        want = tl.load(ival_ptr + i, mask=m, other=0)
        wrong += (m & ((got != want) | (pos >= n_bytes))).to(tl.int32)
        at += 64
    fat = tl.load(fat_ptr + g) + 20
    stated = tl.load(words_ptr + (base + fat) // 4).to(tl.uint32, bitcast=True).to(tl.int64)
    npad = tl.load(npad_ptr + g)
    lit = tl.minimum(stated, npad)
    tl.store(lit_ptr + g, lit)
    tl.store(dlen_ptr + g, tl.load(words_ptr + (base + fat) // 4 + 1).to(tl.uint32, bitcast=True)
             .to(tl.int64))  # fmt: skip
    lay.copy_bounds(g, base, ebat_ptr, k_ptr, seg0_ptr, ebs_ptr, words_ptr, False)
    # Header words [8, widths_at): the fixed ones, L and data_len, the bounds.
    ck = tl.zeros([64], dtype=tl.uint32)
    i = 0
    n_head = (tl.load(wat_ptr + g) - 8) // 4
    while i < n_head:
        j = i + tl.arange(0, 64)
        mj = j < n_head
        v = tl.load(words_ptr + base // 4 + 2 + j, mask=mj, other=0).to(tl.uint32, bitcast=True)
        ck += tl.where(mj, v * (2 * j.to(tl.uint32) + 1), 0)
        i += 64
    tl.store(ck_ptr + g, tl.sum(ck, axis=0).to(tl.int32, bitcast=True))
    tl.store(bad_ptr + g, tl.sum(wrong, axis=0) + (stated > npad).to(tl.int32))


@triton.jit(do_not_specialize=["n_bytes", "nb"])
def read_widths_kernel(
    buf_ptr, n_bytes, bgid_ptr, bs_ptr, base_ptr, wat_ptr, nrb_ptr, lit_ptr, w_ptr,
    size_ptr, ck_ptr, nb, DIM: tl.constexpr, B: tl.constexpr,
):  # fmt: skip
    """Each block's width (0 past its group's blocks) and byte size; the checksum parts of
    the width bytes and the zeros after them."""
    b = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mb = b < nb
    g, local, _, nbl, base, start = lay.group_of_block(b, mb, bgid_ptr, bs_ptr, base_ptr,
                                                    wat_ptr, nrb_ptr, lit_ptr, DIM)  # fmt: skip
    q = tl.load(wat_ptr + g, mask=mb, other=0) + local // 2
    mine = mb & (local < nbl)
    byte = tl.load(buf_ptr + base + q, mask=mine & (base + q < n_bytes), other=0).to(tl.int32)
    w = tl.where(mine, (byte >> (4 * (local % 2))) & 15, 0)
    tl.store(w_ptr + b, w.to(tl.uint8), mask=mb)
    tl.store(size_ptr + b, lay.block_size(w).to(tl.int64), mask=mb)
    part = tl.where(mine & (local % 2 == 0), lay.byte_hash(byte, q), 0)
    last = mine & (local == nbl - 1)  # the zeros up to the data (their share, if damaged)
    for k in tl.static_range(4):
        p = q + 1 + k
        mp = last & (p < start - base)
        z = tl.load(buf_ptr + base + p, mask=mp & (base + p < n_bytes), other=0)
        part += tl.where(mp, lay.byte_hash(z, p), 0)
    lay.add_per_group(ck_ptr, g, part, mb)


@triton.jit(do_not_specialize=["n_words", "nb"])
def unpack_kernel(
    bgid_ptr, bs_ptr, base_ptr, wat_ptr, nrb_ptr, lit_ptr, rb0_ptr, row0_ptr, refg_ptr,
    w_ptr, size_ptr, cs_ptr, in32_ptr, n_words, seg_ptr, ebs_ptr, out_ptr, refs_ptr, ck_ptr,
    nb, DIM: tl.constexpr, B: tl.constexpr, REFS: tl.constexpr,
):  # fmt: skip
    """Decode blocks: the nb blocks' code blocks into the code stream (dequantized under
    the bound of each slot's segment, or raw words as they are), or, ``REFS``, the nb
    reference blocks into the references. Adds their words' checksum parts."""
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mi = i < nb
    if REFS:  # reference block i, at its place among its group's blocks
        rg = tl.load(refg_ptr + i, mask=mi, other=0)
        b = tl.load(bs_ptr + rg, mask=mi, other=0) + i - tl.load(rb0_ptr + rg, mask=mi, other=0)
    else:
        b = i
    g, local, nrb, _, base, start = lay.group_of_block(b, mi, bgid_ptr, bs_ptr, base_ptr,
                                                    wat_ptr, nrb_ptr, lit_ptr, DIM)  # fmt: skip
    is_ref = local < nrb
    mb = mi & (is_ref == REFS)
    w = tl.load(w_ptr + b, mask=mb, other=0).to(tl.int32)
    off = lay.block_offset(b, mb, g, start, cs_ptr, size_ptr, bs_ptr)
    lane = tl.arange(0, lay.LANES)
    if REFS:  # where the values go: the reference stream, or the code stream
        at = (tl.load(rb0_ptr + g, mask=mb, other=0) + local)[:, None] * lay.LANES + lane[None, :]
    else:
        c = tl.load(row0_ptr + g, mask=mb, other=0) * DIM // lay.LANES + local - nrb
        at = c[:, None] * lay.LANES + lane[None, :]
    raw = w == lay.RAW
    word0 = off // 4
    i0 = ((off - base - 8) // 4).to(tl.uint32)
    v = tl.zeros([B, lay.LANES], dtype=tl.uint32)
    part = tl.zeros([B], dtype=tl.uint32)
    packed = mb & ~raw & (w > 0)
    # Plane after plane, up to the program's widest block.
    wmax = tl.max(tl.where(packed, w, 0), axis=0)
    j = wmax * 0
    while j < wmax:
        ju = j.to(tl.uint32)
        wj = word0 + j
        keep = packed & (j < w) & (wj < n_words)
        plane = tl.load(in32_ptr + wj, mask=keep, other=0).to(tl.uint32, bitcast=True)
        v |= ((plane[:, None] >> lane[None, :].to(tl.uint32)) & 1) << ju
        part += tl.where(keep, plane * (2 * (i0 + ju) + 1), 0)
        j += 1
    ra = word0[:, None] + lane[None, :]
    rm = (mb & raw)[:, None] & (ra < n_words)
    xu = tl.load(in32_ptr + ra, mask=rm, other=0).to(tl.uint32, bitcast=True)
    part += tl.sum(tl.where(rm, xu * (2 * (i0[:, None] + lane[None, :]) + 1), 0), axis=1)
    lay.add_per_group(ck_ptr, g, part, mb)
    v = tl.where(raw[:, None], xu, v)
    zi = v.to(tl.int32, bitcast=True)
    if REFS:
        tl.store(refs_ptr + at, zi, mask=mb[:, None])
    else:
        q = (zi >> 1) ^ -(zi & 1)
        seg = tl.load(seg_ptr + at // DIM, mask=mb[:, None], other=-1)
        eb = tl.load(ebs_ptr + seg, mask=mb[:, None] & (seg >= 0), other=1.0)
        # Clamped: a valid payload never needs it; a damaged one must not overflow (its
        # checksum fails).
        y = tl.minimum(tl.maximum(q.to(tl.float64) * (eb * 2.0), -lay.F32_MAX), lay.F32_MAX)
        y = tl.where(raw[:, None], xu.to(tl.float32, bitcast=True), y.to(tl.float32))
        tl.store(out_ptr + at, y, mask=mb[:, None])


@triton.jit(do_not_specialize=["n_rows"])
def decode_rows_kernel(
    refs_ptr, lit_ptr, cz_ptr, rgroup_ptr, rfirst_ptr, rslot_ptr, rseg_ptr, row0_ptr,
    npad_ptr, nlit_ptr, src_ptr, slotseg_ptr, bad_ptr, n_rows, B: tl.constexpr,
):  # fmt: skip
    """Each row's slot (its own if literal, else its reference's target: references that
    point at no earlier literal row are flagged), each literal slot's segment, and the
    literal count checked against the header's."""
    r = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mr = r < n_rows
    g = tl.load(rgroup_ptr + r, mask=mr, other=0)
    rank, before, r0, lit = lay.literal_ranks(r, mr, g, lit_ptr, cz_ptr, row0_ptr)
    npad = tl.load(npad_ptr + g, mask=mr, other=1)
    ref = tl.load(refs_ptr + tl.load(rslot_ptr + r, mask=mr, other=0), mask=mr, other=0)
    rf = tl.load(rfirst_ptr + r, mask=mr, other=0)
    rank_f = tl.load(cz_ptr + rf, mask=mr, other=0) - tl.load(lit_ptr + rf, mask=mr, other=0)
    want = rank_f - before + ref.to(tl.int64) - 1
    wrong = mr & (lit == 0) & ((ref < 0) | (want >= rank))
    want = tl.minimum(tl.where(wrong, 0, want), npad - 1)
    tl.store(src_ptr + r, r0 + tl.where(lit != 0, rank, want), mask=mr)
    tl.store(slotseg_ptr + r0 + rank, tl.load(rseg_ptr + r, mask=mr, other=-1),
             mask=mr & (lit != 0))  # fmt: skip
    last = mr & (r == r0 + npad - 1)
    count = tl.load(cz_ptr + r, mask=mr, other=0) - before
    bad = wrong | (last & (count != tl.load(nlit_ptr + g, mask=mr, other=0)))
    lay.add_per_group(bad_ptr, g, bad.to(tl.int32), mr)


@triton.jit(do_not_specialize=["n_rows"])
def literal_kernel(refs_ptr, rslot_ptr, lit_ptr, n_rows, B: tl.constexpr):
    """lit[r] = whether row r's reference is 0 (it is coded)."""
    r = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mr = r < n_rows
    ref = tl.load(refs_ptr + tl.load(rslot_ptr + r, mask=mr, other=0), mask=mr, other=0)
    tl.store(lit_ptr + r, (ref == 0).to(tl.int32), mask=mr)


@triton.jit(do_not_specialize=["n_rows"])
def gather_rows_kernel(y_ptr, src_ptr, out_ptr, n_rows, DIM: tl.constexpr,
                       ROWS: tl.constexpr, DB: tl.constexpr):  # fmt: skip
    """out[r] = y[src[r]] (rows of DIM float32)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mr = r < n_rows
    s = tl.load(src_ptr + r, mask=mr, other=0)
    for d0 in tl.static_range(0, DIM, DB):
        d = d0 + tl.arange(0, DB)
        m = mr[:, None] & (d < DIM)[None, :]
        v = tl.load(y_ptr + s[:, None] * DIM + d[None, :], mask=m, other=0.0)
        tl.store(out_ptr + r[:, None] * DIM + d[None, :], v, mask=m)


@triton.jit
def verdict_kernel(
    words_ptr, base_ptr, end_ptr, wat_ptr, nrb_ptr, bs_ptr, nbmax_ptr, lit_ptr, dlen_ptr,
    cs_ptr, size_ptr, ck_ptr, bad_ptr, ok_ptr, DIM: tl.constexpr,
):  # fmt: skip
    """ok[g]: no check flagged group g, its blocks fill its stated data length inside the
    payload, and its checksum matches."""
    g = tl.program_id(0)
    base = tl.load(base_ptr + g)
    _, data_at, dlen = lay.group_extent(g, tl.load(lit_ptr + g), tl.load(wat_ptr + g), nrb_ptr,
                                    bs_ptr, nbmax_ptr, cs_ptr, size_ptr, DIM)  # fmt: skip
    stored = tl.load(words_ptr + base // 4 + 1)
    good = (tl.load(bad_ptr + g) == 0) & (dlen == tl.load(dlen_ptr + g))
    good = good & (base + data_at + dlen <= tl.load(end_ptr + g))
    good = good & (tl.load(ck_ptr + g) == stored)
    tl.store(ok_ptr + g, good.to(tl.int8))
