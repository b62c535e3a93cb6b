"""The stages the hybrid codec chains: quantization, vector deduplication, integer packing.

Each stage is a pair of pure functions on torch tensors or numpy arrays, tested on its own
(tests/test_stages.py), so the codecs in :mod:`recsz.codecs.hybrid` only compose them.
Quantization and deduplication are torch operations and run on the tensor's device; the
packing stage is where bytes are made.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from recsz.codecs.base import PayloadError

#: Largest code magnitude. Values whose code would exceed it are carried as outliers.
QMAX = 2**30


# ---- quantization -------------------------------------------------------------------
def quantize(x: torch.Tensor, eb: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q = round(x / (2 eb)) and the flat positions that must travel exactly.

    Computed in float64, where x / (2 eb) and q * 2 eb are exact enough; the only way
    the reconstruction can still miss the bound is the final rounding to x's dtype (by an
    ulp), and those elements are found by checking and returned as outliers, so the bound
    holds for every element without exception.

    Args:
        x: finite (N, D) float tensor.
        eb: absolute error bound, > 0.
    Returns:
        codes (N, D) int64 (0 at outliers), outlier positions (K,) int64 into x.view(-1).
    """
    step = 2.0 * eb
    xd = x.double()
    q = torch.round(xd / step)
    big = ~(q.abs() <= QMAX)  # also catches inf from a denormal step
    q = torch.where(big, torch.zeros_like(q), q)
    y = dequantize(q, eb, x.dtype)
    bad = big | ((y.double() - xd).abs() > eb)
    q = torch.where(bad, torch.zeros_like(q), q)
    return q.to(torch.int64), torch.nonzero(bad.view(-1)).view(-1)


def dequantize(q: torch.Tensor, eb: float, dtype: torch.dtype) -> torch.Tensor:
    """x' = q * 2 eb, computed in float64 and rounded once to ``dtype`` (as the encoder did)."""
    return (q.double() * (2.0 * eb)).to(dtype)


# ---- vector deduplication ("vector LZ") -----------------------------------------------
def _row_hash(codes: torch.Tensor) -> torch.Tensor:
    d = codes.shape[1]
    g = torch.Generator().manual_seed(d)
    mult = (torch.randint(1, 2**62, (d,), generator=g, dtype=torch.int64) | 1).to(codes.device)
    return (codes * mult).sum(1)  # int64 arithmetic wraps: a 64-bit polynomial hash


def dedup_rows(codes: torch.Tensor) -> torch.Tensor:
    """For each row, 0 if it is sent literally, else 1 + the literal ordinal it repeats.

    A hash of each code row finds repeats anywhere in the chunk (the paper's sliding
    window holds only 32 vectors); every match is verified element by element, so a hash
    collision costs ratio, never correctness.
    """
    n = codes.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=codes.device)
    h = _row_hash(codes)
    _, inv = torch.unique(h, return_inverse=True)
    ar = torch.arange(n, device=codes.device)
    first = torch.full((int(inv.max()) + 1,), n, dtype=torch.int64, device=codes.device)
    first.scatter_reduce_(0, inv, ar, reduce="amin")
    rep = first[inv]
    same = (codes == codes[rep]).all(1)
    rep = torch.where(same, rep, ar)
    literal = rep == ar
    ordinal = torch.cumsum(literal, 0) - 1
    return torch.where(literal, torch.zeros_like(rep), ordinal[rep] + 1)


def undedup_rows(literals: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """Inverse of dedup_rows: (n_literal, D) literal rows + refs (N,) -> (N, D)."""
    literal = refs == 0
    n_lit = int(literal.sum())
    if n_lit != literals.shape[0]:
        raise PayloadError(f"{n_lit} literal rows flagged, {literals.shape[0]} present")
    src = torch.cumsum(literal, 0) - 1
    src = torch.where(literal, src, refs - 1)
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= max(n_lit, 1)):
        raise PayloadError("vector reference points past the literal rows")
    if n_lit == 0:
        return literals.new_zeros((refs.shape[0], literals.shape[1]))
    return literals[src]


# ---- integer packing and entropy coding ------------------------------------------------
def zigzag(q: torch.Tensor) -> torch.Tensor:
    """Signed -> unsigned with small magnitudes staying small: 0,-1,1,-2 -> 0,1,2,3."""
    return torch.where(q >= 0, q * 2, -q * 2 - 1)


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z % 2 == 0, z // 2, -(z + 1) // 2)


_PACK = struct.Struct("<BBQ")  # byte width, entropy mode, element count


def pack_uints(z: np.ndarray, entropy: bool, level: int = 3) -> bytes:
    """Non-negative ints -> narrowest width, split into byte planes, optionally zstd.

    Byte planes put the (mostly zero) high bytes together, which is what lets an entropy
    coder (zstd's Huffman/FSE stage) spend close to the codes' entropy. The plane layout
    is kept raw whenever zstd would not make it smaller.
    """
    n = int(z.size)
    top = int(z.max()) if n else 0
    width = 1 if top < 2**8 else 2 if top < 2**16 else 4 if top < 2**32 else 8
    planes = z.astype(f"<u{width}").view(np.uint8).reshape(n, width).T.tobytes()
    mode = 0
    if entropy and n:
        comp = zstandard.ZstdCompressor(level=level).compress(planes)
        if len(comp) < len(planes):
            planes, mode = comp, 1
    return _PACK.pack(width, mode, n) + planes


def unpack_uints(buf: np.ndarray) -> np.ndarray:
    """Inverse of pack_uints; (n,) int64."""
    if buf.size < _PACK.size:
        raise PayloadError("truncated integer block")
    width, mode, n = _PACK.unpack_from(buf, 0)
    if width not in (1, 2, 4, 8) or mode not in (0, 1):
        raise PayloadError(f"bad integer block header (width {width}, mode {mode})")
    data = buf[_PACK.size :].tobytes()
    if mode == 1:
        try:
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=n * width)
        except zstandard.ZstdError as e:
            raise PayloadError(f"entropy-coded block does not decode: {e}") from None
    if len(data) != n * width:
        raise PayloadError(f"integer block holds {len(data)} bytes, expected {n * width}")
    planes = np.frombuffer(data, np.uint8).reshape(width, n).T
    return np.ascontiguousarray(planes).view(f"<u{width}").reshape(n).astype(np.int64)
