"""Format 3: fixed-length bit-plane blocks, one payload per group of tables, and its CPU
reference coder.

A payload holds one *group*: the rows of K tables (segments) of width D, each segment
under its own absolute bound. It is laid out so that every part of it can be found and
written in parallel (:mod:`recsz.codecs.blockcoder` makes it on a GPU with a few Triton
kernels and no host sync); this module writes and reads the same bytes with numpy, so
CPU and GPU ranks exchange payloads and CI checks the kernels byte for byte.

Layout (little endian; every offset past the prefix a multiple of 4)::

    "RSZ" | 3 | u32 checksum of every word after these 8 bytes
    u8 len(codec id) | codec id | zeros to a multiple of 4
    u32 dtype code, flags (bit 0: rows deduplicated), D, K, N rows, L literal rows, data_len
    K x u32 rows per segment | K x f64 bound per segment
    widths: 4 bits per block (reference blocks, then code blocks; block 2k in the low
            half of byte k) | zeros to a multiple of 4
    data: the blocks, back to back

Deduplication (flag bit 0). A row whose float32 bits equal those of an earlier row of its
segment is not coded: its *reference* says which of the segment's literal rows it copies
(k + 1 for the k-th; 0 for a literal row itself). Candidates come from a 32-bit hash of
the row's bits, sorted stably with the segment, the first row of each run being the
target, and are verified bit for bit; so a copy is exact, whatever the bound. The rows
are padded with zero rows (literal, never referenced) to Np, a multiple of
32 / gcd(D, 32); the Np references travel as ceil(Np / 32) blocks. Without dedup every
row is literal and no reference travels.

Coding of the L literal rows, in order, as ceil(L D / 32) blocks of 32 values (the last
one completed with zeros). Each element: q = floor(x / 2eb + 1/2) in float64 under its
segment's bound, reconstructed as y = float32(q 2eb); an element whose |q| > 2^24 - 1,
whose |q 2eb| exceeds float32's largest value, or whose |x - y| exceeds eb (NaN and Inf
among them) makes its block *raw*: the block's 32 float32 words are stored as they are.
Codes are zig-zagged (z = 2|q| - [q < 0]); a block of width w = bit length of its largest
value is stored as w 32-bit planes (plane j = bit j of each lane, lane i at bit i): 0
bytes for an all-zero block, 4 w bytes otherwise; a block wider than 14 bits is stored
raw too (width 15, 128 bytes). Reference blocks are coded the same way (raw: the
references themselves).

Checksum: sum over the words w_i after the prefix of w_i (2i + 1), modulo 2^32 (linear,
so blocks add their parts in parallel).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from recsz.codecs.payload import MAGIC, PayloadError

FORMAT = 3
QMAX = (1 << 24) - 1  # |q| above this is raw: q and q 2eb stay exact in float32
RAW = 15  # width of a raw block (values stored as they are: float32 bits, references)
MAX_WIDTH = 14  # wider blocks are stored raw
F32_MAX = float(np.finfo(np.float32).max)
LANES = 32
MASK32 = 0xFFFFFFFF
FIELDS = struct.Struct("<7I")
DEDUP = 1
#: Odd 64-bit multipliers of the row hash (fixed: both ends and every build agree).
HASH_MULT = np.random.default_rng(0x5EED_B10C).integers(1, 1 << 62, 4096, dtype=np.int64) | 1
HASH_BITS = 32  # the GPU keys its hash table by (segment, 32-bit hash) in one int64


def padded_rows(n: int, d: int) -> int:
    """Rows padded so that n x d values fill 32-value blocks exactly."""
    r0 = LANES // math.gcd(d, LANES)
    return -(-n // r0) * r0


@dataclass(frozen=True)
class Layout:
    """What the shapes alone fix of one group's payload (codec id, D, rows per segment,
    dedup); where its data starts depends on L, the number of literal rows."""

    codec: str
    dtype_code: int
    dim: int
    seg_rows: tuple[int, ...]
    dedup: bool

    @property
    def rows(self) -> int:
        return sum(self.seg_rows)

    @property
    def padded(self) -> int:
        return padded_rows(self.rows, self.dim)

    def code_blocks(self, literal: int) -> int:
        return -(-literal * self.dim // LANES)

    @property
    def ref_blocks(self) -> int:
        return -(-self.padded // LANES) if self.dedup else 0

    @property
    def max_blocks(self) -> int:
        return self.ref_blocks + self.code_blocks(self.padded)

    @property
    def fields_at(self) -> int:
        return _up4(9 + len(self.codec))

    @property
    def eb_at(self) -> int:
        return self.fields_at + FIELDS.size + 4 * len(self.seg_rows)

    @property
    def widths_at(self) -> int:
        return self.eb_at + 8 * len(self.seg_rows)

    def data_at(self, literal: int) -> int:
        return self.widths_at + _up4((self.ref_blocks + self.code_blocks(literal) + 1) // 2)

    @property
    def capacity(self) -> int:
        """The largest payload: no row deduplicated, every block raw."""
        return self.data_at(self.padded) + 4 * LANES * self.max_blocks

    def head(self) -> bytes:
        """Bytes [8, eb_at) with L and data_len zero (the coder writes them at
        ``fields_at + 20`` and ``+ 24``)."""
        cid = self.codec.encode("ascii")
        pre = bytes([len(cid)]) + cid
        pre += bytes(self.fields_at - 8 - len(pre))
        k = len(self.seg_rows)
        flags = DEDUP if self.dedup else 0
        f = FIELDS.pack(self.dtype_code, flags, self.dim, k, self.rows, 0, 0)
        return pre + f + struct.pack(f"<{k}I", *self.seg_rows)


L_AT = 20  # L and data_len, written by the device coder: from fields_at


def _up4(n: int) -> int:
    return (n + 3) & ~3


def word_hash(words: np.ndarray, first: int = 0) -> int:
    """Sum of words[i] (2 (first + i) + 1) modulo 2^32."""
    i = np.arange(first, first + words.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int((words.astype(np.uint64) * (2 * i + 1)).sum(dtype=np.uint64) & 0xFFFFFFFF)


def read_layout(buf: np.ndarray) -> tuple[Layout, int, int, int]:
    """(layout, L, data_len, stored checksum) from a payload's first bytes (host)."""
    b = buf.tobytes()
    try:
        magic, ver, checksum = struct.unpack_from("<3sBI", b, 0)
        if magic != MAGIC or ver != FORMAT:
            raise PayloadError(f"not a format-{FORMAT} payload")
        clen = b[8]
        codec = b[9 : 9 + clen].decode("ascii")
        at = _up4(9 + clen)
        dcode, flags, d, k, n, lit, dlen = FIELDS.unpack_from(b, at)
        seg = struct.unpack_from(f"<{k}I", b, at + FIELDS.size)
    except (IndexError, struct.error, UnicodeDecodeError) as e:
        raise PayloadError(f"malformed format-{FORMAT} header: {e}") from None
    if flags & ~DEDUP or d == 0 or sum(seg) != n:
        raise PayloadError(f"format-{FORMAT} header is inconsistent (flags, dim or rows)")
    lay = Layout(codec, dcode, d, tuple(seg), bool(flags & DEDUP))
    if lit > lay.padded:
        raise PayloadError(f"header says {lit} literal rows of {lay.padded}")
    return lay, lit, dlen, checksum


# ---- the CPU reference ----------------------------------------------------------------
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


def pieces(lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Each padded row's piece (segment, or K for the pad rows) and each piece's first row."""
    counts = [*lay.seg_rows, lay.padded - lay.rows]
    first = np.concatenate([[0], np.cumsum(counts)])[:-1]
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts), first


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
    body += packed.tobytes() + bytes(_up4(len(packed)) - len(packed))
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
