"""Format-3 payloads made and read where the tensors live, by a few Triton kernels and
torch operations, with no host synchronization (:mod:`recsz.codecs.blockformat` defines
the bytes and codes them with numpy on the CPU; CI runs these kernels under
``TRITON_INTERPRET=1`` and compares).

One call codes G groups (e.g. one per destination rank, each holding several tables) into
one buffer, each payload at a place fixed by the shapes alone (its capacity: every block
raw), so nothing waits for sizes: one quantize launch, one width launch, a prefix sum, one
pack launch, and header writes by index. The payloads' used sizes come back as a device
tensor; a caller that sends them reads it once (``trim``). Decoding is the inverse: width
gather, prefix sum, one unpack launch, one row gather for references; the checks
(header, widths, lengths, references, checksum) become one device flag per payload, read
once by :func:`check` where the caller wants a PayloadError.
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


@dataclass
class _Plan:
    """Host-side arithmetic of one call: every group's place and counts, uploaded once."""

    lays: list[bf.Layout]
    base: list[int]  # each payload's first byte in the buffer
    meta: torch.Tensor  # int64 on the device: the columns below, G each, then counts

    @property
    def g(self) -> int:
        return len(self.lays)

    def col(self, i: int) -> torch.Tensor:
        return self.meta[i * self.g : (i + 1) * self.g]

    @property
    def counts(self) -> torch.Tensor:  # rows per segment, then the group's pad rows
        return self.meta[_COLS * self.g : _COLS * self.g + self.pieces]

    @property
    def ext(self) -> torch.Tensor:  # bound index of each piece (S = the pad bound 1.0)
        o = _COLS * self.g + self.pieces
        return self.meta[o : o + self.pieces]

    @property
    def pieces(self) -> int:
        return sum(len(lay.seg_rows) + 1 for lay in self.lays)

    @property
    def rows(self) -> int:
        return sum(lay.padded for lay in self.lays)

    @property
    def blocks(self) -> int:
        return sum(lay.n_blocks for lay in self.lays)

    @property
    def ref_blocks(self) -> int:
        return sum(lay.ref_blocks for lay in self.lays)


# meta columns, one value per group
_NCB, _NB, _CB0, _RB0, _BS, _BASE, _WAT, _DAT, _ROW0, _NPAD, _EBAT, _FAT = range(12)
_COLS = 12


def _plan(lays: list[bf.Layout], base: list[int], dev: torch.device) -> _Plan:
    g = len(lays)
    cols = np.zeros((_COLS, g), np.int64)
    row0 = cb0 = rb0 = bs = 0
    counts, ext = [], []
    s = sum(len(lay.seg_rows) for lay in lays)
    k = 0
    for i, lay in enumerate(lays):
        cols[:, i] = [
            lay.code_blocks,
            lay.n_blocks,
            cb0,
            rb0,
            bs,
            base[i],
            lay.widths_at,
            lay.data_at,
            row0,
            lay.padded,
            lay.eb_at,
            lay.fields_at,
        ]
        row0 += lay.padded
        cb0 += lay.code_blocks
        rb0 += lay.ref_blocks
        bs += lay.n_blocks
        counts += [*lay.seg_rows, lay.padded - lay.rows]
        ext += [*range(k, k + len(lay.seg_rows)), s]
        k += len(lay.seg_rows)
    meta = _upload(np.concatenate([cols.reshape(-1), counts, ext]), torch.int64, dev)
    return _Plan(lays, base, meta)


def _ranges(starts: torch.Tensor, lens: Sequence[int], dev: torch.device) -> torch.Tensor:
    """Concatenated aranges starts[g] + [0, lens[g]) on the device (lens known here)."""
    total = int(sum(lens))
    lt = _upload(lens, torch.int64, dev)
    shift = starts - (torch.cumsum(lt, 0) - lt)
    return torch.arange(total, device=dev) + torch.repeat_interleave(shift, lt, output_size=total)


def _group_of(lens: torch.Tensor, total: int) -> torch.Tensor:
    return torch.repeat_interleave(
        torch.arange(lens.numel(), device=lens.device), lens, output_size=total
    )


def _row_bounds(p: _Plan, ebs: torch.Tensor) -> torch.Tensor:
    padded = torch.cat([ebs.to(torch.float64), ebs.new_ones(1, dtype=torch.float64)])
    return torch.repeat_interleave(padded[p.ext], p.counts, output_size=p.rows)


def _source_map(p: _Plan, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source map, group of each block, index within its group), in payload order."""
    gid = _group_of(p.col(_NB), p.blocks)
    local = torch.arange(p.blocks, device=dev) - p.col(_BS)[gid]
    ncb = p.col(_NCB)[gid]
    src = torch.where(local < ncb, p.col(_CB0)[gid] + local, -(p.col(_RB0)[gid] + local - ncb) - 1)
    return src, gid, local


def _ref_slots(p: _Plan, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's slot in the reference stream, and its index within its group."""
    r = torch.arange(p.rows, device=dev)
    g = _group_of(p.col(_NPAD), p.rows)
    local = r - p.col(_ROW0)[g]
    return p.col(_RB0)[g] * bf.LANES + local, local


def _offsets(p: _Plan, w: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offset of every block, and each group's data length."""
    size = torch.where(w == bf.RAW, 4 * bf.LANES, 4 * w.to(torch.int64))
    cz = torch.nn.functional.pad(torch.cumsum(size, 0), (1, 0))
    start = cz[p.col(_BS)]
    data_len = cz[p.col(_BS) + p.col(_NB)] - start
    off = cz[:-1] - start[gid] + (p.col(_BASE) + p.col(_DAT))[gid]
    return off, data_len


def _head_hash(p: _Plan, words: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Checksum share of each payload's words from byte 8 to its data (header, widths)."""
    lens = [(lay.data_at - 8) // 4 for lay in p.lays]
    first = (p.col(_BASE) + 8) // 4
    idx = _ranges(first, lens, dev)
    g = _group_of(_upload(lens, torch.int64, dev), idx.numel())
    wt = 2 * (idx - first[g]) + 1
    v = (words[idx].to(torch.int64) & _MASK32) * wt
    return torch.zeros(p.g, dtype=torch.int64, device=dev).index_add_(0, g, v)


def _part_hash(p: _Plan, parts: torch.Tensor) -> torch.Tensor:
    cz = torch.nn.functional.pad(torch.cumsum(parts.to(torch.int64) & _MASK32, 0), (1, 0))
    return cz[p.col(_BS) + p.col(_NB)] - cz[p.col(_BS)]


def _u32_bytes(v: torch.Tensor) -> torch.Tensor:
    v = v & _MASK32
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32).view(torch.uint8)


def _image(p: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """Positions and bytes of what the shapes fix: prefix, header fields but the data
    length, and the zeros that pad the widths."""
    pos, val = [], []
    for lay, b in zip(p.lays, p.base, strict=True):
        head = lay.head()
        dl = lay.fields_at - 8 + 24  # data_len: written from the device
        keep = np.r_[0:dl, dl + 4 : len(head)]
        pos += [b + np.arange(4), b + 8 + keep]
        val += [
            np.frombuffer(MAGIC + bytes([bf.FORMAT]), np.uint8),
            np.frombuffer(head, np.uint8)[keep],
        ]
        pad = np.arange(lay.widths_at + lay.n_blocks, lay.data_at)
        pos.append(b + pad)
        val.append(np.zeros(pad.size, np.uint8))
    return np.concatenate(pos), np.concatenate(val)


def _eb_positions(p: _Plan, dev: torch.device) -> torch.Tensor:
    lens = [8 * len(lay.seg_rows) for lay in p.lays]
    return _ranges(p.col(_BASE) + p.col(_EBAT), lens, dev)


def _dlen_positions(p: _Plan, dev: torch.device) -> torch.Tensor:
    return _ranges(p.col(_BASE) + p.col(_FAT) + 24, [4] * p.g, dev)


def encode(
    lays: list[bf.Layout], xs: list[torch.Tensor], ebs: torch.Tensor
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Code group g's rows ``xs[g]`` (float32, its segments as ``lays[g].seg_rows``) under
    ``ebs`` (one bound per segment, all groups in order, on the device).

    Returns (buffer, each payload's first byte, each payload's used length on the device):
    payload g is ``buffer[base[g] : base[g] + used[g]]``; any longer slice inside its
    capacity decodes the same."""
    dev = xs[0].device
    dim = lays[0].dim
    base = np.concatenate([[0], np.cumsum([lay.capacity for lay in lays])]).tolist()
    p = _plan(lays, base[:-1], dev)
    pieces: list[torch.Tensor] = []
    for lay, x in zip(lays, xs, strict=True):
        pieces.append(x.reshape(-1))
        if lay.padded > lay.rows:
            pieces.append(x.new_zeros((lay.padded - lay.rows) * dim))
    flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    n = flat.numel()
    zz = torch.empty(n, dtype=torch.int32, device=dev)
    bad = torch.empty(n, dtype=torch.int8, device=dev)
    if n:
        quantize_kernel[(triton.cdiv(n, ELEMS),)](
            flat, _row_bounds(p, ebs), zz, bad, n, dim, bf.QMAX, BLOCK=ELEMS
        )
    raw = bad.view(-1, bf.LANES).amax(1)
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    if p.ref_blocks:
        ref = _row_refs(p, zz.view(p.rows, dim), raw, dev)
        zz.view(p.rows, dim).masked_fill_((ref > 0)[:, None], 0)
        slot, _ = _ref_slots(p, dev)
        refs[slot] = ref
    src, gid, local = _source_map(p, dev)
    nb = p.blocks
    w = torch.empty(nb, dtype=torch.uint8, device=dev)
    out = torch.empty(base[-1], dtype=torch.uint8, device=dev)
    parts = torch.empty(nb, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(nb, BLOCKS),)
    if nb:
        widths_kernel[grid](src, zz, refs, raw, w, nb, B=BLOCKS)
    off, data_len = _offsets(p, w, gid)
    if nb:
        wpos = (p.col(_BASE) + p.col(_WAT))[gid] + local
        pack_kernel[grid](
            src,
            zz,
            refs,
            flat.view(torch.int32),
            w,
            off,
            wpos,
            p.col(_BASE)[gid],
            out,
            out.view(torch.int32),
            parts,
            nb,
            B=BLOCKS,
        )
    pos, val = _image(p)
    out[_upload(pos, torch.int64, dev)] = _upload(val, torch.uint8, dev)
    out[_eb_positions(p, dev)] = ebs.to(torch.float64).contiguous().view(torch.uint8)
    out[_dlen_positions(p, dev)] = _u32_bytes(data_len)
    total = _head_hash(p, out.view(torch.int32), dev) + _part_hash(p, parts)
    out[_ranges(p.col(_BASE) + 4, [4] * p.g, dev)] = _u32_bytes(total)
    return out, base[:-1], p.col(_DAT) + data_len


def _row_refs(p: _Plan, codes: torch.Tensor, raw: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """blockformat.row_refs and touches_raw, as torch operations on the device."""
    rows, dim = codes.shape
    r = torch.arange(rows, device=dev)
    c = torch.nn.functional.pad(torch.cumsum(raw.to(torch.int32), 0), (1, 0))
    touch = c[(r * dim + dim - 1) // bf.LANES + 1] - c[(r * dim) // bf.LANES] > 0
    piece = _group_of(p.counts, rows)
    last = torch.cumsum(p.counts.new_tensor([len(lay.seg_rows) + 1 for lay in p.lays]), 0) - 1
    is_pad = torch.zeros(p.pieces, dtype=torch.bool, device=dev)
    is_pad[last] = True
    eligible = ~touch & ~is_pad[piece]
    mult = _upload(bf.HASH_MULT[:dim], torch.int64, dev)
    h = (codes.to(torch.int64) * mult).sum(1)
    key = torch.where(eligible, (h & ((1 << bf.HASH_BITS) - 1)) | (piece << bf.HASH_BITS), -(r + 1))
    ks, perm = torch.sort(key, stable=True)
    start = torch.ones(rows, dtype=torch.bool, device=dev)
    start[1:] = ks[1:] != ks[:-1]
    rep = perm[torch.cummax(torch.where(start, r, 0), 0).values]
    same = (codes[perm] == codes[rep]).all(1) & ~start
    ref = torch.zeros(rows, dtype=torch.int32, device=dev)
    ref[perm] = torch.where(same, perm - rep, 0).to(torch.int32)
    return ref


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
    return torch.cat(parts) if parts else payloads[0].new_zeros(0), offs


def read_layouts(payloads: list[torch.Tensor]) -> list[bf.Layout]:
    """The layouts the payloads' headers state (one host copy of their first bytes)."""
    heads = [p[: min(p.numel(), 4096)].reshape(-1) for p in payloads]
    host = torch.cat(heads).cpu().numpy() if heads else np.zeros(0, np.uint8)
    out, at = [], 0
    for p, h in zip(payloads, heads, strict=True):
        chunk = host[at : at + h.numel()]
        at += h.numel()
        lay, _, _ = bf.read_layout(chunk)
        if lay.data_at > chunk.size and p.numel() >= lay.data_at:  # many tables: read on
            lay, _, _ = bf.read_layout(p[: lay.data_at].cpu().numpy())
        out.append(lay)
    return out


def decode(
    payloads: list[torch.Tensor], lays: list[bf.Layout]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Rows of each payload (as ``lays`` expects them), the bounds (all segments), and a
    device flag per payload: True where every check passed."""
    dev = payloads[0].device
    dim = lays[0].dim
    for i, (q, lay) in enumerate(zip(payloads, lays, strict=True)):
        if q.numel() < lay.data_at:
            raise PayloadError(
                f"payload {i}: {q.numel()} bytes, its header alone needs {lay.data_at}"
            )
    buf, base = common_buffer(payloads)
    p = _plan(lays, base, dev)
    src, gid, local = _source_map(p, dev)
    nb = p.blocks
    pos, val = _image(p)
    pos_t = _upload(pos, torch.int64, dev)
    head_g = _upload(np.searchsorted(np.asarray(base), pos, side="right") - 1, torch.int64, dev)
    bad = torch.zeros(p.g, dtype=torch.int64, device=dev)
    bad.index_add_(0, head_g, (buf[pos_t] != _upload(val, torch.uint8, dev)).to(torch.int64))
    w = buf[(p.col(_BASE) + p.col(_WAT))[gid] + local]
    wrong_w = ((w > 25) & (w != bf.RAW)).to(torch.int64)
    bad.index_add_(0, gid, wrong_w)
    off, data_len = _offsets(p, w, gid)
    stated = buf[_dlen_positions(p, dev)].view(torch.int32).to(torch.int64) & _MASK32
    ends = _upload([q.numel() for q in payloads], torch.int64, dev)
    bad += (stated != data_len) | (p.col(_DAT) + data_len > ends)
    ebs = buf[_eb_positions(p, dev)].view(torch.float64)
    y = torch.empty(p.rows * dim, dtype=torch.float32, device=dev)
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    parts = torch.empty(nb, dtype=torch.int32, device=dev)
    if nb:
        words = buf.view(torch.int32)
        unpack_kernel[(triton.cdiv(nb, BLOCKS),)](
            src,
            w,
            off,
            p.col(_BASE)[gid],
            words,
            words.numel(),
            _row_bounds(p, ebs),
            dim,
            y,
            refs,
            parts,
            nb,
            B=BLOCKS,
        )
    total = (_head_hash(p, buf.view(torch.int32), dev) + _part_hash(p, parts)) & _MASK32
    stored = buf[_ranges(p.col(_BASE) + 4, [4] * p.g, dev)].view(torch.int32).to(torch.int64)
    bad += total != (stored & _MASK32)
    rows = y.view(p.rows, dim)
    if p.ref_blocks:
        slot, row_local = _ref_slots(p, dev)
        ref = refs[slot].to(torch.int64)
        wrong = (ref < 0) | (ref > row_local)
        bad.index_add_(0, _group_of(p.col(_NPAD), p.rows), wrong.to(torch.int64))
        r = torch.arange(p.rows, device=dev)
        rows = rows.index_select(0, torch.where(wrong, r, r - ref))
    out = [
        rows[int(r0) : int(r0) + lay.rows] for r0, lay in zip(_row_starts(lays), lays, strict=True)
    ]
    return out, ebs, bad == 0


def _row_starts(lays: list[bf.Layout]) -> list[int]:
    return np.concatenate([[0], np.cumsum([lay.padded for lay in lays])])[:-1].tolist()


def check(ok: torch.Tensor, what: str = "payload") -> None:
    """Raise PayloadError naming the first payload whose checks failed (one host read)."""
    flags = ok.cpu().tolist()
    if not all(flags):
        i = flags.index(False)
        raise PayloadError(f"{what} {i}: corrupted or truncated (format-{bf.FORMAT} checks failed)")


__all__ = ["check", "common_buffer", "decode", "encode", "read_layouts"]
