"""Canonical Huffman coding of byte planes with torch operations: the entropy stage that
runs where the tensor lives (CUDA included), so coded data never visits the host.

Why this design:
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
import torch

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


_REV = np.array([int(f"{v:0{MAX_LEN}b}"[::-1], 2) for v in range(1 << MAX_LEN)], np.int64)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes for ``lengths``, bit-reversed (the stream is read LSB first).

    In (length, symbol) order each code is the Kraft sum of the codes before it, read at
    its own length: the usual "add one, shift left" recurrence, in closed form."""
    codes = np.zeros(lengths.size, np.int64)
    used = np.flatnonzero(lengths)
    if not used.size:
        return codes
    order = used[np.lexsort((used, lengths[used]))]
    ln = lengths[order]
    kraft = np.cumsum(1 << (MAX_LEN - ln)) - (1 << (MAX_LEN - ln))
    # The l-bit code c, bit-reversed, is the 12-bit reversal of c << (12 - l).
    codes[order] = _REV[kraft >> (MAX_LEN - ln) << (MAX_LEN - ln)]
    return codes


def _kraft_ok(lengths: np.ndarray) -> bool:
    used = lengths[lengths > 0]
    if used.size < 2 or int(used.max()) > MAX_LEN:
        return False
    return int((1 << (MAX_LEN - used)).sum()) == 1 << MAX_LEN


def _decode_table(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(symbol, length) for every ``L``-bit window, L the longest code."""
    top = int(lengths.max())
    codes = canonical_codes(lengths)
    sym = np.zeros(1 << top, np.int64)
    ln = np.zeros(1 << top, np.int64)
    for k in np.unique(lengths[lengths > 0]).tolist():
        syms = np.flatnonzero(lengths == k)
        idx = codes[syms, None] + (np.arange(1 << (top - k), dtype=np.int64) << k)[None, :]
        sym[idx] = syms[:, None]
        ln[idx] = k
    return sym, ln, top


def _host(b: bytes | bytearray, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device) if b else _empty(device)


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


def _u32_bytes(v: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 values < 2^32 -> their little-endian u32 bytes."""
    sh = torch.arange(0, 32, 8, device=v.device)
    return ((v.view(-1, 1) >> sh) & 255).to(torch.uint8).view(-1)


def _u32_values(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u32 bytes -> int64 values (no alignment needed, unlike a view)."""
    sh = torch.arange(0, 32, 8, device=b.device)
    return (b.view(-1, 4).to(torch.int64) << sh).sum(1)


# ---- encoding ---------------------------------------------------------------------------
def encode_planes(planes: torch.Tensor) -> torch.Tensor:
    """(w, n) uint8 byte planes on any device -> coded stream on the same device."""
    w, n = planes.shape
    dev = planes.device
    block = 1 << LOG2_BLOCK
    if n:
        key = planes.to(torch.int64) + 256 * torch.arange(w, device=dev).view(w, 1)
        hist = torch.bincount(key.view(-1), minlength=256 * w).view(w, 256).cpu().numpy()
    else:
        hist = np.zeros((w, 256), np.int64)
    meta = bytearray([LOG2_BLOCK])
    data: list[torch.Tensor] = []
    for k in range(w):
        h = hist[k]
        used = np.flatnonzero(h)
        if n and used.size == 1:
            meta += bytes([CONST, int(used[0])])
            continue
        lengths = code_lengths(h) if n else np.zeros(256, np.int64)
        nbits = int((h * lengths).sum())
        nblocks = -(-n // block)
        size = min(_HUFF_META, 6 + 2 * used.size) + 4 * (nblocks - 1) + 4 * -(-nbits // 32)
        if not n or size >= n + 1 or nbits >= 2**31:
            meta.append(RAW)
            data.append(planes[k])
            continue
        nib = lengths.astype(np.uint8)
        if used.size < 64:
            meta += bytes([SPARSE, used.size])
            meta += np.stack([used, lengths[used]], 1).astype(np.uint8).tobytes()
        else:
            meta.append(HUFF)
            meta += (nib[0::2] | (nib[1::2] << 4)).tobytes()
        meta += int(nbits).to_bytes(4, "little")
        tab = torch.from_numpy(np.stack([lengths, canonical_codes(lengths)])).to(dev)
        sym = planes[k].to(torch.int64)
        ln, code = tab[0][sym], tab[1][sym]
        off = torch.cumsum(ln, 0).sub_(ln)
        q, s = off >> 5, off & 31
        nw = -(-nbits // 32)
        words = torch.zeros(nw + 1, dtype=torch.int64, device=dev)
        words.index_add_(0, q, (code << s) & 0xFFFFFFFF)
        words.index_add_(0, q + 1, code >> (32 - s))
        data.append(_u32_bytes(off[block::block]))
        data.append(_u32_bytes(words[:nw]))
    return torch.cat([_host(meta, dev), *data])


# ---- decoding ---------------------------------------------------------------------------
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


def decode_planes(stream: torch.Tensor, head: np.ndarray, w: int, n: int) -> torch.Tensor:
    """Inverse of encode_planes: ``stream`` (uint8, any device) -> (w, n) uint8 planes.

    ``head``: host copy of at least the stream's metadata (``meta_size`` bytes).
    """
    dev = stream.device
    if head.size < 1 or int(head[0]) != LOG2_BLOCK:
        raise PayloadError("Huffman stream with an unknown block size")
    block = 1 << LOG2_BLOCK
    nblocks = -(-n // block)
    o = 1
    p = meta_size(head, w)
    out = torch.empty((w, n), dtype=torch.uint8, device=dev)
    for k in range(w):
        kind = int(head[o])
        if kind == CONST:
            out[k] = int(head[o + 1])
            o += 2
        elif kind == RAW:
            o += 1
            if p + n > stream.numel():
                raise PayloadError("raw plane runs past the Huffman stream")
            out[k] = stream[p : p + n]
            p += n
        else:
            lengths = np.zeros(256, np.int64)
            if kind == HUFF:
                nib = head[o + 1 : o + 129]
                lengths[0::2], lengths[1::2] = nib & 15, nib >> 4
                o += 129
            else:
                m = int(head[o + 1])
                pairs = head[o + 2 : o + 2 + 2 * m].reshape(m, 2).astype(np.int64)
                if np.unique(pairs[:, 0]).size != m:
                    raise PayloadError("Huffman plane lists a symbol twice")
                lengths[pairs[:, 0]] = pairs[:, 1]
                o += 2 + 2 * m
            nbits = int.from_bytes(head[o : o + 4].tobytes(), "little")
            o += 4
            if not _kraft_ok(lengths) or nbits > n * MAX_LEN:
                raise PayloadError("Huffman plane with an invalid code")
            nw = -(-nbits // 32)
            size = 4 * (nblocks - 1) + 4 * nw
            if p + size > stream.numel():
                raise PayloadError("Huffman plane runs past its stream")
            starts = _u32_values(stream[p : p + 4 * (nblocks - 1)])
            words = _u32_values(stream[p + 4 * (nblocks - 1) : p + size])
            p += size
            out[k] = _decode_bits(words, starts, nbits, n, lengths)
    if p != stream.numel():
        raise PayloadError(f"{stream.numel() - p} stray bytes after a Huffman stream")
    return out


def _decode_bits(
    words: torch.Tensor, starts: torch.Tensor, nbits: int, n: int, lengths: np.ndarray
) -> torch.Tensor:
    dev = words.device
    dsym, dlen, top = _decode_table(lengths)
    tab = torch.from_numpy(np.stack([dsym, dlen])).to(dev)
    w = torch.cat([words, words.new_zeros(2)])
    pos = torch.arange(nbits + 2, device=dev)
    q, s = pos >> 5, pos & 31
    window = ((w[q] | (w[q + 1] << 32)) >> s) & ((1 << top) - 1)
    del q, s
    ln = tab[1][window]
    # Successor of every bit position; nbits is the end, nbits + 1 a sink for errors.
    nxt = pos + ln
    nxt = torch.where((ln == 0) | (nxt > nbits), nbits + 1, nxt)
    nxt[nbits:] = pos[nbits:]
    jumps = [nxt]  # jumps[k] = successor applied 2^k times
    for _ in range(LOG2_BLOCK - 1):
        jumps.append(jumps[-1][jumps[-1]])
    block = 1 << LOG2_BLOCK
    begin = torch.cat([starts.new_zeros(1), starts])
    ends = torch.cat([starts, starts.new_full((1,), nbits)])
    nb = begin.numel()
    # Expand each block start into the starts of its symbols, coarse to fine: the offsets
    # held are multiples of 2^(k+1); each gains its successor 2^k symbols on. Indices are
    # clamped first: a damaged offset must fail the check below, not index out of bounds.
    at = begin.clamp(0, nbits + 1).view(nb, 1)
    for k in reversed(range(LOG2_BLOCK)):
        at = torch.stack([at, jumps[k][at]], dim=2).view(nb, -1)
    at = at.view(-1)
    last = torch.arange(nb, device=dev) * block + torch.full((nb,), block - 1, device=dev)
    last[-1] = n - 1
    ok = (
        (nxt[at[last]] == ends).all()
        & (at[:n] < nbits).all()
        & (begin <= nbits).all()
        & (ends >= begin).all()
    )
    if not bool(ok):  # the one synchronization of a plane's decoding
        raise PayloadError("Huffman plane does not decode to its symbol count")
    return tab[0][window[at[:n]]].to(torch.uint8)
