"""Device-made (format 2) payloads, many at a time: framing and parsing shared by every
codec with a device path.

The codec supplies its core bytes (host-made headers and device tensors) and outliers; the
frame around them (the layout of :mod:`recsz.codecs.payload`, checksummed with
:func:`recsz.codecs.devbuf.region_hashes`) is made with one host-to-device copy and one
concatenation, and read back with one small device-to-host copy for all payloads (more
rounds only when a parser asks for bytes beyond the first window).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recsz.codecs.devbuf import Pieces, excl, from_le, region_hashes
from recsz.codecs.payload import (
    DEVICE_FORMAT,
    MAGIC,
    PREFIX,
    PayloadError,
    parse_header,
    read_uvarint,
    uvarint,
)

_DEVICE_HEAD = 512  # bytes of each payload copied to the host in the first round


@dataclass
class Frame:
    """Where one device-made payload's parts lie (offsets into its payload)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    eb: float
    base: int  # the payload's offset in the batch buffer
    core: tuple[int, int]  # (offset, length)
    oidx: tuple[int, int]
    oval: tuple[int, int]
    ow: int  # width of an outlier position (4 or 8); 0 without outliers

    @property
    def n_outliers(self) -> int:
        return self.oval[1] // 8


class HostWindows:
    """Host copies of parts of one payload: the first window, then what parsers fetch."""

    def __init__(self, head: np.ndarray, size: int) -> None:
        self.windows = [(0, head)]
        self.size = size

    def get(self, o: int, n: int) -> np.ndarray | None:
        """Bytes [o, o + n) (fewer at the payload's end), or None if not fetched yet."""
        n = min(n, self.size - o)
        for s, w in self.windows:
            if s <= o and o + n <= s + w.size:
                return w[o - s : o - s + n]
        return None


def fetch_windows(
    payloads: list[torch.Tensor], readers: list[HostWindows], need: list[tuple[int, int, int]]
) -> None:
    """Copy the windows (payload, offset, length) to the host, all in one copy."""
    if any(o >= readers[c].size for c, o, _ in need):
        raise PayloadError("payload metadata runs past the payload")
    extra = torch.cat([payloads[c][o : o + n] for c, o, n in need]).cpu().numpy()
    p = 0
    for c, o, n in need:
        n = min(n, readers[c].size - o)
        readers[c].windows.append((o, extra[p : p + n]))
        p += n


def frame_device(
    codec: Any,
    dtype: torch.dtype,
    shapes: list[tuple[int, ...]],
    ebs: list[float],
    cores: list[list[bytes | torch.Tensor]],
    outliers: list[tuple[torch.Tensor, torch.Tensor] | None],
    dev: torch.device,
) -> list[torch.Tensor]:
    """Format-2 payloads around each chunk's core (host bytes and uint8 device tensors) and
    outliers ((k, 8) little-endian int64 positions, (k, 8) float64 values, as bytes)."""
    pieces = Pieces()
    bounds: list[tuple[int, int]] = []
    total = 0
    for shape, eb, core, out in zip(shapes, ebs, cores, outliers, strict=True):
        core_len = sum(len(b) if isinstance(b, bytes) else b.numel() for b in core)
        n_out = int(out[0].shape[0]) if out is not None else 0
        pw = 8 if math.prod(shape) >= 2**32 else 4  # from the shape: no look at the data
        oidx_len = 1 + pw * n_out if n_out else 0
        table = bytes([3]) + uvarint(core_len) + uvarint(oidx_len) + uvarint(8 * n_out)
        body_len = len(table) + core_len + oidx_len + 8 * n_out
        hdr = codec._header_fields(torch.Size(shape), dtype, eb, body_len)
        start = total
        pieces.add_host(MAGIC + bytes([DEVICE_FORMAT, 0, 0, 0, 0]) + hdr + table)
        for b in core:
            if isinstance(b, bytes):
                pieces.add_host(b)
            else:
                pieces.add(b)
        if out is not None and n_out:
            pieces.add_host(bytes([pw]))
            pieces.add(out[0][:, :pw])
            pieces.add(out[1])
        total += 8 + len(hdr) + body_len
        bounds.append((start, total))
    buf = pieces.join(dev)
    starts = [b[0] for b in bounds]
    h = region_hashes(buf, [a + PREFIX.size for a in starts], [b[1] for b in bounds])
    at = (torch.tensor(starts, dtype=torch.int64).view(-1, 1) + torch.arange(4, 8)).to(dev)
    buf[at.view(-1)] = h.view(-1)
    return [buf[a:b] for a, b in bounds]


def outlier_bytes(
    flat: torch.Tensor, pos: torch.Tensor, stored: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact values of ``flat`` at ``pos`` and the positions to store for them
    (``stored``, e.g. positions inside each chunk; ``pos`` itself by default), as (k, 8)
    byte rows: little-endian int64 positions, float64 values."""
    val = flat[pos].to(torch.float64)
    val = val.masked_fill(val.isnan(), float("nan"))  # CUDA and CPU widen NaN differently
    at = pos if stored is None else stored
    return (
        at.to(torch.int64).contiguous().view(torch.uint8).view(-1, 8),
        val.contiguous().view(torch.uint8).view(-1, 8),
    )


def open_device(
    codec: Any, payloads: list[torch.Tensor]
) -> tuple[torch.Tensor, list[Frame], list[HostWindows]]:
    """Check and parse device-made payloads of ``codec``: the batch buffer (all payloads
    end to end), each one's frame, and its host windows (for the codec's own parsing)."""
    k = len(payloads)
    sizes = [int(p.numel()) for p in payloads]
    buf = torch.cat(payloads) if k > 1 else payloads[0]
    starts = excl(sizes)
    heads = torch.cat([p[:_DEVICE_HEAD] for p in payloads]).cpu().numpy()
    readers, o = [], 0
    for sz in sizes:
        n = min(sz, _DEVICE_HEAD)
        readers.append(HostWindows(heads[o : o + n], sz))
        o += n
    for sz, r in zip(sizes, readers, strict=True):
        head = r.get(0, 8)
        if sz < PREFIX.size or head is None:
            raise PayloadError(f"payload of {sz} bytes is shorter than the fixed prefix")
        if head[:3].tobytes() != MAGIC or int(head[3]) != DEVICE_FORMAT:
            raise PayloadError("not a device-made (format 2) recsz payload")
    ends = [s + z for s, z in zip(starts, sizes, strict=True)]
    got = region_hashes(buf, [s + PREFIX.size for s in starts], ends).cpu().numpy()
    for c, r in enumerate(readers):
        want = r.get(4, 4)
        if want is None or not np.array_equal(got[c], want):
            raise PayloadError("checksum mismatch: payload corrupted or truncated")
    for _ in range(3):
        need: list[tuple[int, int, int]] = []
        frames = [_frame(codec, c, readers[c], starts[c], need) for c in range(k)]
        if not need:
            return buf, [f for f in frames if f is not None], readers
        fetch_windows(payloads, readers, need)
    raise PayloadError("payload header too long to parse")


def _frame(
    codec: Any, c: int, r: HostWindows, base: int, need: list[tuple[int, int, int]]
) -> Frame | None:
    rest = r.get(PREFIX.size, _DEVICE_HEAD - PREFIX.size)
    assert rest is not None
    fields, o = parse_header(rest)
    o += PREFIX.size
    if fields.codec != codec.codec_id:
        raise PayloadError(f"payload was made by codec {fields.codec!r}, not {codec.codec_id!r}")
    if fields.body_len != r.size - o:
        raise PayloadError(
            f"body is {r.size - o} bytes, header says {fields.body_len}: truncated or padded"
        )
    sec = r.get(o, 31)
    if sec is None:
        need.append((c, o, 31))
        return None
    if sec.size < 1 or int(sec[0]) != 3:
        raise PayloadError("malformed section table (expected 3 sections)")
    p, lens = 1, []
    for _ in range(3):
        ln, p = read_uvarint(sec, p)
        lens.append(ln)
    o += p
    if o + sum(lens) != r.size:
        raise PayloadError("section lengths do not add up to the body")
    ow = 0
    if lens[1]:
        wb = r.get(o + lens[0], 1)
        if wb is None:
            need.append((c, o + lens[0], 1))
            return None
        ow = int(wb[0])
        k = (lens[1] - 1) // ow if ow in (4, 8) else -1
        if ow not in (4, 8) or (lens[1] - 1) % ow or lens[2] != 8 * k:
            raise PayloadError("malformed outlier section")
    elif lens[2]:
        raise PayloadError("malformed outlier section")
    shape = fields.shape
    if math.prod(shape) == 0 and (lens[0] or lens[1] or lens[2]):
        raise PayloadError("an empty tensor's payload carries data")
    return Frame(
        shape,
        fields.dtype,
        fields.eb,
        base,
        (o, lens[0]),
        (o + lens[0], lens[1]),
        (o + lens[0] + lens[1], lens[2]),
        ow,
    )


def read_outliers(buf: torch.Tensor, frames: list[Frame]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every frame's outlier positions (int64, flat in its tensor) and exact values
    (float64), concatenated in frame order (``Frame.n_outliers`` of each)."""
    pos, val = [], []
    for f in frames:
        if f.n_outliers:
            a = f.base + f.oidx[0] + 1
            pos.append(from_le(buf[a : a + f.ow * f.n_outliers], f.ow))
            b = f.base + f.oval[0]
            val.append(buf[b : b + 8 * f.n_outliers])
    if not pos:
        empty = torch.empty(0, dtype=torch.int64, device=buf.device)
        return empty, empty.to(torch.float64)
    return torch.cat(pos), torch.cat(val).view(torch.float64)


def encode_bodies(
    codec: Any,
    body: Callable[[torch.Tensor], torch.Tensor],
    xs: list[torch.Tensor],
    ebs: list[float],
) -> list[torch.Tensor]:
    """Format-2 payloads of chunks whose body ``codec`` makes with torch operations
    (``body``); NaN/Inf travel exactly as outliers."""
    cores: list[list[bytes | torch.Tensor]] = []
    outs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for x in xs:
        x = x.detach().contiguous()
        clean, nonfinite = without_nonfinite(x)
        cores.append([body(clean)] if x.numel() else [])
        outs.append(outlier_bytes(x.view(-1), nonfinite) if nonfinite is not None else None)
    shapes = [tuple(x.shape) for x in xs]
    return frame_device(codec, xs[0].dtype, shapes, ebs, cores, outs, xs[0].device)


def decode_bodies(
    codec: Any,
    body: Callable[[torch.Tensor, tuple[int, ...], torch.dtype, float], torch.Tensor],
    payloads: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Inverse of :func:`encode_bodies` (``body`` decodes one), outliers patched in."""
    buf, frames, _ = open_device(codec, payloads)
    pos, val = read_outliers(buf, frames)
    out, k = [], 0
    for f in frames:
        n = math.prod(f.shape)
        if n == 0:
            out.append(torch.empty(f.shape, dtype=f.dtype, device=buf.device))
            continue
        a = f.base + f.core[0]
        y = body(buf[a : a + f.core[1]], f.shape, f.dtype, f.eb)
        if f.n_outliers:
            p, v = pos[k : k + f.n_outliers], val[k : k + f.n_outliers]
            k += f.n_outliers
            if bool(((p < 0) | (p >= n)).any()):
                raise PayloadError("outlier position outside the tensor")
            y = y.contiguous()
            y.view(-1)[p] = v.to(f.dtype)
        out.append(y)
    return out


def without_nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (contiguous) with NaN/Inf zeroed, and their flat positions (None when every
    element is finite): those elements travel exactly, whatever the codec. A finite sum
    means every element is finite (NaN/Inf propagate): one cheap pass in the usual case."""
    flat = x.view(-1)
    if not flat.numel() or bool(torch.isfinite(flat.sum())):
        return x, None
    bad = ~torch.isfinite(flat)
    pos = torch.nonzero(bad).view(-1)
    if not pos.numel():  # the sum overflowed, every element is finite
        return x, None
    return x.masked_fill(bad.view(x.shape), 0), pos
