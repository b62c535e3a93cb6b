"""Canonical Huffman codes for byte planes: construction (host) and the stream format.

The coding itself runs where the tensor lives, in torch operations, batched over many
chunks (:mod:`recsz.codecs.device`), so coded data never visit the host. Why this design:
- Only the histogram (256 counts a plane) goes to the host, where the code lengths are
  built (a 256-symbol tree is sequential and tiny); code tables come back. The data
  itself is coded on its device: bit offsets are a cumulative sum of code lengths, and
  every code is added into 32-bit words at its offset (the codes' bits are disjoint, so
  an integer add is an OR and the result does not depend on the order of the adds).
- Decoding a prefix code is sequential in principle. Here it is made parallel by
  speculation: a (candidate) code is decoded at *every* bit position, which gives each
  position its successor; pointer doubling of that successor map then finds, for every
  symbol, where it starts, from the start of its block of ``2**LOG2_BLOCK`` symbols (the
  block start offsets travel in the stream: 4 bytes per block). The position that follows
  each block's last symbol must be the next block's start: that check rejects a damaged
  stream (beside the payload checksum).
- The same code runs on CPU tensors, so CI tests what a GPU runs; it writes the same
  bytes on every device (integer arithmetic only).

Stream layout (little endian)::

    u8 log2(block) | per plane: u8 kind [+ u8 value (CONST) | 128 B of 4-bit lengths, u32 bits
    (HUFF) | u8 m, m x (u8 symbol, u8 length), u32 bits (SPARSE: few symbols used)]
    | per plane data: RAW: n bytes; HUFF/SPARSE: u32 start bit of blocks 1.., u32 words
"""

from __future__ import annotations

import numpy as np

from recsz.codecs import kernels
from recsz.codecs.base import PayloadError

LOG2_BLOCK = 12
MAX_LEN = 12  # longest code: keeps the decoding table at 4096 entries
CONST, RAW, HUFF, SPARSE = 0, 1, 2, 3
_HUFF_META = 1 + 128 + 4
MAX_META = _HUFF_META  # SPARSE is used below 64 symbols, so it is never longer


# ---- code construction (host, 256 symbols) --------------------------------------------
def code_lengths(counts: np.ndarray, max_len: int = MAX_LEN) -> np.ndarray:
    """Huffman code lengths (0 for unused symbols) no longer than ``max_len``.

    Lengths over the limit are rare (they need counts spanning ~1:2^12); then counts are
    flattened (halved, kept >= 1) until the tree fits, a small, bounded loss.
    """
    c = counts.astype(np.int64)
    while True:
        lengths = kernels.huffman_depths(c)
        if int(lengths.max(initial=0)) <= max_len:
            return lengths
        c = np.where(c > 0, np.maximum(c >> 1, 1), 0)


def _kraft_ok(lengths: np.ndarray) -> bool:
    used = lengths[lengths > 0]
    if used.size < 2 or int(used.max()) > MAX_LEN:
        return False
    return int((1 << (MAX_LEN - used)).sum()) == 1 << MAX_LEN


def meta_size(head: np.ndarray, w: int) -> int:
    """Bytes of the stream's metadata, read from its first bytes (host copy)."""
    o = 1
    for _ in range(w):
        if o >= head.size:
            raise PayloadError("truncated Huffman stream metadata")
        kind = int(head[o])
        if kind == SPARSE:
            if o + 1 >= head.size:
                raise PayloadError("truncated Huffman stream metadata")
            o += 6 + 2 * int(head[o + 1])
        elif kind in (CONST, RAW, HUFF):
            o += {CONST: 2, RAW: 1, HUFF: _HUFF_META}[kind]
        else:
            raise PayloadError(f"unknown Huffman plane kind {kind}")
    if o > head.size:
        raise PayloadError("truncated Huffman stream metadata")
    return o
