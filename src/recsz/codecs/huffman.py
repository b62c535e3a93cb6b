"""Canonical Huffman codes for byte planes: construction (host) and the stream format.

The coding itself runs where the tensor lives, in torch operations batched over many
planes (:func:`pack_bits`, :func:`decode_planes`), so coded data never visit the host.
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

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from recsz.codecs.devbuf import Uploads, excl, from_le, nonzero_known
from recsz.codecs.payload import PayloadError

LOG2_BLOCK = 12
MAX_LEN = 12  # longest code: keeps the decoding table at 4096 entries
CONST, RAW, HUFF, SPARSE = 0, 1, 2, 3
_HUFF_META = 1 + 128 + 4
MAX_META = _HUFF_META  # SPARSE is used below 64 symbols, so it is never longer


# ---- code construction (host, 256 symbols) --------------------------------------------
@njit(cache=True, nogil=True)
def huffman_depths(counts: np.ndarray) -> np.ndarray:
    """Unlimited Huffman code lengths of the symbols with counts > 0 (0 elsewhere).

    Two-queue construction over the counts sorted once: leaves and merged nodes each come
    out in non-decreasing weight, so the two smallest are always at the queue heads."""
    used = np.flatnonzero(counts)
    m = used.size
    depth = np.zeros(counts.size, np.int64)
    if m < 2:
        if m == 1:
            depth[used[0]] = 1
        return depth
    order = used[np.argsort(counts[used], kind="mergesort")]
    w = np.empty(2 * m - 1, np.int64)
    parent = np.zeros(2 * m - 1, np.int64)
    for i in range(m):
        w[i] = counts[order[i]]
    leaf, node, nxt = 0, m, m
    for _ in range(m - 1):
        pick = np.empty(2, np.int64)
        for k in range(2):
            if leaf < m and (node >= nxt or w[leaf] <= w[node]):
                pick[k] = leaf
                leaf += 1
            else:
                pick[k] = node
                node += 1
        w[nxt] = w[pick[0]] + w[pick[1]]
        parent[pick[0]] = nxt
        parent[pick[1]] = nxt
        nxt += 1
    d = np.zeros(2 * m - 1, np.int64)
    for i in range(2 * m - 3, -1, -1):  # the root (last node) has depth 0
        d[i] = d[parent[i]] + 1
    for i in range(m):
        depth[order[i]] = d[i]
    return depth


@njit(cache=True, nogil=True)
def canonical_codes_many(lengths: np.ndarray) -> np.ndarray:
    """(S, 256) code lengths -> (S, 256) canonical codes, bit-reversed (LSB-first streams).

    Codes are handed out in (length, symbol) order, each one more than the last and
    shifted left where the length grows: the canonical assignment (RFC 1951, 3.2.2)."""
    out = np.zeros(lengths.shape, np.int64)
    for s in range(lengths.shape[0]):
        code = 0
        prev = 0
        for ln in range(1, 16):
            for sym in range(lengths.shape[1]):
                if lengths[s, sym] != ln:
                    continue
                code <<= ln - prev
                prev = ln
                r, c = 0, code
                for _ in range(ln):
                    r = (r << 1) | (c & 1)
                    c >>= 1
                out[s, sym] = r
                code += 1
    return out


@njit(cache=True, nogil=True)
def decode_tables(lengths: np.ndarray, codes: np.ndarray, bits: int) -> np.ndarray:
    """(S, 2, 2^bits): the symbol and the code length for every ``bits``-bit window
    (LSB first) of each of S codes: a window starts with exactly one code."""
    out = np.zeros((lengths.shape[0], 2, 1 << bits), np.int64)
    for s in range(lengths.shape[0]):
        for sym in range(lengths.shape[1]):
            ln = lengths[s, sym]
            if ln == 0:
                continue
            for t in range(codes[s, sym], 1 << bits, 1 << ln):
                out[s, 0, t] = sym
                out[s, 1, t] = ln
    return out


def code_lengths(counts: np.ndarray, max_len: int = MAX_LEN) -> np.ndarray:
    """Huffman code lengths (0 for unused symbols) no longer than ``max_len``.

    Lengths over the limit are rare (they need counts spanning ~1:2^12); then counts are
    flattened (halved, kept >= 1) until the tree fits, a small, bounded loss.
    """
    c = counts.astype(np.int64)
    while True:
        lengths = huffman_depths(c)
        if int(lengths.max(initial=0)) <= max_len:
            return lengths
        c = np.where(c > 0, np.maximum(c >> 1, 1), 0)


def _kraft_ok(lengths: np.ndarray) -> bool:
    used = lengths[lengths > 0]
    if used.size < 2 or int(used.max()) > MAX_LEN:
        return False
    return int((1 << (MAX_LEN - used)).sum()) == 1 << MAX_LEN


@dataclass
class PlaneMeta:
    """One byte plane's entry in a stream's metadata."""

    kind: int  # CONST, RAW or HUFF (SPARSE entries are read as HUFF)
    value: int = 0  # CONST: the byte
    lengths: np.ndarray | None = None  # HUFF: code length of each byte value
    nbits: int = 0  # HUFF: coded bits


def read_meta(meta: np.ndarray, w: int) -> tuple[list[PlaneMeta], int]:
    """The ``w`` planes' entries of a stream's metadata (a host copy of its first bytes),
    checked, and the metadata's length (where the planes' data begins)."""
    if meta.size < 1 or int(meta[0]) != LOG2_BLOCK:
        raise PayloadError("Huffman stream with an unknown block size")
    out, o = [], 1
    for _ in range(w):
        kind = int(meta[o]) if o < meta.size else -1
        if kind == SPARSE:
            size = 6 + 2 * int(meta[o + 1]) if o + 1 < meta.size else meta.size
        else:
            size = {CONST: 2, RAW: 1, HUFF: _HUFF_META}.get(kind, 0)
        if kind == -1 or o + size > meta.size:
            raise PayloadError("truncated Huffman stream metadata")
        if kind == CONST:
            out.append(PlaneMeta(CONST, value=int(meta[o + 1])))
        elif kind == RAW:
            out.append(PlaneMeta(RAW))
        elif kind in (HUFF, SPARSE):
            lengths = np.zeros(256, np.int64)
            if kind == HUFF:
                nib = meta[o + 1 : o + 129]
                lengths[0::2], lengths[1::2] = nib & 15, nib >> 4
            else:
                m = int(meta[o + 1])
                pairs = meta[o + 2 : o + 2 + 2 * m].reshape(m, 2).astype(np.int64)
                if np.unique(pairs[:, 0]).size != m:
                    raise PayloadError("Huffman plane lists a symbol twice")
                lengths[pairs[:, 0]] = pairs[:, 1]
            nbits = int.from_bytes(meta[o + size - 4 : o + size].tobytes(), "little")
            if not _kraft_ok(lengths):
                raise PayloadError("Huffman plane with an invalid code")
            out.append(PlaneMeta(HUFF, lengths=lengths, nbits=nbits))
        else:
            raise PayloadError(f"unknown Huffman plane kind {kind}")
        o += size
    return out, o


# ---- coding on the device (batched over planes) -----------------------------------
def pack_bits(
    sym: torch.Tensor,
    owner: torch.Tensor,
    lengths: np.ndarray,
    base: np.ndarray,
    block_idx: list[int],
    n_words: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Code many planes at once: all their codes added into one word array.

    Args:
        sym: (M,) byte symbols of all planes, plane after plane, on the device.
        owner: (M,) the plane of each symbol.
        lengths: (S, 256) code lengths of each plane (all 0 for a plane coded otherwise).
        base: (S, 2) first bit of each plane's words in the word array, and the total
            code length of the planes before it.
        block_idx: positions in ``sym`` that start a block (after each plane's first).
        n_words: 32-bit words of all planes together.
    Returns:
        (n_words,) int64 words (u32 values, LSB first), and the bit offset of each block
        start inside its plane.
    """
    dev = sym.device
    up = Uploads()
    h_tab = up.add(np.stack([lengths, canonical_codes_many(lengths)], 1))
    h_base = up.add(base)
    h_bidx = up.add(block_idx)
    up.send(dev)
    tab = up[h_tab].view(-1, 2, 256)
    base_t = up[h_base].view(-1, 2)
    ln = tab[owner, 0, sym]
    code = tab[owner, 1, sym]
    off = torch.cumsum(ln, 0).sub_(ln) - base_t[owner, 1]  # bit offset inside the plane
    pos = off + base_t[owner, 0]
    q, sh = pos >> 5, pos & 31
    words = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)
    words.index_add_(0, q, (code << sh) & 0xFFFFFFFF)
    words.index_add_(0, q + 1, code >> (32 - sh))
    return words[:n_words], off[up[h_bidx]]


def decode_planes(
    words: list[torch.Tensor],
    stored: list[torch.Tensor],
    lengths: np.ndarray,
    nbits: list[int],
    counts: list[int],
) -> torch.Tensor:
    """Decode many Huffman-coded planes at once, by speculation.

    Args:
        words: each plane's coded words, as bytes (u32 little endian) on the device.
        stored: each plane's stored block starts (u32 bytes, blocks 1..).
        lengths: (S, 256) code lengths; nbits / counts: bits and symbols of each plane.
    Returns:
        (sum(counts),) uint8 symbols, plane after plane.

    Each plane's words are followed by one zero word, so that its end is a bit position of
    its own (a fixed point of the successor map); the last position is a sink that every
    invalid code and overrun leads to. Raises PayloadError when a plane does not decode to
    its symbol count.
    """
    dev = words[0].device
    block = 1 << LOG2_BLOCK
    nseg = len(counts)
    nw = [w.numel() // 4 for w in words]
    tab = decode_tables(lengths, canonical_codes_many(lengths), MAX_LEN)
    wbase = excl([w + 1 for w in nw])
    acc = wbase[-1] + nw[-1] + 1
    sink = 32 * acc
    nbs = [-(-n // block) for n in counts]
    up = Uploads()
    h_tab = up.add(tab)
    h_bits = up.add([32 * (w + 1) for w in nw] + [1])
    h_gbase = up.add([32 * w for w in wbase])
    h_ends = up.add([32 * w + b for w, b in zip(wbase, nbits, strict=True)])
    h_nbs = up.add(nbs)
    h_first = up.add(excl(nbs))
    h_last = up.add(np.cumsum(nbs) - 1)
    h_counts = up.add(counts)
    h_cbase = up.add(excl(counts))
    h_inblock = up.add(
        [min(block, n - b * block) for n, nb in zip(counts, nbs, strict=True) for b in range(nb)]
    )
    up.send(dev)
    tab_t = up[h_tab].view(nseg, 2, 1 << MAX_LEN)
    zero4 = torch.zeros(4, dtype=torch.uint8, device=dev)
    pieces = [p for w in words for p in (w, zero4)]
    all_words = torch.cat(
        [from_le(torch.cat(pieces), 4), torch.zeros(1, dtype=torch.int64, device=dev)]
    )
    pos = torch.arange(sink + 1, device=dev)
    owner = torch.repeat_interleave(
        torch.arange(nseg + 1, device=dev), up[h_bits], output_size=sink + 1
    ).clamp_(max=nseg - 1)
    ends = up[h_ends]
    qq = (pos >> 5).clamp_(max=all_words.numel() - 2)
    window = ((all_words[qq] | (all_words[qq + 1] << 32)) >> (pos & 31)) & ((1 << MAX_LEN) - 1)
    ln = tab_t[owner, 1, window]
    end_p = ends[owner]
    nxt = pos + ln
    nxt = torch.where((ln == 0) | (nxt > end_p) | (pos >= end_p), sink, nxt)
    nxt = torch.where(pos == end_p, pos, nxt)
    nxt[sink] = sink
    jumps = [nxt]
    for _ in range(LOG2_BLOCK - 1):
        jumps.append(jumps[-1][jumps[-1]])
    # Block starts: 0 and the stored offsets, each plus its segment's first bit.
    nb_total = sum(nbs)
    blk_owner = torch.repeat_interleave(
        torch.arange(nseg, device=dev), up[h_nbs], output_size=nb_total
    )
    begin_local = torch.zeros(nb_total, dtype=torch.int64, device=dev)
    if nb_total > nseg:
        later = torch.ones(nb_total, dtype=torch.bool, device=dev)
        later[up[h_first]] = False
        begin_local[nonzero_known(later, nb_total - nseg)] = from_le(torch.cat(stored), 4)
    begin = begin_local + up[h_gbase][blk_owner]
    seg_end = ends[blk_owner]
    is_last = torch.zeros(nb_total, dtype=torch.bool, device=dev)
    is_last[up[h_last]] = True
    block_end = torch.where(is_last, seg_end, torch.cat([begin[1:], begin.new_zeros(1)]))
    at = begin.clamp(0, sink).view(-1, 1)
    for lvl in reversed(range(LOG2_BLOCK)):
        at = torch.stack([at, jumps[lvl][at]], dim=2).view(at.shape[0], -1)
    at = at.view(-1)
    # Symbol i of segment s sits at its block row, column i % block.
    total = sum(counts)
    sym_owner = torch.repeat_interleave(
        torch.arange(nseg, device=dev), up[h_counts], output_size=total
    )
    flat = torch.arange(total, device=dev) - up[h_cbase][sym_owner] + up[h_first][sym_owner] * block
    sym_pos = at[flat]
    last_sym = at[torch.arange(nb_total, device=dev) * block + up[h_inblock] - 1]
    ok = (
        (nxt[last_sym] == block_end).all()
        & (sym_pos < ends[sym_owner]).all()
        & (begin <= seg_end).all()
        & (block_end >= begin).all()
    )
    if not bool(ok):  # the one synchronization of all the Huffman decoding
        raise PayloadError("Huffman plane does not decode to its symbol count")
    return tab_t[sym_owner, 0, window[sym_pos]].to(torch.uint8)
