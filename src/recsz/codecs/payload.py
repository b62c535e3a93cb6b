"""The self-describing payload: layout, checksums, parsing, and byte helpers.

Layout (little endian; varint = LEB128, so small chunks pay few header bytes)::

    magic "RSZ" | format version u8 | checksum u32 of all that follows | header | body
    header = codec id (u8 len + ascii) | codec version u8 | config json (varint len + utf8,
             empty for {}) | dtype u8 | ndim u8 | shape (ndim varints) | eb f64
           | body length varint

Format 1's checksum is a CRC32. Format 2 is the same layout made on the tensor's device
(:meth:`recsz.codecs.base.Codec._device_path`): its checksum is
:func:`recsz.codecs.devbuf.word_hash`, because a CRC is sequential and a weighted word sum is
one parallel reduction; decoding reads only the header and stream tables on the host and
leaves the data where it is.

Body = sections (u8 count, varint lengths): the codec's own bytes, then the positions and
exact values of "outliers" (:mod:`recsz.codecs.base` says which elements those are).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from recsz.codecs.devbuf import Pieces, excl, from_le, region_hashes, word_hash

MAGIC = b"RSZ"
FORMAT_VERSION = 1
DEVICE_FORMAT = 2  # made on the tensor's device: word_hash checksum
_HEAD_WINDOW = 4096  # host copy of a device payload's first bytes (headers, stream tables)
_PREFIX = struct.Struct("<3sBI")  # magic, format version, crc32 of everything after it
_DTYPES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
_DTYPE_BY_CODE = {v: k for k, v in _DTYPES.items()}


class PayloadError(ValueError):
    """A payload is truncated, corrupted, or was not made by this codec."""


def _version(payload: torch.Tensor) -> int:
    """The format version byte (0 for what is no payload at all): a view on the CPU, one
    small copy from a device."""
    if not isinstance(payload, torch.Tensor) or not _version_ok(payload):
        return 0
    if payload.device.type == "cpu":
        return int(payload.detach().numpy()[3])
    return int(payload[3])


def _versions(payloads: list[torch.Tensor]) -> list[int]:
    """_version of each payload, those on devices read with one copy for all."""
    out = [0] * len(payloads)
    remote = []
    for i, p in enumerate(payloads):
        if isinstance(p, torch.Tensor) and p.device.type != "cpu" and _version_ok(p):
            remote.append(i)
        else:
            out[i] = _version(p)
    if remote:
        got = torch.stack([payloads[i][3] for i in remote]).cpu().tolist()
        for i, v in zip(remote, got, strict=True):
            out[i] = int(v)
    return out


def _version_ok(payload: torch.Tensor) -> bool:
    return payload.dtype == torch.uint8 and payload.dim() == 1 and payload.numel() >= _PREFIX.size


def _is_device_made(payload: torch.Tensor) -> bool:
    """Format 2 (made on the tensor's device), told by the version byte alone."""
    return _version(payload) == DEVICE_FORMAT


def parse_payload(
    payload: torch.Tensor, verify: bool = True
) -> tuple[dict[str, Any], np.ndarray | torch.Tensor]:
    """Check and parse a payload's header; return (header fields, body).

    The body is host bytes for format 1, and stays on the payload's device for format 2
    (only the first bytes, where the headers are, are copied to the host). ``verify=False``
    skips the checksum, for a caller that only needs the header and hands the payload to
    a codec's ``decode``, which checks it."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError("a payload is a 1-D torch.uint8 tensor")
    payload = payload.detach()
    on_cpu = payload.device.type == "cpu"
    buf = payload.numpy() if on_cpu else payload[:_HEAD_WINDOW].cpu().numpy()
    if buf.size < _PREFIX.size:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than the fixed prefix")
    magic, fver, crc = _PREFIX.unpack_from(buf.data, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}: not a recsz payload")
    if fver == FORMAT_VERSION:
        if not on_cpu:
            buf = payload.cpu().numpy()
        rest = buf[_PREFIX.size :]
        if verify and zlib.crc32(rest.data) != crc:
            raise PayloadError("checksum mismatch: payload corrupted or truncated")
        fields, o = _parse_header(rest)
        host_body = rest[o:]
        size = int(host_body.size)
        body: np.ndarray | torch.Tensor = host_body
    elif fver == DEVICE_FORMAT:
        if verify:
            got = word_hash(payload[_PREFIX.size :]).cpu().numpy()
            if not np.array_equal(got, buf[4:8]):
                raise PayloadError("checksum mismatch: payload corrupted or truncated")
        fields, o = _parse_header(buf[_PREFIX.size : _HEAD_WINDOW])
        o += _PREFIX.size
        body = payload[o:]  # stays on its device
        size = int(body.numel())
    else:
        raise PayloadError(
            f"payload format version {fver}, this build reads {FORMAT_VERSION} and {DEVICE_FORMAT}"
        )
    if size != fields["blen"]:
        raise PayloadError(
            f"body is {size} bytes, header says {fields.pop('blen')}: payload truncated or padded"
        )
    del fields["blen"]
    return fields, body


def _parse_header(rest: np.ndarray) -> tuple[dict[str, Any], int]:
    """The header fields after the prefix, and the offset where the body starts."""
    b = rest[:_HEAD_WINDOW].tobytes()
    try:
        clen = b[0]
        codec = b[1 : 1 + clen].decode("ascii")
        o = 1 + clen
        cver = b[o]
        cfglen, o = read_uvarint(b, o + 1)
        raw_cfg = b[o : o + cfglen]
        if len(raw_cfg) != cfglen:
            raise IndexError("config runs past the header")
        config = json.loads(raw_cfg) if raw_cfg else {}
        o += cfglen
        dcode, ndim = b[o], b[o + 1]
        o += 2
        shape = []
        for _ in range(ndim):
            d, o = read_uvarint(b, o)
            shape.append(d)
        (eb,) = struct.unpack_from("<d", b, o)
        blen, o = read_uvarint(b, o + 8)
    except (IndexError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"malformed header: {e}") from None
    if dcode not in _DTYPE_BY_CODE:
        raise PayloadError(f"unknown dtype code {dcode}")
    fields = {
        "codec": codec,
        "codec_version": cver,
        "config": config,
        "dtype": _DTYPE_BY_CODE[dcode],
        "shape": tuple(shape),
        "eb": eb,
        "blen": blen,
    }
    return fields, o


def uvarint(n: int) -> bytes:
    """LEB128 unsigned varint: 7 bits a byte, small numbers in one byte."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_uvarint(buf: np.ndarray | bytes, o: int) -> tuple[int, int]:
    """Decode a varint at ``o`` of a uint8 array or bytes (cheaper to index: parsers of
    hot headers pass bytes); returns (value, next offset). Raises PayloadError."""
    n = shift = 0
    while True:
        if o >= len(buf) or shift > 63:
            raise PayloadError("truncated or oversized varint")
        b = int(buf[o])
        o += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, o


# ---- helpers shared by codecs -------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (bfloat16 through an int16 view: numpy has no bfloat16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def tensor_from_bytes(
    b: bytes | np.ndarray, dtype: torch.dtype, count: int | None = None
) -> torch.Tensor:
    """Inverse of tensor_bytes, 1-D; PayloadError if the bytes do not hold ``count`` items."""
    raw = b.tobytes() if isinstance(b, np.ndarray) else b
    item = torch.empty(0, dtype=dtype).element_size()
    if len(raw) % item or (count is not None and len(raw) != count * item):
        want = f"{count} x {dtype}" if count is not None else f"whole {dtype} items"
        raise PayloadError(f"{len(raw)} bytes do not hold {want}")
    if not raw:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype)


def _as_bytes(b: bytes | np.ndarray) -> bytes:
    return b if isinstance(b, bytes) else np.ascontiguousarray(b).view(np.uint8).tobytes()


def join_sections(parts: list[bytes]) -> bytes:
    """Length-prefixed concatenation: u8 count, varint lengths, then the bytes."""
    return bytes([len(parts)]) + b"".join(uvarint(len(p)) for p in parts) + b"".join(parts)


def split_sections(buf: np.ndarray, n: int) -> list[np.ndarray]:
    """Split a body made by join_sections into exactly ``n`` parts, or raise PayloadError."""
    if buf.size < 1 or int(buf[0]) != n:
        raise PayloadError(f"malformed section table (expected {n} sections)")
    o = 1
    lens = []
    for _ in range(n):
        ln, o = read_uvarint(buf, o)
        lens.append(ln)
    if o + sum(lens) != buf.size:
        raise PayloadError("section lengths do not add up to the body")
    out = []
    for ln in lens:
        out.append(buf[o : o + ln])
        o += ln
    return out


def _pack_outliers(idx: torch.Tensor, val: torch.Tensor) -> list[bytes]:
    """Positions (u32 when they fit, else u64, after a width byte) and exact values (f64)."""
    if idx.numel() == 0:
        return [b"", b""]
    i = idx.cpu().numpy()
    wide = bool(i.max() >= 2**32)
    ib = np.uint8(8 if wide else 4).tobytes() + i.astype("<u8" if wide else "<u4").tobytes()
    vb = val.detach().cpu().double().numpy().astype("<f8").tobytes()
    return [ib, vb]


def _unpack_outliers(
    ib: np.ndarray, vb: np.ndarray, dtype: torch.dtype, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if ib.size == 0 and vb.size == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype)
    w = int(ib[0]) if ib.size else 0
    if w not in (4, 8) or (ib.size - 1) % w or vb.size % 8 or (ib.size - 1) // w != vb.size // 8:
        raise PayloadError("malformed outlier section")
    idx = np.frombuffer(ib[1:].tobytes(), dtype="<u4" if w == 4 else "<u8").astype(np.int64)
    if idx.size and idx.max() >= n:
        raise PayloadError("outlier position outside the tensor")
    val = torch.from_numpy(np.frombuffer(vb.tobytes(), dtype="<f8").copy()).to(dtype)
    return torch.from_numpy(idx), val


# ---- device-made payloads (format 2), many at a time ---------------------------------
# Framing and parsing shared by every codec with a device path: the codec supplies its core
# bytes (host-made headers and device tensors) and outliers; the frame around them is made
# with one host-to-device copy and one concatenation, and read back with one small
# device-to-host copy for all payloads (more rounds only when a parser asks for bytes
# beyond the first window).
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
    h = region_hashes(buf, [a + _PREFIX.size for a in starts], [b[1] for b in bounds])
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
        if sz < _PREFIX.size or head is None:
            raise PayloadError(f"payload of {sz} bytes is shorter than the fixed prefix")
        if head[:3].tobytes() != MAGIC or int(head[3]) != DEVICE_FORMAT:
            raise PayloadError("not a device-made (format 2) recsz payload")
    ends = [s + z for s, z in zip(starts, sizes, strict=True)]
    got = region_hashes(buf, [s + _PREFIX.size for s in starts], ends).cpu().numpy()
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
    rest = r.get(_PREFIX.size, _DEVICE_HEAD - _PREFIX.size)
    assert rest is not None
    fields, o = _parse_header(rest)
    o += _PREFIX.size
    if fields["codec"] != codec.codec_id:
        raise PayloadError(f"payload was made by codec {fields['codec']!r}, not {codec.codec_id!r}")
    if fields["blen"] != r.size - o:
        raise PayloadError(
            f"body is {r.size - o} bytes, header says {fields['blen']}: payload truncated or padded"
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
    shape = tuple(fields["shape"])
    if math.prod(shape) == 0 and (lens[0] or lens[1] or lens[2]):
        raise PayloadError("an empty tensor's payload carries data")
    return Frame(
        shape,
        fields["dtype"],
        fields["eb"],
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
