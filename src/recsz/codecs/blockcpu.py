"""Format 3 on the CPU: one group's payload written and read by compiled loops (numba).

The bytes are those of :mod:`recsz.codecs.blockformat` (which defines them) and of the
GPU's Triton kernels (:mod:`recsz.codecs.blockcoder`), so CPU and GPU ranks exchange
payloads; tests hold this coder to a plain numpy reference (``tests/blockref.py``) and
the kernels to this coder, byte for byte.

A row's repeat is found through a hash table of each key's first row (key: the row's
segment and 32-bit hash, as the GPU keys it), then checked bit for bit against that row:
the first row of a key is the row a stable sort by key would put first, so the choice is
the reference's. Quantization is the reference's arithmetic in float64, one operation at a
time (no fastmath: contracting into an FMA would round differently).
"""

from __future__ import annotations

import struct

import numpy as np
from numba import njit

from recsz.codecs import blockformat as bf
from recsz.codecs.payload import MAGIC, PayloadError

OK, BAD_LITERALS, BAD_REFERENCE = 0, 1, 2


@njit(cache=True, nogil=True)
def _dedup(bits, piece, first, segs, mult):
    """Each padded row's earlier row of its segment with the same bits (-1: none; the
    pad rows after ``bits``' are never deduplicated). One small hash table a segment
    (its keys are the segment's alone), so it stays in cache."""
    n, d = bits.shape  # the rows before the padding
    rep = np.full(piece.size, -1, np.int64)
    most = 0
    for s in range(segs):
        most = max(most, first[s + 1] - first[s])
    cap = 1
    while cap < 2 * most:
        cap *= 2
    keys = np.empty(cap, np.int64)
    held = np.empty(cap, np.int64)
    for s in range(segs):
        lo, hi = first[s], min(first[s + 1], n)
        size = 1
        while size < 2 * (hi - lo):
            size *= 2
        held[:size] = -1
        for i in range(lo, hi):
            h = np.int64(0)
            row = bits[i]
            for j in range(d):
                h += np.int64(row[j]) * mult[j]
            key = (h & 0xFFFFFFFF) | (np.int64(s) << 32)
            at = ((key * np.int64(-7046029254386353131)) >> 40) & (size - 1)  # Fibonacci
            while held[at] >= 0 and keys[at] != key:
                at = (at + 1) & (size - 1)
            if held[at] < 0:
                keys[at], held[at] = key, i
                continue
            f = bits[held[at]]
            diff = np.uint32(0)
            for j in range(d):  # no early exit: the loop vectorizes, and most rows match
                diff |= row[j] ^ f[j]
            if diff == 0:
                rep[i] = held[at]
    return rep


TILE = 64  # blocks whose planes are made together, lane by lane (the loops vectorize)


@njit(cache=True, nogil=True)
def _bits(m):
    w = 0
    while m:
        w += 1
        m >>= np.uint32(1)
    return w


@njit(cache=True, nogil=True)
def _planes(tile, planes, wmax):
    """planes[j, b] = bit j of tile[i, b] at bit i, for j < wmax (flat, TILE a row)."""
    for j in range(wmax):
        acc = np.zeros(TILE, np.uint32)
        for i in range(bf.LANES):
            row = tile[i * TILE : (i + 1) * TILE]
            for b in range(TILE):
                acc[b] |= ((row[b] >> np.uint32(j)) & np.uint32(1)) << np.uint32(i)
        planes[j * TILE : (j + 1) * TILE] = acc


@njit(cache=True, nogil=True)
def _lanes(planes, tile, wmax):
    """The inverse: tile[i, b] = bit i of planes[j, b] at bit j, for j < wmax."""
    tile[:] = 0
    for j in range(wmax):
        row = planes[j * TILE : (j + 1) * TILE]
        for i in range(bf.LANES):
            out = tile[i * TILE : (i + 1) * TILE]
            for b in range(TILE):
                out[b] |= ((row[b] >> np.uint32(i)) & np.uint32(1)) << np.uint32(j)


@njit(cache=True, nogil=True)
def _pack(vals, raw, xsrc, widths, at, data, o):
    """Blocks of ``vals`` (raw ones, or wider than MAX_WIDTH: ``xsrc``'s words) into
    ``data`` from word ``o``, their widths into ``widths`` from ``at``; the next word."""
    tile = np.zeros(bf.LANES * TILE, np.uint32)
    planes = np.empty(bf.MAX_WIDTH * TILE, np.uint32)
    w = np.empty(TILE, np.int64)
    nb = vals.size // bf.LANES
    for b0 in range(0, nb, TILE):
        t = min(TILE, nb - b0)
        wmax = 0
        for b in range(t):
            v = vals[(b0 + b) * bf.LANES : (b0 + b + 1) * bf.LANES]
            m = np.uint32(0)
            for i in range(bf.LANES):
                tile[i * TILE + b] = v[i]
                m |= v[i]
            w[b] = _bits(m)
            if raw[b0 + b] or w[b] > bf.MAX_WIDTH:
                w[b] = bf.RAW
            else:
                wmax = max(wmax, w[b])
        _planes(tile, planes, wmax)
        for b in range(t):
            widths[at + b0 + b] = w[b]
            if w[b] == bf.RAW:
                data[o : o + bf.LANES] = xsrc[(b0 + b) * bf.LANES : (b0 + b + 1) * bf.LANES]
                o += bf.LANES
                continue
            for j in range(w[b]):
                data[o + j] = planes[j * TILE + b]
            o += w[b]
    return o


@njit(cache=True, nogil=True)
def _quantize(xr, eb, zz, bad):
    """Zig-zagged codes and misses of values under one bound (the reference's float64
    steps, branch-free)."""
    step = 2.0 * eb
    for j in range(xr.size):
        v = np.float64(xr[j])
        qf = np.floor(v / step + 0.5)
        ok = abs(qf) <= bf.QMAX  # False for NaN; & not `and`: no branches, the loop vectorizes
        qs = qf if ok else 0.0
        prod = qs * step
        ok &= abs(prod) <= bf.F32_MAX
        y = np.float64(np.float32(prod if ok else 0.0))
        ok &= abs(v - y) <= eb
        q = np.int32(qs if ok else 0.0)  # |q| <= QMAX: int32 converts in vector lanes
        zz[j] = np.uint32((q << np.int32(1)) ^ (q >> np.int32(31)))
        bad[j] = not ok


@njit(cache=True, nogil=True)
def _encode(x, piece, first, ebs, segs, dedup, mult, ref_blocks):
    """(widths, data words, literal rows) of rows ``x`` (rows x D float32), padded with
    zero rows to ``piece``'s length (literal rows whose codes are zero)."""
    n, d = x.shape
    npad = piece.size
    bits = x.view(np.uint32)
    lit = np.ones(npad, np.bool_)
    refs = np.zeros(ref_blocks * bf.LANES, np.uint32)
    rank = np.arange(npad + 1)  # literal rows before each row (and in all)
    if dedup:
        rep = _dedup(bits, piece, first, segs, mult)
        for i in range(npad):
            lit[i] = rep[i] < 0
            rank[i + 1] = rank[i] + lit[i]
        for i in range(npad):
            if not lit[i]:
                refs[i] = rank[rep[i]] - rank[first[piece[i]]] + 1
    nl = rank[npad]
    nc = -(-nl * d // bf.LANES)
    # The literal rows side by side (then zeros): each segment's one run to quantize,
    # and a raw block's words as they are.
    xl = np.zeros(nc * bf.LANES, np.float32)
    for i in range(n):
        if lit[i]:
            o, row = xl[rank[i] * d : (rank[i] + 1) * d], x[i]
            for j in range(d):
                o[j] = row[j]
    zz = np.zeros(nc * bf.LANES, np.uint32)
    bad = np.zeros(nc * bf.LANES, np.bool_)
    for s in range(segs):
        a, b = rank[first[s]] * d, rank[first[s + 1]] * d
        _quantize(xl[a:b], ebs[s], zz[a:b], bad[a:b])
    raw = np.empty(nc, np.bool_)
    for b in range(nc):
        raw[b] = bad[b * bf.LANES : (b + 1) * bf.LANES].any()
    xb = xl.view(np.uint32)
    widths = np.zeros(ref_blocks + nc, np.uint8)
    data = np.empty((ref_blocks + nc) * bf.LANES, np.uint32)
    o = _pack(refs, np.zeros(ref_blocks, np.bool_), refs, widths, 0, data, 0)
    o = _pack(zz, raw, xb, widths, ref_blocks, data, o)
    return widths, data[:o], nl


def encode_group(lay: bf.Layout, x: np.ndarray, ebs: np.ndarray) -> bytes:
    """A format-3 payload of x (rows x D float32, segments as ``lay.seg_rows``)."""
    piece, first = bf.pieces(lay)
    e = np.ascontiguousarray(ebs, dtype=np.float64)
    x = np.ascontiguousarray(x, dtype=np.float32)
    mult = bf.HASH_MULT[: lay.dim]
    w, data, nl = _encode(x, piece, first, e, len(lay.seg_rows), lay.dedup, mult, lay.ref_blocks)
    at = lay.data_at(nl)
    out = np.zeros(at + 4 * data.size, np.uint8)
    out[: lay.eb_at] = np.frombuffer(MAGIC + bytes([bf.FORMAT, 0, 0, 0, 0]) + lay.head(), np.uint8)
    struct.pack_into("<II", out.data, lay.fields_at + bf.L_AT, nl, 4 * data.size)
    out[lay.eb_at : lay.widths_at] = np.frombuffer(e.astype("<f8").tobytes(), np.uint8)
    out[lay.widths_at : lay.widths_at + (w.size + 1) // 2] = _nibbles(w)
    out[at:] = np.frombuffer(data.astype("<u4").tobytes(), np.uint8)
    struct.pack_into("<I", out.data, 4, bf.word_hash(out[8:].view("<u4")))
    return out.tobytes()


def _nibbles(w: np.ndarray) -> np.ndarray:
    """Widths two to a byte, the first in the low half."""
    nib = np.zeros(2 * ((w.size + 1) // 2), np.uint8)
    nib[: w.size] = w
    out: np.ndarray = nib[0::2] | (nib[1::2] << 4)
    return out


@njit(cache=True, nogil=True)
def _unpack(words, widths):
    """The blocks' values (raw ones: their words), or None if the widths want other than
    ``words``' length."""
    nb = widths.size
    need = 0
    for b in range(nb):
        need += bf.LANES if widths[b] == bf.RAW else widths[b]
    if need != words.size:
        return None
    vals = np.zeros(nb * bf.LANES, np.uint32)
    tile = np.empty(bf.LANES * TILE, np.uint32)
    planes = np.empty(bf.MAX_WIDTH * TILE, np.uint32)
    o = 0
    for b0 in range(0, nb, TILE):
        t = min(TILE, nb - b0)
        planes[:] = 0
        wmax = 0
        for b in range(t):
            w = widths[b0 + b]
            if w == bf.RAW:
                vals[(b0 + b) * bf.LANES : (b0 + b + 1) * bf.LANES] = words[o : o + bf.LANES]
                o += bf.LANES
                continue
            for j in range(w):
                planes[j * TILE + b] = words[o + j]
            o += w
            wmax = max(wmax, w)
        _lanes(planes, tile, wmax)
        for b in range(t):
            if widths[b0 + b] != bf.RAW:
                v = vals[(b0 + b) * bf.LANES : (b0 + b + 1) * bf.LANES]
                for i in range(bf.LANES):
                    v[i] = tile[i * TILE + b]
    return vals


@njit(cache=True, nogil=True)
def _dequantize(zz, eb, y):
    step = 2.0 * eb
    for j in range(zz.size):
        z = zz[j]  # any 32-bit code (a damaged one too): its q fits int32
        q = np.int32(z >> np.uint32(1)) ^ -np.int32(z & np.uint32(1))
        v = np.float64(q) * step
        v = min(max(v, -bf.F32_MAX), bf.F32_MAX) if v == v else v  # NaN: a damaged bound
        y[j] = np.float32(v)


@njit(cache=True, nogil=True)
def _decode(vals, widths, nr, nl, d, piece, first, ebs, segs, dedup, rows):
    """(status, rows x D float32) of a payload's block values (status: OK or what is
    wrong)."""
    out = np.empty((rows, d), np.float32)
    npad = piece.size
    src = np.empty(npad, np.int64)
    rank = np.empty(npad, np.int64)
    r = 0
    for i in range(npad):
        ref = np.int64(vals[i]) if dedup else np.int64(0)
        rank[i] = r
        if ref == 0:
            src[i] = r
            r += 1
        else:
            src[i] = rank[first[piece[i]]] + ref - 1
            if src[i] >= r:
                return BAD_REFERENCE, out
    if r != nl:
        return BAD_LITERALS, out
    y = np.empty(nl * d, np.float32)
    codes = vals[nr * bf.LANES :]
    for i in range(npad):
        if src[i] == rank[i]:  # a literal row (a reference points before its row)
            eb = ebs[piece[i]] if piece[i] < segs else 1.0
            k = rank[i] * d
            _dequantize(codes[k : k + d], eb, y[k : k + d])
    rawf = codes.view(np.float32)
    for b in range(nr, widths.size):
        if widths[b] == bf.RAW:
            k = (b - nr) * bf.LANES
            e = min(k + bf.LANES, nl * d)
            y[k:e] = rawf[k:e]
    for i in range(rows):
        o, row = out[i], y[src[i] * d : (src[i] + 1) * d]
        for j in range(d):  # not a slice assignment: numba's checks overlap, then copies twice
            o[j] = row[j]
    return OK, out


def decode_group(buf: np.ndarray) -> tuple[bf.Layout, np.ndarray, np.ndarray]:
    """(layout, rows x D float32, bounds) of a format-3 payload; PayloadError if damaged."""
    lay, nl, dlen, checksum = bf.read_layout(buf)
    end = lay.data_at(nl) + dlen
    if dlen % 4 or end > buf.size:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than its {end} bytes")
    if bf.word_hash(np.frombuffer(buf[8:end].tobytes(), "<u4")) != checksum:
        raise PayloadError("checksum mismatch: payload corrupted or truncated")
    k = len(lay.seg_rows)
    ebs = np.frombuffer(buf[lay.eb_at : lay.eb_at + 8 * k].tobytes(), "<f8").copy()
    nb = lay.ref_blocks + lay.code_blocks(nl)
    packed = buf[lay.widths_at : lay.widths_at + (nb + 1) // 2]
    widths = np.stack([packed & 15, packed >> 4], 1).reshape(-1)[:nb].copy()
    words = np.frombuffer(buf[lay.data_at(nl) : end].tobytes(), "<u4")
    vals = _unpack(words, widths)
    if vals is None:
        raise PayloadError(f"the blocks' widths want other than the {dlen} data bytes it says")
    piece, first = bf.pieces(lay)
    status, y = _decode(
        vals, widths, lay.ref_blocks, nl, lay.dim, piece, first, ebs, k, lay.dedup, lay.rows
    )
    if status == BAD_LITERALS:
        raise PayloadError(f"the references leave other than the {nl} literal rows the header says")
    if status == BAD_REFERENCE:
        raise PayloadError("row reference points past the rows before it")
    return lay, y, ebs
