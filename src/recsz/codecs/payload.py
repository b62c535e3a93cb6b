"""The self-describing payload: layout, checksums, parsing, and byte helpers.

Layout (little endian; varint = LEB128, so small chunks pay few header bytes)::

    magic "RSZ" | format version u8 | checksum u32 of all that follows | header | body
    header = codec id (u8 len + ascii) | codec version u8 | config json (varint len + utf8,
             empty for {}) | dtype u8 | ndim u8 | shape (ndim varints) | eb f64
           | body length varint

Format 1's checksum is a CRC32. Payloads made on a GPU have layouts of their own, found by
the version byte: format 3 (the quantizing codecs, :mod:`recsz.codecs.blockformat`) and
format 4 (the casts, :mod:`recsz.codecs.castframe`), checksummed by a weighted word sum (one
parallel reduction). Format 2 (the torch-op device framing) is retired.

Body = sections (u8 count, varint lengths): the codec's own bytes, then the positions and
exact values of "outliers" (:mod:`recsz.codecs.base` says which elements those are); or,
where those would cost more than the values themselves (a bounded codec under a bound too
tight for its codes), one section: the values, stored exactly in the header's dtype.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAGIC = b"RSZ"
FORMAT_VERSION = 1
BLOCK_FORMAT = 3  # groups of tables in bit-plane blocks (recsz.codecs.blockformat)
CAST_FORMAT = 4  # the casts' bodies made on a device (recsz.codecs.castframe)
HEAD_WINDOW = 4096  # host copy of a device payload's first bytes (headers, stream tables)
PREFIX = struct.Struct("<3sBI")  # magic, format version, crc32 of everything after it
DTYPES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
DTYPE_BY_CODE = {v: k for k, v in DTYPES.items()}


class PayloadError(ValueError):
    """A payload is truncated, corrupted, or was not made by this codec."""


@dataclass(frozen=True)
class Header:
    """What a payload's header says of the tensor inside and the codec that made it."""

    codec: str
    codec_version: int
    config: dict[str, Any]
    dtype: torch.dtype
    shape: tuple[int, ...]
    eb: float
    body_len: int


def upload(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on ``device`` without a host sync (pinned memory, asynchronous copy).
    Never inside a CUDA graph's capture: each replay would copy again from pinned memory
    that is by then reused (a capture calling this fails here instead)."""
    t = torch.tensor(np.asarray(values), dtype=dtype)  # a copy: values may be read-only
    if device.type != "cuda":
        return t
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a host upload inside a CUDA graph capture (make it before)")
    return t.pin_memory().to(device, non_blocking=True)


def constant(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`upload` once per value, shape and device (layouts and bounds' factors repeat
    every step): the tensor is shared, never to be written."""
    a = np.ascontiguousarray(values)
    return _constant(a.tobytes(), a.dtype.str, a.shape, dtype, device)


def forget_constants() -> None:
    """Drop every constant :func:`constant` uploaded (they are made again when asked for)."""
    _constant.cache_clear()


@functools.lru_cache(maxsize=512)
def _constant(
    data: bytes, np_dtype: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return upload(np.frombuffer(data, np_dtype).reshape(shape), dtype, device)


def version_of(payload: torch.Tensor) -> int:
    """The format version byte (0 for what is no payload at all): a view on the CPU, one
    small copy from a device."""
    if not (isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8):
        return 0
    if payload.dim() != 1 or payload.numel() < PREFIX.size:
        return 0
    if payload.device.type == "cpu":
        return int(payload.detach().numpy()[3])
    return int(payload[3])


def header_fields(
    codec: str,
    version: int,
    config: bytes,
    shape: Sequence[int],
    dtype: torch.dtype,
    eb: float,
    body_len: int,
) -> bytes:
    """A format-1 header (the module's layout; ``config``: its JSON bytes, empty for {}),
    as :func:`parse_payload` reads it."""
    cid = codec.encode("ascii")
    return b"".join(
        [
            struct.pack("<B", len(cid)),
            cid,
            struct.pack("<B", version),
            uvarint(len(config)),
            config,
            struct.pack("<BB", DTYPES[dtype], len(shape)),
            *(uvarint(d) for d in shape),
            struct.pack("<d", eb),
            uvarint(body_len),
        ]
    )


def parse_payload(
    payload: torch.Tensor, verify: bool = True
) -> tuple[Header, np.ndarray | torch.Tensor]:
    """Check and parse a payload's header; return (header, body).

    The body is host bytes for format 1; for formats 3 and 4 the header is read from the
    payload's first bytes and the whole payload returned as the body. ``verify=False``
    skips the checksum, for a caller that only needs the header and hands the payload to
    a codec's ``decode``, which checks it."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError("a payload is a 1-D torch.uint8 tensor")
    payload = payload.detach()
    on_cpu = payload.device.type == "cpu"
    buf = payload.numpy() if on_cpu else payload[:HEAD_WINDOW].cpu().numpy()
    if buf.size < PREFIX.size:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than the fixed prefix")
    magic, fver, crc = PREFIX.unpack_from(buf.data, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}: not a recsz payload")
    if fver == FORMAT_VERSION:
        if not on_cpu:
            buf = payload.cpu().numpy()
        rest = buf[PREFIX.size :]
        if verify and zlib.crc32(rest.data) != crc:
            raise PayloadError("checksum mismatch: payload corrupted or truncated")
        fields, o = parse_header(rest)
        host_body = rest[o:]
        size = int(host_body.size)
        body: np.ndarray | torch.Tensor = host_body
    elif fver == BLOCK_FORMAT:  # recsz.codecs.blockformat; its codec checks the rest
        from recsz.codecs.blockformat import read_layout

        lay = read_layout(buf if on_cpu else payload[:HEAD_WINDOW].cpu().numpy())[0]
        shape = (lay.rows, lay.dim)
        return Header(lay.codec, 1, {}, DTYPE_BY_CODE[lay.dtype_code], shape, 0.0, 0), payload
    elif fver == CAST_FORMAT:  # recsz.codecs.castframe; its codec checks the rest
        from recsz.codecs.castframe import read_header

        codec, dtype, n, d, _ = read_header(payload)
        return Header(codec, 1, {}, dtype, (n, d), 0.0, 0), payload
    else:
        raise PayloadError(
            f"payload format version {fver}, this build reads {FORMAT_VERSION}, "
            f"{BLOCK_FORMAT} and {CAST_FORMAT}"
        )
    if size != fields.body_len:
        raise PayloadError(
            f"body is {size} bytes, header says {fields.body_len}: payload truncated or padded"
        )
    return fields, body


def parse_header(rest: np.ndarray) -> tuple[Header, int]:
    """The header after the prefix, and the offset where the body starts."""
    b = rest[:HEAD_WINDOW].tobytes()
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
    if dcode not in DTYPE_BY_CODE:
        raise PayloadError(f"unknown dtype code {dcode}")
    return Header(codec, cver, config, DTYPE_BY_CODE[dcode], tuple(shape), eb, blen), o


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


def as_bytes(b: bytes | np.ndarray) -> bytes:
    return b if isinstance(b, bytes) else np.ascontiguousarray(b).view(np.uint8).tobytes()


def assemble(
    fields_for: Callable[[int], bytes], sections: list[bytes | np.ndarray]
) -> torch.Tensor:
    """A format-1 payload, each byte written once: the prefix (magic, version, crc32 of
    everything after it), ``fields_for(body length)`` (the header fields), then the body:
    the section table (as :func:`join_sections` writes it) and the sections."""
    views = [
        np.frombuffer(p, np.uint8) if isinstance(p, bytes) else p.reshape(-1).view(np.uint8)
        for p in (s if isinstance(s, bytes) else np.ascontiguousarray(s) for s in sections)
    ]
    table = _section_table([v.size for v in views])
    fields = fields_for(len(table) + sum(v.size for v in views))
    crc = zlib.crc32(table, zlib.crc32(fields))
    for v in views:
        crc = zlib.crc32(v.data, crc)
    head = PREFIX.pack(MAGIC, FORMAT_VERSION, crc) + fields + table
    out = np.empty(len(head) + sum(v.size for v in views), np.uint8)
    out[: len(head)] = np.frombuffer(head, np.uint8)
    o = len(head)
    for v in views:
        out[o : o + v.size] = v
        o += v.size
    return torch.from_numpy(out)


def assembled_nbytes(fields_for: Callable[[int], bytes], section_lens: list[int]) -> int:
    """The length of what :func:`assemble` makes of sections of these lengths."""
    body = len(_section_table(section_lens)) + sum(section_lens)
    return PREFIX.size + len(fields_for(body)) + body


def cheaper_sections(
    fields_for: Callable[[int], bytes],
    coded: list[bytes | np.ndarray],
    values: torch.Tensor,
) -> list[bytes | np.ndarray]:
    """``coded`` (a codec's body sections), or the ``values`` (a contiguous host tensor)
    stored as one section where :func:`assemble` would make that payload smaller."""
    stored = values.reshape(-1).view(torch.uint8).numpy()
    lens = [s.nbytes if isinstance(s, np.ndarray) else len(s) for s in coded]
    if assembled_nbytes(fields_for, lens) > assembled_nbytes(fields_for, [stored.size]):
        return [stored]
    return coded


def stored_values(
    body: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """The tensor a body of stored values holds (:func:`cheaper_sections`), None for a
    coded body; PayloadError where the values do not fill the shape."""
    if not body.size or int(body[0]) != 1:
        return None
    (raw,) = split_sections(body, 1)
    count = math.prod(shape) if shape else 0
    return tensor_from_bytes(raw, dtype, count).view(shape)


def _section_table(lens: list[int]) -> bytes:
    return bytes([len(lens)]) + b"".join(uvarint(n) for n in lens)


def join_sections(parts: list[bytes]) -> bytes:
    """Length-prefixed concatenation: u8 count, varint lengths, then the bytes."""
    return _section_table([len(p) for p in parts]) + b"".join(parts)


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


def pack_outliers(idx: torch.Tensor, val: torch.Tensor) -> list[bytes]:
    """Positions (u32 when they fit, else u64, after a width byte) and exact values (f64)."""
    if idx.numel() == 0:
        return [b"", b""]
    i = idx.cpu().numpy()
    wide = bool(i.max() >= 2**32)
    ib = np.uint8(8 if wide else 4).tobytes() + i.astype("<u8" if wide else "<u4").tobytes()
    vb = val.detach().cpu().double().numpy().astype("<f8").tobytes()
    return [ib, vb]


def unpack_outliers(
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
