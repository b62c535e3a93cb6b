"""Format 3: fixed-length bit-plane blocks, one payload per group of tables.

A payload holds one *group*: the rows of K tables (segments) of width D, each segment
under its own absolute bound. It is laid out so that every part of it can be found and
written in parallel (:mod:`recsz.codecs.blockcoder` makes it on a GPU with a few Triton
kernels and no host sync); :mod:`recsz.codecs.blockcpu` writes and reads the same bytes on
the CPU (compiled loops), so CPU and GPU ranks exchange payloads and CI checks the kernels
byte for byte; ``tests/blockref.py`` is the plain numpy reference both are held to. This
module holds what they share: the layout, its header and the checksum.

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
from numba import njit

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
    return int(_word_hash(np.ascontiguousarray(words, dtype=np.uint32), first))


@njit(cache=True, nogil=True)
def _word_hash(words, first):
    s = np.uint64(0)
    for i in range(words.size):
        s += np.uint64(words[i]) * np.uint64(2 * (first + i) + 1)
    return s & np.uint64(MASK32)


def read_layout(buf: np.ndarray) -> tuple[Layout, int, int, int]:
    """(layout, L, data_len, stored checksum) from a payload's first bytes (host)."""
    b = np.ascontiguousarray(buf, dtype=np.uint8).data  # a view: no copy of the data
    try:
        magic, ver, checksum = struct.unpack_from("<3sBI", b, 0)
        if magic != MAGIC or ver != FORMAT:
            raise PayloadError(f"not a format-{FORMAT} payload")
        clen = b[8]
        codec = b[9 : 9 + clen].tobytes().decode("ascii")
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


def pieces(lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Each padded row's piece (segment, or K for the pad rows) and each piece's first row."""
    counts = [*lay.seg_rows, lay.padded - lay.rows]
    first = np.concatenate([[0], np.cumsum(counts)])[:-1]
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts), first
