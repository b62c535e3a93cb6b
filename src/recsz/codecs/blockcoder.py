"""Format-3 payloads made and read where the tensors live, by a few Triton kernels and
torch operations, with no host synchronization (:mod:`recsz.codecs.blockformat` defines
the bytes and codes them with numpy on the CPU; CI runs these kernels under
``TRITON_INTERPRET=1`` and compares).

One call codes G groups (e.g. one per destination rank, each holding several tables) into
one buffer, each payload at a place fixed by the shapes alone (its capacity: no row
deduplicated, every block raw), so nothing waits for sizes. Encoding: row dedup by hash,
stable sort and bitwise check (torch), literal rows compacted, one quantize launch, one
width launch, a prefix sum, the widths packed, one pack launch, header fields written by
index. The used sizes come back as a device tensor; a caller that sends the payloads
reads it once (``trim``). Decoding is the inverse: widths, prefix sum, one unpack launch,
one row gather; the checks (header, lengths, references, checksum) become one device flag
per payload, read once by :func:`check` where the caller wants a PayloadError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton

from recsz.codecs import blockformat as bf
from recsz.codecs.blockkernels import pack_kernel, quantize_kernel, unpack_kernel, widths_kernel
from recsz.codecs.blocks import upload as _upload
from recsz.codecs.payload import MAGIC, PayloadError

ELEMS = 2048  # elements per quantize program
BLOCKS = 64  # blocks per width / pack / unpack program
_MASK32 = 0xFFFFFFFF
_pad1 = torch.nn.functional.pad

# meta columns, one value per group
_NRB, _NB, _CB0, _RB0, _BS, _BASE, _WAT, _ROW0, _NPAD, _EBAT, _FAT = range(11)
_COLS = 11


@dataclass
class _Plan:
    """Host-side arithmetic of one call: every group's place and counts, uploaded once."""

    lays: list[bf.Layout]
    base: list[int]  # each payload's first byte in the buffer
    meta: torch.Tensor  # int64 on the device: the columns above, G each, then the pieces'
    # row counts and bound indices
    dev: torch.device

    @property
    def g(self) -> int:
        return len(self.lays)

    def col(self, i: int) -> torch.Tensor:
        return self.meta[i * self.g : (i + 1) * self.g]

    @property
    def pieces(self) -> int:
        return sum(len(lay.seg_rows) + 1 for lay in self.lays)

    @property
    def counts(self) -> torch.Tensor:  # rows of each piece: segments, then the pad rows
        return self.meta[_COLS * self.g : _COLS * self.g + self.pieces]

    @property
    def ext(self) -> torch.Tensor:  # bound index of each piece (S: the pad rows' 1.0)
        o = _COLS * self.g + self.pieces
        return self.meta[o : o + self.pieces]

    @property
    def rows(self) -> int:
        return sum(lay.padded for lay in self.lays)

    @property
    def blocks(self) -> int:
        return sum(lay.max_blocks for lay in self.lays)

    @property
    def ref_blocks(self) -> int:
        return sum(lay.ref_blocks for lay in self.lays)

    @property
    def dedup(self) -> bool:
        return self.lays[0].dedup


def _plan(lays: list[bf.Layout], base: list[int], dev: torch.device) -> _Plan:
    cols = np.zeros((_COLS, len(lays)), np.int64)
    row0 = cb0 = rb0 = bs = 0
    counts, ext = [], []
    s = sum(len(lay.seg_rows) for lay in lays)
    for i, lay in enumerate(lays):
        cols[:, i] = [lay.ref_blocks, lay.max_blocks, cb0, rb0, bs, base[i], lay.widths_at,
                      row0, lay.padded, lay.eb_at, lay.fields_at]  # fmt: skip
        row0 += lay.padded
        cb0 += lay.code_blocks(lay.padded)
        rb0 += lay.ref_blocks
        bs += lay.max_blocks
        counts += [*lay.seg_rows, lay.padded - lay.rows]
        ext += [*range(len(ext) - i, len(ext) - i + len(lay.seg_rows)), s]
    meta = _upload(np.concatenate([cols.reshape(-1), counts, ext]), torch.int64, dev)
    return _Plan(lays, base, meta, dev)


def _ranges(starts: torch.Tensor, lens: Sequence[int], dev: torch.device) -> torch.Tensor:
    """Concatenated aranges starts[g] + [0, lens[g]) on the device (lens known here)."""
    total = int(sum(lens))
    lt = _upload(lens, torch.int64, dev)
    shift = starts - (torch.cumsum(lt, 0) - lt)
    return torch.arange(total, device=dev) + torch.repeat_interleave(shift, lt, output_size=total)


def _group_of(lens: torch.Tensor, total: int) -> torch.Tensor:
    ids = torch.arange(lens.numel(), device=lens.device)
    return torch.repeat_interleave(ids, lens, output_size=total)


@dataclass
class _Rows:
    """Per padded row: its piece, group, index in its group, and its piece's first row."""

    piece: torch.Tensor
    group: torch.Tensor
    local: torch.Tensor
    first: torch.Tensor


def _rows(p: _Plan) -> _Rows:
    r = torch.arange(p.rows, device=p.dev)
    piece = _group_of(p.counts, p.rows)
    group = _group_of(p.col(_NPAD), p.rows)
    first = (torch.cumsum(p.counts, 0) - p.counts)[piece]
    return _Rows(piece, group, r - p.col(_ROW0)[group], first)


def _literal_rank(p: _Plan, lit: torch.Tensor, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's rank among its group's literal rows, and each group's literal count."""
    cz = _pad1(torch.cumsum(lit.to(torch.int64), 0), (1, 0))
    r0 = p.col(_ROW0)
    return cz[:-1] - cz[r0][rows.group], cz[r0 + p.col(_NPAD)] - cz[r0]


def _blocks(p: _Plan, literal: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Payload order (reference blocks, then code blocks, per group): source map, group,
    index in group, and each group's block count and data start."""
    gid = _group_of(p.col(_NB), p.blocks)
    local = torch.arange(p.blocks, device=p.dev) - p.col(_BS)[gid]
    nrb = p.col(_NRB)[gid]
    src = torch.where(local < nrb, -(p.col(_RB0)[gid] + local) - 1, p.col(_CB0)[gid] + local - nrb)
    dim = p.lays[0].dim
    n_blocks = p.col(_NRB) + (literal * dim + bf.LANES - 1) // bf.LANES
    data_at = p.col(_WAT) + ((n_blocks + 1) // 2 + 3) // 4 * 4
    return src, gid, local, n_blocks, data_at


def _offsets(p: _Plan, w: torch.Tensor, gid: torch.Tensor, data_at: torch.Tensor) -> tuple:
    """Byte offset of every block, and each group's data length."""
    size = torch.where(w == bf.RAW, 4 * bf.LANES, 4 * w.to(torch.int64))
    cz = _pad1(torch.cumsum(size, 0), (1, 0))
    start = cz[p.col(_BS)]
    data_len = cz[p.col(_BS) + p.col(_NB)] - start
    off = cz[:-1] - start[gid] + (p.col(_BASE) + data_at)[gid]
    return off, data_len


def _width_bytes(p: _Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions of every group's width bytes (its capacity), their group, their index."""
    lens = [lay.data_at(lay.padded) - lay.widths_at for lay in p.lays]  # with the zero pad
    pos = _ranges(p.col(_BASE) + p.col(_WAT), lens, p.dev)
    g = _group_of(_upload(lens, torch.int64, p.dev), pos.numel())
    return pos, g, pos - (p.col(_BASE) + p.col(_WAT))[g]


def _head_hash(p: _Plan, words: torch.Tensor, data_at: torch.Tensor) -> torch.Tensor:
    """Checksum share of each payload's words from byte 8 to its data (header, widths)."""
    lens = [(lay.data_at(lay.padded) - 8) // 4 for lay in p.lays]
    first = (p.col(_BASE) + 8) // 4
    idx = _ranges(first, lens, p.dev)
    g = _group_of(_upload(lens, torch.int64, p.dev), idx.numel())
    i = idx - first[g]
    keep = i < (data_at[g] - 8) // 4
    v = (words[idx.clamp(max=words.numel() - 1)].to(torch.int64) & _MASK32) * (2 * i + 1)
    return torch.zeros(p.g, dtype=torch.int64, device=p.dev).index_add_(0, g, v * keep)


def _part_hash(p: _Plan, parts: torch.Tensor) -> torch.Tensor:
    cz = _pad1(torch.cumsum(parts.to(torch.int64) & _MASK32, 0), (1, 0))
    return cz[p.col(_BS) + p.col(_NB)] - cz[p.col(_BS)]


def _u32(v: torch.Tensor) -> torch.Tensor:
    """Values modulo 2^32 as int32 (their bytes are the u32's)."""
    v = v & _MASK32
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def _image(p: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """Positions and bytes of what the shapes fix: prefix and header but L and data_len."""
    pos, val = [], []
    for lay, b in zip(p.lays, p.base, strict=True):
        head = np.frombuffer(lay.head(), np.uint8)
        at = lay.fields_at - 8 + bf.L_AT
        keep = np.r_[0:at, at + 8 : head.size]
        pos += [b + np.arange(4), b + 8 + keep]
        val += [np.frombuffer(MAGIC + bytes([bf.FORMAT]), np.uint8), head[keep]]
    return np.concatenate(pos), np.concatenate(val)


def _at(p: _Plan, start: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of n bytes from ``start[g]`` in every group."""
    return _ranges(start, [n] * p.g, p.dev)


def _fields(p: _Plan) -> torch.Tensor:  # L and data_len
    return _at(p, p.col(_BASE) + p.col(_FAT) + bf.L_AT, 8)


def _checksum(p: _Plan) -> torch.Tensor:
    return _at(p, p.col(_BASE) + 4, 4)


def encode(
    lays: list[bf.Layout], xs: list[torch.Tensor], ebs: torch.Tensor
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Code group g's rows ``xs[g]`` (float32, its segments as ``lays[g].seg_rows``) under
    ``ebs`` (one bound per segment, all groups in order, on the device).

    Returns (buffer, each payload's first byte, each payload's used length on the device):
    payload g is ``buffer[base[g] : base[g] + used[g]]``; any longer slice inside its
    capacity decodes the same."""
    dev, dim = xs[0].device, lays[0].dim
    base = np.concatenate([[0], np.cumsum([lay.capacity for lay in lays])]).tolist()
    p = _plan(lays, base[:-1], dev)
    pieces: list[torch.Tensor] = []
    for lay, x in zip(lays, xs, strict=True):
        pieces.append(x.reshape(-1))
        if lay.padded > lay.rows:
            pieces.append(x.new_zeros((lay.padded - lay.rows) * dim))
    x = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(p.rows, dim)
    rows = _rows(p)
    eb_row = torch.cat([ebs.to(torch.float64), ebs.new_ones(1, dtype=torch.float64)])
    eb_row = eb_row[p.ext][rows.piece]
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    if p.dedup:
        rep = _duplicates(p, x.view(torch.int32), rows)
        lit = rep < 0
        rank, literal = _literal_rank(p, lit, rows)
        ref = torch.where(lit, 0, rank[rep.clamp(min=0)] - rank[rows.first] + 1)
        refs[p.col(_RB0)[rows.group] * bf.LANES + rows.local] = ref.to(torch.int32)
        at = torch.where(lit, p.col(_ROW0)[rows.group] + rank, p.rows)  # dups: a spare row
        x = x.new_zeros(p.rows + 1, dim).index_copy_(0, at, x)[:-1]
        eb_row = eb_row.new_ones(p.rows + 1).index_copy_(0, at, eb_row)[:-1]
    else:
        literal = p.col(_NPAD)
    n = x.numel()
    zz = torch.empty(n, dtype=torch.int32, device=dev)
    bad = torch.empty(n, dtype=torch.int8, device=dev)
    if n:
        grid = (triton.cdiv(n, ELEMS),)
        quantize_kernel[grid](x, eb_row, zz, bad, n, dim, bf.QMAX, BLOCK=ELEMS)
    raw = bad.view(-1, bf.LANES).amax(1)
    src, gid, _, n_blocks, data_at = _blocks(p, literal)
    nb = p.blocks
    w = torch.zeros(nb, dtype=torch.uint8, device=dev)
    out = torch.empty(base[-1], dtype=torch.uint8, device=dev)
    parts = torch.zeros(nb, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(nb, BLOCKS),)
    if nb:
        widths_kernel[grid](src, zz, refs, raw, w, nb, B=BLOCKS)
    off, data_len = _offsets(p, w, gid, data_at)
    pos, wg, k = _width_bytes(p)  # written first: the data overwrites their spare tail
    lo = torch.where(2 * k < n_blocks[wg], w[(p.col(_BS)[wg] + 2 * k).clamp(max=nb - 1)], 0)
    hi_i = p.col(_BS)[wg] + 2 * k + 1
    hi = torch.where(2 * k + 1 < n_blocks[wg], w[hi_i.clamp(max=nb - 1)], 0)
    out[pos] = lo | (hi << 4)
    if nb:
        pack_kernel[grid](src, zz, refs, x.view(torch.int32), w, off, p.col(_BASE)[gid],
                          out.view(torch.int32), parts, nb, B=BLOCKS)  # fmt: skip
    ipos, ival = _image(p)
    out[_upload(ipos, torch.int64, dev)] = _upload(ival, torch.uint8, dev)
    out[_eb_positions(p)] = ebs.to(torch.float64).contiguous().view(torch.uint8)
    out[_fields(p)] = torch.stack([_u32(literal), _u32(data_len)], 1).view(torch.uint8).view(-1)
    total = _head_hash(p, out.view(torch.int32), data_at) + _part_hash(p, parts)
    out[_checksum(p)] = _u32(total).view(torch.uint8)
    return out, base[:-1], data_at + data_len


def _eb_positions(p: _Plan) -> torch.Tensor:
    return _ranges(p.col(_BASE) + p.col(_EBAT), [8 * len(lay.seg_rows) for lay in p.lays], p.dev)


def _duplicates(p: _Plan, bits: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """blockformat.duplicates as torch operations on the device."""
    n, dim = bits.shape
    r = torch.arange(n, device=p.dev)
    is_pad = torch.zeros(p.pieces, dtype=torch.bool, device=p.dev)
    is_pad[
        torch.cumsum(_upload([len(lay.seg_rows) + 1 for lay in p.lays], torch.int64, p.dev), 0) - 1
    ] = True
    mult = _upload(bf.HASH_MULT[:dim], torch.int64, p.dev)
    h = (bits.to(torch.int64) * mult).sum(1)
    key = (h & ((1 << bf.HASH_BITS) - 1)) | (rows.piece << bf.HASH_BITS)
    key = torch.where(is_pad[rows.piece], -(r + 1), key)
    ks, perm = torch.sort(key, stable=True)
    start = torch.ones(n, dtype=torch.bool, device=p.dev)
    start[1:] = ks[1:] != ks[:-1]
    rep = perm[torch.cummax(torch.where(start, r, 0), 0).values]
    same = (bits[perm] == bits[rep]).all(1) & ~start
    out = torch.full((n,), -1, dtype=torch.int64, device=p.dev)
    out[perm] = torch.where(same, rep, -1)
    return out


def common_buffer(payloads: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One uint8 buffer holding every payload at a 4-byte aligned offset: their own
    storage when they share one (slices of a received buffer), else a copy."""
    st = payloads[0].untyped_storage()
    offs = [p.storage_offset() for p in payloads]
    if (
        all(p.untyped_storage().data_ptr() == st.data_ptr() and p.is_contiguous() for p in payloads)
        and all(o % 4 == 0 for o in offs)
        and st.nbytes() % 4 == 0
    ):
        buf = torch.empty(0, dtype=torch.uint8, device=payloads[0].device)
        return buf.set_(st, 0, (st.nbytes(),)), offs
    parts, offs, at = [], [], 0
    for q in payloads:
        pad = -q.numel() % 4
        parts += [q.reshape(-1), q.new_zeros(pad)]
        offs.append(at)
        at += q.numel() + pad
    return torch.cat(parts), offs


def read_layouts(payloads: list[torch.Tensor]) -> list[bf.Layout]:
    """The layouts the payloads' headers state (one host copy of their first bytes)."""
    heads = [p[: min(p.numel(), 4096)].reshape(-1) for p in payloads]
    host = torch.cat(heads).cpu().numpy()
    out, at = [], 0
    for p, h in zip(payloads, heads, strict=True):
        chunk = host[at : at + h.numel()]
        at += h.numel()
        lay = bf.read_layout(chunk)[0]
        if lay.widths_at > chunk.size and p.numel() >= lay.widths_at:  # many tables: read on
            lay = bf.read_layout(p[: lay.widths_at].cpu().numpy())[0]
        out.append(lay)
    return out


def decode(
    payloads: list[torch.Tensor], lays: list[bf.Layout]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Rows of each payload (as ``lays`` expects them), the bounds (all segments), and a
    device flag per payload: True where every check passed."""
    dev, dim = payloads[0].device, lays[0].dim
    for i, (q, lay) in enumerate(zip(payloads, lays, strict=True)):
        if q.numel() < lay.widths_at:
            raise PayloadError(f"payload {i}: {q.numel()} bytes, its header needs {lay.widths_at}")
    buf, base = common_buffer(payloads)
    last = buf.numel() - 1
    p = _plan(lays, base, dev)
    rows = _rows(p)
    ipos, ival = _image(p)
    bad = torch.zeros(p.g, dtype=torch.int64, device=dev)
    head_g = np.searchsorted(np.asarray(base), ipos, side="right") - 1
    wrong = buf[_upload(ipos, torch.int64, dev)] != _upload(ival, torch.uint8, dev)
    bad.index_add_(0, _upload(head_g, torch.int64, dev), wrong.to(torch.int64))
    fields = buf[_fields(p)].view(torch.int32).to(torch.int64).view(p.g, 2) & _MASK32
    stated_l, stated_len = fields[:, 0], fields[:, 1]
    bad += stated_l > p.col(_NPAD)
    literal = stated_l.clamp(max=p.col(_NPAD))
    src, gid, local, n_blocks, data_at = _blocks(p, literal)
    wpos = (p.col(_BASE) + p.col(_WAT))[gid] + local // 2
    w = (buf[wpos.clamp(max=last)] >> (4 * (local % 2)).to(torch.uint8)) & 15
    w = torch.where(local < n_blocks[gid], w, 0)
    off, data_len = _offsets(p, w, gid, data_at)
    ends = _upload([q.numel() for q in payloads], torch.int64, dev)
    bad += (stated_len != data_len) | (data_at + data_len > ends)
    ebs = buf[_eb_positions(p)].view(torch.float64)
    eb_row = torch.cat([ebs, ebs.new_ones(1)])[p.ext][rows.piece]
    y = torch.zeros(p.rows * dim, dtype=torch.float32, device=dev)
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    nb = p.blocks
    parts = torch.zeros(nb, dtype=torch.int32, device=dev)
    ref = torch.zeros(p.rows, dtype=torch.int64, device=dev)
    if p.dedup:  # the references first: the literal rows' bounds depend on them
        _unpack(p, buf, src, w, off, gid, eb_row, y, refs, parts, src < 0)
        ref = refs[p.col(_RB0)[rows.group] * bf.LANES + rows.local].to(torch.int64)
        lit = ref == 0
        rank, count = _literal_rank(p, lit, rows)
        bad += count != literal
        at = torch.where(lit, p.col(_ROW0)[rows.group] + rank, p.rows)
        eb_row = eb_row.new_ones(p.rows + 1).index_copy_(0, at, eb_row)[:-1]
    _unpack(p, buf, src, w, off, gid, eb_row, y, refs, parts, src >= 0)
    total = (_head_hash(p, buf.view(torch.int32), data_at) + _part_hash(p, parts)) & _MASK32
    stored = buf[_checksum(p)].view(torch.int32).to(torch.int64)
    bad += total != (stored & _MASK32)
    out = y.view(p.rows, dim)
    if p.dedup:
        seg0 = rank[rows.first]
        want = torch.where(lit, rank, seg0 + ref - 1)
        wrong = ~lit & ((ref < 0) | (want >= rank))
        bad.index_add_(0, rows.group, wrong.to(torch.int64))
        want = torch.where(wrong, 0, want).clamp(max=p.col(_NPAD)[rows.group] - 1)
        out = out.index_select(0, p.col(_ROW0)[rows.group] + want)
    starts = np.concatenate([[0], np.cumsum([lay.padded for lay in lays])])
    return (
        [out[int(s) : int(s) + lay.rows] for s, lay in zip(starts, lays, strict=False)],
        ebs,
        bad == 0,
    )


def _unpack(
    p: _Plan,
    buf: torch.Tensor,
    src: torch.Tensor,
    w: torch.Tensor,
    off: torch.Tensor,
    gid: torch.Tensor,
    eb_row: torch.Tensor,
    y: torch.Tensor,
    refs: torch.Tensor,
    parts: torch.Tensor,
    which: torch.Tensor,
) -> None:
    """The unpack kernel over the blocks ``which`` selects (others keep width 0)."""
    if not p.blocks:
        return
    words = buf.view(torch.int32)
    part = torch.zeros_like(parts)
    unpack_kernel[(triton.cdiv(p.blocks, BLOCKS),)](
        src, torch.where(which, w, 0), off, p.col(_BASE)[gid], words, words.numel(), eb_row,
        p.lays[0].dim, y, refs, part, p.blocks, B=BLOCKS,
    )  # fmt: skip
    parts += torch.where(which, part, 0)


def check(ok: torch.Tensor, what: str = "payload") -> None:
    """Raise PayloadError naming the first payload whose checks failed (one host read)."""
    flags = ok.cpu().tolist()
    if not all(flags):
        i = flags.index(False)
        raise PayloadError(f"{what} {i}: corrupted or truncated (format-{bf.FORMAT} checks failed)")
