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
    u32 dtype code, flags (bit 0: rows deduplicated), D, K, N rows, n_blocks, data_len
    K x u32 rows per segment | K x f64 bound per segment
    n_blocks x u8 block widths | zeros to a multiple of 4
    data: the blocks, back to back

Coding. Rows are padded with zero rows to Np (a multiple of 32 / gcd(D, 32)) so that the
group's Np x D codes fill 32-value blocks exactly. Each element: q = floor(x / 2eb + 1/2)
in float64, reconstructed as y = float32(q 2eb); an element whose |q| > 2^24 - 1, whose
|q 2eb| exceeds float32's largest value, or whose |x - y| exceeds eb (NaN and Inf among
them), makes its block *raw*: the block's 32
float32 words are stored as they are. Codes are zig-zagged (z = 2|q| - [q < 0]); a block
of width w = bit length of its largest z is stored as w 32-bit planes (plane j = bit j of
each lane, lane i at bit i): 0 bytes for an all-zero block, 4 w bytes otherwise, 128 for a
raw block (width byte 255).

Deduplication (flag bit 0): a row equal, code for code, to an earlier row of its segment
is sent as zeros plus a reference (its distance to that row). Candidates come from a
40-bit row hash, sorted stably with the segment, the first row of each run being the
target, and are verified element by element; rows that share a block with a raw block
neither reference nor are referenced. The Np references (0 = literal) follow the code
blocks as blocks of their own. Decoding dequantizes, copies each referencing row from its
target, and keeps raw blocks exact.

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
RAW = 255  # width byte of a raw block
F32_MAX = float(np.finfo(np.float32).max)
LANES = 32
FIELDS = struct.Struct("<7I")
DEDUP = 1
#: Odd 64-bit multipliers of the row hash (fixed: both ends and every build agree).
HASH_MULT = np.random.default_rng(0x5EED_B10C).integers(1, 1 << 62, 4096, dtype=np.int64) | 1
HASH_BITS = 40


def padded_rows(n: int, d: int) -> int:
    """Rows padded so that n x d codes fill 32-value blocks exactly."""
    r0 = LANES // math.gcd(d, LANES)
    return -(-n // r0) * r0


@dataclass(frozen=True)
class Layout:
    """Where everything of one group's payload sits; all of it known from the header's
    host-side fields (codec id, D, rows per segment, dedup) alone."""

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

    @property
    def code_blocks(self) -> int:
        return self.padded * self.dim // LANES

    @property
    def ref_blocks(self) -> int:
        return -(-self.padded // LANES) if self.dedup else 0

    @property
    def n_blocks(self) -> int:
        return self.code_blocks + self.ref_blocks

    @property
    def fields_at(self) -> int:
        return _up4(9 + len(self.codec))

    @property
    def eb_at(self) -> int:
        return self.fields_at + FIELDS.size + 4 * len(self.seg_rows)

    @property
    def widths_at(self) -> int:
        return self.eb_at + 8 * len(self.seg_rows)

    @property
    def data_at(self) -> int:
        return self.widths_at + _up4(self.n_blocks)

    @property
    def capacity(self) -> int:
        """The largest payload: every block raw."""
        return self.data_at + 4 * LANES * self.n_blocks

    def head(self) -> bytes:
        """Bytes [8, eb_at): everything before the bounds but data_len (zero here; the
        coder writes it)."""
        cid = self.codec.encode("ascii")
        pre = bytes([len(cid)]) + cid
        pre += bytes(self.fields_at - 8 - len(pre))
        k = len(self.seg_rows)
        f = FIELDS.pack(
            self.dtype_code, DEDUP if self.dedup else 0, self.dim, k, self.rows, self.n_blocks, 0
        )
        return pre + f + struct.pack(f"<{k}I", *self.seg_rows)


def _up4(n: int) -> int:
    return (n + 3) & ~3


def word_hash(words: np.ndarray, first: int = 0) -> int:
    """Sum of words[i] (2 (first + i) + 1) modulo 2^32."""
    i = np.arange(first, first + words.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int((words.astype(np.uint64) * (2 * i + 1)).sum(dtype=np.uint64) & 0xFFFFFFFF)


def read_layout(buf: np.ndarray) -> tuple[Layout, int, int]:
    """A payload's layout, data_len and stored checksum, from its first bytes (host)."""
    b = buf.tobytes()
    try:
        magic, ver, checksum = struct.unpack_from("<3sBI", b, 0)
        if magic != MAGIC or ver != FORMAT:
            raise PayloadError(f"not a format-{FORMAT} payload")
        clen = b[8]
        codec = b[9 : 9 + clen].decode("ascii")
        at = _up4(9 + clen)
        dcode, flags, d, k, n, nb, dlen = FIELDS.unpack_from(b, at)
        seg = struct.unpack_from(f"<{k}I", b, at + FIELDS.size)
    except (IndexError, struct.error, UnicodeDecodeError) as e:
        raise PayloadError(f"malformed format-{FORMAT} header: {e}") from None
    if flags & ~DEDUP or d == 0 or sum(seg) != n:
        raise PayloadError(f"format-{FORMAT} header is inconsistent (flags, dim or rows)")
    lay = Layout(codec, dcode, d, tuple(seg), bool(flags & DEDUP))
    if nb != lay.n_blocks:
        raise PayloadError(f"header says {nb} blocks, its shape needs {lay.n_blocks}")
    return lay, dlen, checksum


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


def row_refs(zz: np.ndarray, seg: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Distance from each row to the earlier equal row of its segment it copies (0: none)."""
    n, d = zz.shape
    with np.errstate(over="ignore"):
        h = (zz.astype(np.int64) * HASH_MULT[:d]).sum(1, dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    key = np.where(eligible, (h & ((1 << HASH_BITS) - 1)) | (seg << HASH_BITS), -(rows + 1))
    perm = np.argsort(key, kind="stable")
    ks = key[perm]
    start = np.ones(n, bool)
    start[1:] = ks[1:] != ks[:-1]
    rep = perm[np.maximum.accumulate(np.where(start, rows, 0))]
    same = (zz[perm] == zz[rep]).all(1) & ~start
    ref = np.zeros(n, np.uint32)
    ref[perm] = np.where(same, perm - rep, 0)
    return ref


def touches_raw(raw_blocks: np.ndarray, n: int, d: int) -> np.ndarray:
    """Rows (of n) that share a 32-value block with a raw block."""
    c = np.concatenate([[0], np.cumsum(raw_blocks, dtype=np.int64)])
    r = np.arange(n, dtype=np.int64)
    return c[(r * d + d - 1) // LANES + 1] - c[(r * d) // LANES] > 0


def pack_blocks(vals: np.ndarray, raw: np.ndarray, xbits: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Widths and data of blocks (rows of 32 uint32 values; raw ones stored as xbits)."""
    m = vals.max(1) if vals.size else np.zeros(0, np.uint32)
    w = np.zeros(len(vals), np.uint8)
    for j in range(26):
        w += (m >> j).astype(bool)
    w[raw] = RAW
    lane = np.arange(LANES, dtype=np.uint32)
    out = []
    for i in range(len(vals)):
        if w[i] == RAW:
            out.append(xbits[i].astype("<u4").tobytes())
        elif w[i]:
            planes = [(((vals[i] >> j) & 1) << lane).sum(dtype=np.uint32) for j in range(w[i])]
            out.append(np.array(planes, "<u4").tobytes())
    return w, b"".join(out)


def encode_group(lay: Layout, x: np.ndarray, ebs: np.ndarray) -> bytes:
    """A format-3 payload of x (rows x D float32, segments as ``lay.seg_rows``)."""
    n, d, npad = lay.rows, lay.dim, lay.padded
    xp = np.zeros((npad, d), np.float32)
    xp[:n] = x
    counts = [*lay.seg_rows, npad - n]
    eb_row = np.repeat(np.append(ebs.astype(np.float64), 1.0), counts)
    zz, bad = quantize(xp, eb_row)
    raw = bad.reshape(-1, LANES).any(1)
    blocks = [zz.reshape(-1, LANES)]
    if lay.dedup:
        seg = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        eligible = ~touches_raw(raw, npad, d)
        eligible[n:] = False
        ref = row_refs(zz, seg, eligible)
        zz[ref > 0] = 0
        refs = np.zeros(lay.ref_blocks * LANES, np.uint32)
        refs[:npad] = ref
        blocks.append(refs.reshape(-1, LANES))
        raw = np.concatenate([raw, np.zeros(lay.ref_blocks, bool)])
    vals = np.concatenate(blocks)
    xbits = np.zeros((len(vals), LANES), np.uint32)
    xbits[: lay.code_blocks] = xp.view(np.uint32).reshape(-1, LANES)
    w, data = pack_blocks(vals, raw, xbits)
    body = bytearray(lay.head())
    struct.pack_into("<I", body, lay.fields_at - 8 + 24, len(data))
    body += ebs.astype("<f8").tobytes()
    body += w.tobytes() + bytes(_up4(len(w)) - len(w))
    body += data
    words = np.frombuffer(bytes(body), "<u4")
    return MAGIC + bytes([FORMAT]) + struct.pack("<I", word_hash(words)) + bytes(body)


def decode_group(buf: np.ndarray) -> tuple[Layout, np.ndarray, np.ndarray]:
    """(layout, rows x D float32, bounds) of a format-3 payload; PayloadError if damaged."""
    lay, dlen, checksum = read_layout(buf)
    end = lay.data_at + dlen
    if dlen % 4 or end > buf.size:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than its {end} bytes")
    if word_hash(np.frombuffer(buf[8:end].tobytes(), "<u4")) != checksum:
        raise PayloadError("checksum mismatch: payload corrupted or truncated")
    k = len(lay.seg_rows)
    ebs = np.frombuffer(buf[lay.eb_at : lay.eb_at + 8 * k].tobytes(), "<f8")
    w = buf[lay.widths_at : lay.widths_at + lay.n_blocks].astype(np.int64)
    if ((w > 25) & (w != RAW)).any():
        raise PayloadError("block width out of range")
    size = np.where(w == RAW, 4 * LANES, 4 * w)
    if int(size.sum()) != dlen:
        raise PayloadError(f"blocks need {int(size.sum())} data bytes, header says {dlen}")
    words = np.frombuffer(buf[lay.data_at : end].tobytes(), "<u4")
    offs = np.concatenate([[0], np.cumsum(size // 4)])
    vals = np.zeros((lay.n_blocks, LANES), np.uint32)
    lane = np.arange(LANES, dtype=np.uint32)
    for i in np.flatnonzero(w):
        o = offs[i]
        if w[i] == RAW:
            vals[i] = words[o : o + LANES]
        else:
            for j in range(w[i]):
                vals[i] |= ((words[o + j] >> lane) & 1) << np.uint32(j)
    n, d, npad = lay.rows, lay.dim, lay.padded
    zz = vals[: lay.code_blocks].reshape(npad, d).astype(np.int64)
    q = (zz >> 1) ^ -(zz & 1)
    eb_row = np.repeat(np.append(ebs, 1.0), [*lay.seg_rows, npad - n])
    with np.errstate(all="ignore"):  # a damaged payload's bounds may be anything
        y = np.clip(q * (2.0 * eb_row)[:, None], -F32_MAX, F32_MAX).astype(np.float32)
    rawb = np.repeat(w[: lay.code_blocks] == RAW, LANES).reshape(npad, d)
    y[rawb] = vals[: lay.code_blocks].reshape(npad, d).view(np.float32)[rawb]
    if lay.dedup:
        ref = vals[lay.code_blocks :].reshape(-1)[:npad].astype(np.int64)
        src = np.arange(npad) - ref
        if (src < 0).any():
            raise PayloadError("row reference points before the payload's first row")
        y = y[src]
    return lay, y[:n], ebs.copy()
