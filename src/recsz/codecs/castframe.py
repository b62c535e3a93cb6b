"""Format 4: the casts' payloads (``none``, ``fp16``, ``bf16``) made where the tensor lives,
by torch operations, with no host sync.

A group of tables is one body: the codec's bytes of all its rows (casts code each value on
its own, so tables need no boundaries). Every size follows from the shapes, so nothing is
read from the device, and NaN and +-Inf travel in the body itself (float32, float16 and
bfloat16 hold them; finite values beyond fp16's range saturate). The same code runs on the
CPU, so both write the same bytes. Layout (little endian)::

    "RSZ" | 4 | u32 checksum of every word after these 8 bytes (as format 3's)
    u8 len(codec id) | codec id | zeros to a multiple of 4
    u32 dtype code, D, N | body: N x D values | zeros to a multiple of 4
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import torch

from recsz.codecs import blockformat as bf
from recsz.codecs import blockplan as bp
from recsz.codecs.checks import verdict
from recsz.codecs.payload import DTYPE_BY_CODE, DTYPES, MAGIC, PayloadError, constant

FORMAT = 4
_FIELDS = struct.Struct("<3I")

Body = Callable[[torch.Tensor], torch.Tensor]
Unbody = Callable[[torch.Tensor, tuple[int, ...], torch.dtype, float], torch.Tensor]


def _head(codec: str, dtype: torch.dtype, n: int, d: int) -> bytes:
    """Everything before the body, the checksum zero."""
    cid = codec.encode("ascii")
    pre = bytes([len(cid)]) + cid
    pre += bytes(-len(pre) % 4)
    return MAGIC + bytes([FORMAT, 0, 0, 0, 0]) + pre + _FIELDS.pack(DTYPES[dtype], d, n)


def nbytes(codec: str, dtype: torch.dtype, n: int, d: int, width: int) -> int:
    """The length of a payload of ``n`` x ``d`` values of ``dtype``, ``width`` bytes each
    in the body: the layout follows from the shapes."""
    return _padded(len(_head(codec, dtype, n, d)) + n * d * width)


def _padded(size: int) -> int:
    """A payload's length: its bytes, then zeros to a multiple of 4."""
    return size + (-size % 4)


def _checksums(buf: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
    """Each payload's checksum (format 3's: words from its byte 8 to its end)."""
    first = [(s + 8) // 4 for s in starts]
    lens = [e // 4 - f for f, e in zip(first, ends, strict=True)]
    first_t, lens_t = _const(np.array([first, lens], np.int64), buf.device)
    return bp.span_sums(buf.view(torch.int32), first_t, lens_t, max(lens, default=0))


def _const(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    return constant(a, torch.uint8 if a.dtype == np.uint8 else torch.int64, dev)


def encode(
    codec: str, body: Body, groups: list[tuple[torch.Tensor, list[int]]]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One format-4 payload per group (its rows, all tables), and their lengths."""
    dev = groups[0][0].device
    heads, bodies, starts, ends, at = [], [], [], [], 0
    for rows, _ in groups:
        n, d = rows.shape
        h = _head(codec, rows.dtype, n, d)
        core = body(rows.detach().contiguous()).view(-1)
        pad = -(len(h) + core.numel()) % 4
        heads.append(h)
        bodies.append((core, pad))
        starts.append(at)
        at += len(h) + core.numel() + pad
        ends.append(at)
    head_t = _const(np.frombuffer(b"".join(heads), np.uint8), dev)
    pieces, o = [], 0
    for h, (core, pad) in zip(heads, bodies, strict=True):
        pieces += [head_t[o : o + len(h)], core, core.new_zeros(pad)]
        o += len(h)
    buf = torch.cat(pieces)
    sums = _checksums(buf, starts, ends)
    pos = _const(np.concatenate([np.arange(s + 4, s + 8) for s in starts]), dev)
    buf[pos] = bp.as_u32(sums).view(torch.uint8)
    lens = [e - s for s, e in zip(starts, ends, strict=True)]
    return [buf[s:e] for s, e in zip(starts, ends, strict=True)], torch.tensor(lens)


def read_header(p: torch.Tensor) -> tuple[str, torch.dtype, int, int, int]:
    """(codec id, dtype, N, D, body offset) from a payload's first bytes (host)."""
    raw = p[:300].cpu().numpy().tobytes()
    try:
        if raw[:3] != MAGIC or raw[3] != FORMAT:
            raise PayloadError(f"not a format-{FORMAT} payload")
        clen = raw[8]
        codec = raw[9 : 9 + clen].decode("ascii")
        at = 9 + clen + (-(1 + clen) % 4)
        dcode, d, n = _FIELDS.unpack_from(raw, at)
    except (IndexError, struct.error, UnicodeDecodeError) as e:
        raise PayloadError(f"malformed format-{FORMAT} header: {e}") from None
    if dcode not in DTYPE_BY_CODE:
        raise PayloadError(f"unknown dtype code {dcode}")
    return codec, DTYPE_BY_CODE[dcode], n, d, at + _FIELDS.size


def decode(
    codec: str,
    unbody: Unbody,
    itemsize: Callable[[torch.dtype], int],
    payloads: list[torch.Tensor],
    expect: list[tuple[int, int]] | None = None,
    check: bool = True,
) -> list[torch.Tensor]:
    """The rows of each payload; ``expect``: (N, D) of each (float32; then no header is
    read on the host, a payload that differs fails its checks)."""
    out, starts, ends, heads, got = [], [], [], [], []
    at = 0
    for i, p in enumerate(payloads):
        if expect is None:
            cid, dtype, n, d, _ = read_header(p)
            if cid != codec:
                raise PayloadError(f"payload {i} was made by codec {cid!r}, not {codec!r}")
        else:
            (n, d), dtype = expect[i], torch.float32
        h, body = _head(codec, dtype, n, d), n * d * itemsize(dtype)
        size = _padded(len(h) + body)
        if p.numel() != size:
            raise PayloadError(f"payload {i}: {p.numel()} bytes, its shape needs {size}")
        out.append(unbody(p[len(h) : len(h) + body], (n, d), dtype, 0.0))
        heads.append(np.frombuffer(h, np.uint8))
        starts.append(at)
        at += p.numel()
        ends.append(at)
        got.append(p)
    if check and payloads:
        buf = torch.cat(got)
        dev = buf.device
        sums = _checksums(buf, starts, ends)
        ck = _const(np.concatenate([np.arange(s + 4, s + 8) for s in starts]), dev)
        stored = buf[ck].view(torch.int32).to(torch.int64) & bf.MASK32
        keep = np.concatenate(
            [np.r_[0:4, 8 : h.size] + s for h, s in zip(heads, starts, strict=True)]
        )
        want = np.concatenate([h[np.r_[0:4, 8 : h.size]] for h in heads])
        same = buf[_const(keep.astype(np.int64), dev)] == _const(want, dev)
        ok = ((sums == stored).all() & same.all()).view(1)
        verdict(ok, lambda _: f"format-{FORMAT} payload corrupted or truncated (checks failed)")
    return out
