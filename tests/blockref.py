"""The plain numpy reference of format 3 (:mod:`recsz.codecs.blockformat` defines the
bytes): what the compiled CPU coder (:mod:`recsz.codecs.blockcpu`) is held to, byte for
byte, in tests/test_blocks.py; written as the layout reads, whole arrays at a time."""

from __future__ import annotations

import struct

import numpy as np

from recsz.codecs.blockformat import (
    F32_MAX,
    FORMAT,
    HASH_BITS,
    HASH_MULT,
    L_AT,
    LANES,
    MAX_WIDTH,
    QMAX,
    RAW,
    Layout,
    pieces,
    read_layout,
    word_hash,
)
from recsz.codecs.payload import MAGIC, PayloadError

SPECIALS = [np.nan, np.inf, -np.inf, 3.0e38, -3.0e38, 1e-45, 1e-39, -0.0]


def quantize(x: np.ndarray, eb_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zig-zagged codes (uint32) and the elements that miss (bool), rows x D."""
    x64 = x.astype(np.float64)
    step = (2.0 * eb_row)[:, None]
    with np.errstate(all="ignore"):
        qf = np.floor(x64 / step + 0.5)
        ok = np.abs(qf) <= QMAX
        prod = np.where(ok, qf * step, 0.0)
        ok &= np.abs(prod) <= F32_MAX  # beyond it float32 holds no reconstruction
        qf = np.where(ok, qf, 0.0)
        y = np.where(ok, prod, 0.0).astype(np.float32).astype(np.float64)
        ok &= np.abs(x64 - y) <= eb_row[:, None]
    q = qf.astype(np.int64)
    zz = ((q << 1) ^ (q >> 63)).astype(np.uint32)
    zz[~ok] = 0
    return zz, ~ok


def duplicates(bits: np.ndarray, piece: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """For each row, the earlier row of its piece with the same bits it copies (-1: none)."""
    n, d = bits.shape
    with np.errstate(over="ignore"):
        h = (bits.astype(np.int64) * HASH_MULT[:d]).sum(1, dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    key = np.where(eligible, (h & ((1 << HASH_BITS) - 1)) | (piece << HASH_BITS), -(rows + 1))
    perm = np.argsort(key, kind="stable")
    ks = key[perm]
    start = np.ones(n, bool)
    start[1:] = ks[1:] != ks[:-1]
    rep = perm[np.maximum.accumulate(np.where(start, rows, 0))]
    same = (bits[perm] == bits[rep]).all(1) & ~start
    out = np.full(n, -1, np.int64)
    out[perm] = np.where(same, rep, -1)
    return out


def pack_blocks(vals: np.ndarray, raw: np.ndarray, xbits: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Widths and data of blocks (rows of 32 uint32 values; raw ones stored as xbits)."""
    m = vals.max(1) if vals.size else np.zeros(0, np.uint32)
    w = np.zeros(len(vals), np.uint8)
    for j in range(26):
        w += (m >> j).astype(bool)
    w[raw | (w > MAX_WIDTH)] = RAW
    lane = np.arange(LANES, dtype=np.uint32)
    out = []
    for i in range(len(vals)):
        if w[i] == RAW:
            out.append(xbits[i].astype("<u4").tobytes())
        elif w[i]:
            planes = [(((vals[i] >> j) & 1) << lane).sum(dtype=np.uint32) for j in range(w[i])]
            out.append(np.array(planes, "<u4").tobytes())
    return w, b"".join(out)


def _blocks_of(a: np.ndarray, n_blocks: int, dtype: type) -> np.ndarray:
    out: np.ndarray = np.zeros(n_blocks * LANES, dtype)
    out[: a.size] = a.reshape(-1)
    return out.reshape(n_blocks, LANES)


def encode_group(lay: Layout, x: np.ndarray, ebs: np.ndarray) -> bytes:
    """A format-3 payload of x (rows x D float32, segments as ``lay.seg_rows``)."""
    n, d, npad = lay.rows, lay.dim, lay.padded
    xp = np.zeros((npad, d), np.float32)
    xp[:n] = x
    piece, first = pieces(lay)
    eb_row = np.append(ebs.astype(np.float64), 1.0)[piece]
    lit = np.ones(npad, bool)
    blocks, raws, xbits = [], [], []
    if lay.dedup:
        rep = duplicates(xp.view(np.uint32), piece, piece < len(lay.seg_rows))
        lit = rep < 0
        rank: np.ndarray = np.cumsum(lit) - lit
        ref = np.where(lit, 0, rank[np.maximum(rep, 0)] - rank[first[piece]] + 1)
        blocks.append(_blocks_of(ref.astype(np.uint32), lay.ref_blocks, np.uint32))
        raws.append(np.zeros(lay.ref_blocks, bool))
        xbits.append(blocks[-1])
    nl = int(lit.sum())
    zz, bad = quantize(xp[lit], eb_row[lit])
    nc = lay.code_blocks(nl)
    blocks.append(_blocks_of(zz, nc, np.uint32))
    raws.append(np.asarray(_blocks_of(bad, nc, bool).any(1)))
    xbits.append(_blocks_of(xp[lit].view(np.uint32), nc, np.uint32))
    w, data = pack_blocks(np.concatenate(blocks), np.concatenate(raws), np.concatenate(xbits))
    body = bytearray(lay.head())
    struct.pack_into("<II", body, lay.fields_at - 8 + L_AT, nl, len(data))
    body += ebs.astype("<f8").tobytes()
    nib = np.zeros(2 * ((len(w) + 1) // 2), np.uint8)
    nib[: len(w)] = w
    packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    body += packed.tobytes() + bytes(-len(packed) % 4)
    body += data
    words = np.frombuffer(bytes(body), "<u4")
    return MAGIC + bytes([FORMAT]) + struct.pack("<I", word_hash(words)) + bytes(body)


def decode_group(buf: np.ndarray) -> tuple[Layout, np.ndarray, np.ndarray]:
    """(layout, rows x D float32, bounds) of a format-3 payload; PayloadError if damaged."""
    lay, nl, dlen, checksum = read_layout(buf)
    end = lay.data_at(nl) + dlen
    if dlen % 4 or end > buf.size:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than its {end} bytes")
    if word_hash(np.frombuffer(buf[8:end].tobytes(), "<u4")) != checksum:
        raise PayloadError("checksum mismatch: payload corrupted or truncated")
    k, d, npad = len(lay.seg_rows), lay.dim, lay.padded
    ebs = np.frombuffer(buf[lay.eb_at : lay.eb_at + 8 * k].tobytes(), "<f8")
    nb = lay.ref_blocks + lay.code_blocks(nl)
    packed = buf[lay.widths_at : lay.widths_at + (nb + 1) // 2].astype(np.int64)
    w = np.stack([packed & 15, packed >> 4], 1).reshape(-1)[:nb]
    size = np.where(w == RAW, 4 * LANES, 4 * w)
    if int(size.sum()) != dlen:
        raise PayloadError(f"blocks need {int(size.sum())} data bytes, header says {dlen}")
    words = np.frombuffer(buf[lay.data_at(nl) : end].tobytes(), "<u4")
    offs = np.concatenate([[0], np.cumsum(size // 4)])
    vals = np.zeros((nb, LANES), np.uint32)
    lane = np.arange(LANES, dtype=np.uint32)
    for i in np.flatnonzero(w):
        o = offs[i]
        if w[i] == RAW:
            vals[i] = words[o : o + LANES]
        else:
            for j in range(w[i]):
                vals[i] |= ((words[o + j] >> lane) & 1) << np.uint32(j)
    nr = lay.ref_blocks
    piece, first = pieces(lay)
    ref = vals[:nr].reshape(-1)[:npad].astype(np.int64) if lay.dedup else np.zeros(npad, np.int64)
    lit = ref == 0
    if int(lit.sum()) != nl:
        raise PayloadError(f"{int(lit.sum())} literal rows, header says {nl}")
    rank = np.cumsum(lit) - lit
    seg0 = rank[first[piece]]
    src = np.where(lit, rank, seg0 + ref - 1)
    if (~lit & (src >= rank)).any():
        raise PayloadError("row reference points past the rows before it")
    zz = vals[nr:].reshape(-1)[: nl * d].reshape(nl, d).astype(np.int64)
    q = (zz >> 1) ^ -(zz & 1)
    eb_lit = np.append(ebs, 1.0)[piece][lit]
    with np.errstate(all="ignore"):  # a damaged payload's bounds may be anything
        y = np.clip(q * (2.0 * eb_lit)[:, None], -F32_MAX, F32_MAX).astype(np.float32)
    rawb = np.repeat(w[nr:] == RAW, LANES)[: nl * d].reshape(nl, d)
    y[rawb] = vals[nr:].reshape(-1)[: nl * d].reshape(nl, d).view(np.float32)[rawb]
    return lay, y[src][: lay.rows], ebs.copy()


def adversarial(rng: np.random.Generator, rows: int, dim: int, eb: float) -> np.ndarray:
    """Rows with exact ties at half-steps, repeats, specials, and codes at every width."""
    kind = rng.integers(0, 4, (rows, dim))
    half = (rng.integers(-40, 40, (rows, dim)) + 0.5) * 2 * eb  # exact ties (x / 2eb + 1/2)
    wide = rng.integers(-(2**24), 2**24, (rows, dim)) * 2 * eb * rng.random((rows, 1))
    x = np.where(kind == 0, half, np.where(kind == 1, wide, rng.standard_normal((rows, dim))))
    x = x.astype(np.float32)
    if rows > 2:
        x[rng.integers(0, rows, rows // 2)] = x[0]  # many repeats of one row
    spots = rng.random((rows, dim)) < 0.03
    x[spots] = rng.choice(np.array(SPECIALS, np.float32), int(spots.sum()))
    return x
