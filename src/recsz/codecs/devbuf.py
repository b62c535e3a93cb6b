"""Bytes on a device: helpers for building and reading payloads without host copies.

Why: on a GPU every small host<->device copy stalls the host and every torch call costs a
launch, so payload assembly batches both: small host arrays go up in one copy
(:class:`Uploads`), payload pieces are joined by one concatenation (:class:`Pieces`), and
checksums are sums that a single reduction computes for many payloads at once.
"""

from __future__ import annotations

import numpy as np
import torch

_HASH_MUL = -7046029254386353131  # word_hash's weights: odd, position-dependent
_HASH_ADD = 0x632BE59BD9B4E019


def word_hash(t: torch.Tensor) -> torch.Tensor:
    """Checksum of a uint8 tensor, computed on its device: 4 bytes (uint8, same device).

    The bytes as little-endian u32 words (zero padded), each times an odd 64-bit weight
    that depends on its position, summed modulo 2^64 (plus the length) and folded to 32
    bits. Any change of one word changes the sum (an odd weight is invertible mod 2^64);
    words swapped or shifted change it with overwhelming probability. Integer arithmetic
    only, so every device computes the same value; unlike a CRC it is one parallel
    reduction. The one-region case of :func:`region_hashes`.
    """
    return region_hashes(t, [0], [t.numel()])[0]


def rep(counts: list[int], dev: torch.device) -> torch.Tensor:
    """[0]*c0 + [1]*c1 + ...: the owner of each element (sizes known: no sync)."""
    total = int(sum(counts))
    c = torch.tensor(counts, dtype=torch.int64).to(dev)
    return torch.repeat_interleave(torch.arange(len(counts), device=dev), c, output_size=total)


def nonzero_known(mask: torch.Tensor, size: int) -> torch.Tensor:
    """Flat positions of a mask whose count is already known on the host (no sync)."""
    return torch.nonzero_static(mask.reshape(-1), size=size).view(-1)


def excl(counts: list[int]) -> list[int]:
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


def u32_bytes(v: torch.Tensor) -> torch.Tensor:
    sh = torch.arange(0, 32, 8, device=v.device)
    return ((v.reshape(-1, 1) >> sh) & 255).to(torch.uint8).reshape(-1)


def from_le(b: torch.Tensor, w: int) -> torch.Tensor:
    sh = torch.arange(0, 8 * w, 8, device=b.device)
    return (b.reshape(-1, w).to(torch.int64) << sh).sum(1)


class Uploads:
    """Small host arrays bound for the device, sent in one copy (each copy from pageable
    memory stalls the host: tens of them a call add up)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.at: list[tuple[int, int]] = []
        self.n = 0
        self.dev: torch.Tensor | None = None

    def add(self, a: list[int] | list[float] | np.ndarray) -> int:
        v = np.asarray(a)
        v = v.view(np.int64) if v.dtype == np.float64 else v.astype(np.int64)
        self.parts.append(v.reshape(-1))
        self.at.append((self.n, v.size))
        self.n += v.size
        return len(self.at) - 1

    def send(self, dev: torch.device) -> Uploads:
        host = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        self.dev = torch.from_numpy(host).to(dev)
        return self

    def __getitem__(self, h: int) -> torch.Tensor:
        assert self.dev is not None
        o, n = self.at[h]
        return self.dev[o : o + n]

    def f64(self, h: int) -> torch.Tensor:
        return self[h].view(torch.float64)


def region_hashes(buf: torch.Tensor, begins: list[int], ends: list[int]) -> torch.Tensor:
    """:func:`word_hash` of buf[b:e] for every region, as (K, 4) uint8, in one pass: the
    sum taken byte by byte (a word times its weight is the sum of its bytes' shares)."""
    dev = buf.device
    k = len(begins)
    lens = [e - b for b, e in zip(begins, ends, strict=True)]
    owner = rep(lens, dev)
    base = torch.tensor(begins, dtype=torch.int64).to(dev)
    local = torch.arange(int(sum(lens)), device=dev) - torch.tensor(excl(lens)).to(dev)[owner]
    src = local + base[owner]
    words = (local >> 2) + 1
    contrib = (buf[src].to(torch.int64) << (8 * (local & 3))) * (words * _HASH_MUL + _HASH_ADD | 1)
    h = torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, owner, contrib)
    h += torch.tensor(lens, dtype=torch.int64).to(dev)
    fold = (h ^ (h >> 32)) & 0xFFFFFFFF
    sh = torch.arange(0, 32, 8, device=dev)
    return ((fold.view(k, 1) >> sh) & 255).to(torch.uint8)


class Pieces:
    """The payload bytes as a list of host bytes and device slices, joined at the end
    with one host-to-device copy and one concatenation."""

    def __init__(self) -> None:
        self.host = bytearray()
        self.parts: list[tuple[str, int, int] | torch.Tensor] = []

    def add_host(self, b: bytes) -> None:
        if b:
            self.parts.append(("h", len(self.host), len(b)))
            self.host += b

    def add(self, t: torch.Tensor) -> None:
        if t.numel():
            self.parts.append(t if t.dim() == 1 else t.reshape(-1))

    def join(self, dev: torch.device) -> torch.Tensor:
        h = torch.frombuffer(bytearray(self.host), dtype=torch.uint8).to(dev)
        ts = [h[p[1] : p[1] + p[2]] if isinstance(p, tuple) else p for p in self.parts]
        return torch.cat(ts) if ts else torch.empty(0, dtype=torch.uint8, device=dev)
