"""The codec contract and the self-describing payload.

Contract (every codec must):
- turn a 2-D float tensor (rows = embedding vectors or their gradients) into a 1-D
  ``torch.uint8`` payload on the same device, and back, with nothing but the bytes;
- if ``error_bounded``: guarantee ``|x - decode(encode(x, eb))| <= eb`` for every finite
  element; NaN and +-Inf always come back exactly (carried as outliers);
- if ``lossless``: return the input bit for bit;
- be stateless: the same input and bound give the same bytes (the policy holds state);
- reject a truncated, corrupted or foreign payload with :class:`PayloadError`, never
  returning a wrong tensor;
- describe its configuration as JSON (``get_config``) from which ``from_config`` rebuilds it.

Payload layout (little endian; varint = LEB128, so small chunks pay few header bytes)::

    magic "RSZ" | format version u8 | crc32 u32 of all that follows | header | body
    header = codec id (u8 len + ascii) | codec version u8 | config json (varint len + utf8,
             empty for {}) | dtype u8 | ndim u8 | shape (ndim varints) | eb f64
           | body length varint

Format version 2 is the same layout made on the tensor's device (:meth:`Codec._device_path`):
its checksum is :func:`word_hash` instead of crc32, because a CRC is sequential and a
weighted word sum is one parallel reduction; decoding reads only the header and stream
tables on the host and leaves the data where it is.

Body = sections (u8 count, u32 lengths): the codec's own bytes, then the positions and
exact values of "outliers". Non-finite values are taken out by this base class before a
codec sees the tensor; a codec may name elements it cannot represent within the bound;
an external compressor whose bound is not exact by construction (ZFP) is decoded and
checked here. All of them travel exactly, so every codec treats them the same way.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import struct
import zlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

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


Body = bytes | np.ndarray | tuple[bytes | np.ndarray, torch.Tensor]


class PayloadError(ValueError):
    """A payload is truncated, corrupted, or was not made by this codec."""


class Codec(ABC):
    """Base class: validation, header, non-finite handling; subclasses code the body."""

    codec_id: ClassVar[str]
    version: ClassVar[int] = 1
    error_bounded: ClassVar[bool] = False
    lossless: ClassVar[bool] = False

    @classmethod
    def available(cls) -> bool:
        """False when an optional package this codec needs is missing."""
        return True

    # ---- configuration --------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable keyword arguments that rebuild this codec."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        return cls(**config)

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({cfg})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self), json.dumps(self.get_config(), sort_keys=True)))

    # ---- what subclasses implement --------------------------------------------------
    @abstractmethod
    def _encode(self, x: torch.Tensor, eb: float) -> Body:
        """Code a finite, contiguous 2-D tensor (N > 0 elements) into body bytes.

        May return ``(bytes, positions)``: flat positions of elements the codec could not
        represent within the bound; the base class then carries them exactly.
        """

    @abstractmethod
    def _decode(
        self,
        body: np.ndarray,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        eb: float,
        device: torch.device,
    ) -> torch.Tensor:
        """Rebuild the tensor from body bytes; raise PayloadError on malformed bodies."""

    #: Subclasses whose bound is not exact by construction set this: the encoder then
    #: decodes, and carries every element that misses the bound exactly.
    verify_bound: ClassVar[bool] = False

    def _device_path(self, x: torch.Tensor) -> bool:
        """True when this codec codes ``x`` where it lives (format 2): payload built and
        parsed with device tensors, only sizes and tables crossing to the host."""
        return False

    def _encode_batch_device(self, xs: list[torch.Tensor], ebs: list[float]) -> list[torch.Tensor]:
        """Encode :meth:`_device_path` chunks of one device, dtype and width together
        (format 2); NaN/Inf are the codec's to carry."""
        raise NotImplementedError

    def _decode_batch_device(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode format-2 payloads of one device together."""
        raise PayloadError(f"{self.codec_id} does not read device-made payloads")

    def warm_up(self) -> None:  # noqa: B027  (a hook: most codecs have nothing to warm)
        """Pay one-time costs (loading compiled kernels) now rather than in the first step
        a benchmark times. No-op unless a codec has such costs."""

    def _takes_nonfinite(self, x: torch.Tensor) -> bool:
        """True when ``_encode`` reports NaN/Inf elements of ``x`` among its outlier
        positions itself, so the separate finiteness pass can be skipped (a codec whose
        bound check rejects every non-finite element gets this for free)."""
        return False

    # ---- public API -----------------------------------------------------------------
    def _validated(self, x: torch.Tensor, eb: float | None) -> float:
        """Check the input; the bound as a float (0 for codecs that take none)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{self.codec_id}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise ValueError(
                f"{self.codec_id}: expected a float tensor (float32/16, bfloat16, float64), "
                f"got {x.dtype}"
            )
        if x.dim() != 2:
            raise ValueError(
                f"{self.codec_id}: expected a 2-D tensor (rows, dim), got shape {tuple(x.shape)}"
            )
        if self.error_bounded and (eb is None or not (eb > 0) or not np.isfinite(eb)):
            raise ValueError(f"{self.codec_id}: error bound must be positive and finite, got {eb}")
        return float(eb) if (self.error_bounded and eb is not None) else 0.0

    def encode(self, x: torch.Tensor, eb: float | None = None) -> torch.Tensor:
        """Encode ``x`` (2-D float) under absolute bound ``eb`` into a uint8 payload."""
        eb_f = self._validated(x, eb)
        if self._device_path(x):
            return self._encode_batch_device([x], [eb_f])[0]
        device = x.device
        x = x.detach().contiguous()
        flat = x.view(-1)
        exact: list[torch.Tensor] = []  # flat positions carried exactly
        orig = x
        # A finite sum means every element is finite (NaN/Inf propagate): one cheap pass.
        if flat.numel() and not self._takes_nonfinite(x) and not bool(torch.isfinite(flat.sum())):
            finite = torch.isfinite(flat)
            if not bool(finite.all()):
                exact.append(torch.nonzero(~finite).view(-1))
                x = x.masked_fill(~finite.view(x.shape), 0)
        core: bytes = b""
        if x.numel():
            out = self._encode(x, eb_f)
            if isinstance(out, tuple):
                out, missed = out
                if missed.numel():
                    exact.append(missed)
            core = _as_bytes(out)
            if self.error_bounded and self.verify_bound:
                y = self._decode(
                    np.frombuffer(core, np.uint8), tuple(x.shape), x.dtype, eb_f, device
                )
                bad = (y.double() - x.double()).abs().view(-1) > eb_f
                exact.append(torch.nonzero(bad).view(-1))
        if exact:
            idx = torch.unique(torch.cat(exact)) if len(exact) > 1 else exact[0]
            body = join_sections([core, *_pack_outliers(idx, orig.view(-1)[idx])])
        else:
            body = join_sections([core, b"", b""])
        payload = bytearray(self._header(x.shape, x.dtype, eb_f, body))
        payload += body
        return torch.frombuffer(payload, dtype=torch.uint8).to(device)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """Rebuild the tensor; raises PayloadError if the bytes are not a valid payload."""
        if _is_device_made(payload):
            return self._decode_device_checked([payload])[0]
        hdr, body = parse_payload(payload)
        if hdr["codec"] != self.codec_id:
            raise PayloadError(f"payload was made by codec {hdr['codec']!r}, not {self.codec_id!r}")
        assert isinstance(body, np.ndarray)
        return self._decode_body(hdr, body, payload.device)

    def encode_batch(self, xs: list[torch.Tensor], ebs: list[float | None]) -> list[torch.Tensor]:
        """Encode many chunks: the payloads ``encode`` gives for each, but chunks that a
        codec codes on their device (CUDA) share its launches and synchronizations."""
        if len(xs) != len(ebs):
            raise ValueError(f"{len(xs)} tensors but {len(ebs)} bounds")
        out: list[torch.Tensor | None] = [None] * len(xs)
        groups: dict[tuple[Any, ...], list[int]] = {}
        bounds = [self._validated(x, e) for x, e in zip(xs, ebs, strict=True)]
        for i, x in enumerate(xs):
            if self._device_path(x):
                groups.setdefault((x.device, x.dtype, x.shape[1]), []).append(i)
            else:
                out[i] = self.encode(x, ebs[i])
        for idx in groups.values():
            ps = self._encode_batch_device([xs[i] for i in idx], [bounds[i] for i in idx])
            for i, p in zip(idx, ps, strict=True):
                out[i] = p
        return [p for p in out if p is not None]

    def decode_batch(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode many payloads; device-made ones of one device together."""
        out: list[torch.Tensor | None] = [None] * len(payloads)
        groups: dict[torch.device, list[int]] = {}
        for i, (p, v) in enumerate(zip(payloads, _versions(payloads), strict=True)):
            if v == DEVICE_FORMAT:
                groups.setdefault(p.device, []).append(i)
            else:
                out[i] = self.decode(p)
        for idx in groups.values():
            ys = self._decode_device_checked([payloads[i] for i in idx])
            for i, y in zip(idx, ys, strict=True):
                out[i] = y
        return [y for y in out if y is not None]

    def _decode_device_checked(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return self._decode_batch_device(payloads)
        except PayloadError:
            raise
        except Exception as e:  # a malformed body must never escape as another error
            raise PayloadError(f"{self.codec_id}: corrupt body ({type(e).__name__}: {e})") from e

    # ---- internals ------------------------------------------------------------------
    @functools.cached_property
    def _config_bytes(self) -> bytes:
        """The header's config: only settings that differ from the constructor's defaults
        travel (from_config fills the rest), so small chunks pay ~10 fewer header bytes.
        Computed once per codec (codecs are configured at construction and never change):
        inspecting the signature costs more than coding a small chunk."""
        defaults = {
            k: p.default
            for k, p in inspect.signature(type(self).__init__).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        shown = {k: v for k, v in self.get_config().items() if defaults.get(k, object()) != v}
        return json.dumps(shown, sort_keys=True, separators=(",", ":")).encode() if shown else b""

    def _decode_body(
        self, hdr: dict[str, Any], body: np.ndarray, device: torch.device
    ) -> torch.Tensor:
        shape, dtype, eb = tuple(hdr["shape"]), hdr["dtype"], hdr["eb"]
        core, oidx, oval = split_sections(body, 3)
        n = math.prod(shape) if shape else 0
        if n == 0:
            if core.size or oidx.size > 1 or oval.size:
                raise PayloadError("an empty tensor's payload carries data")
            return torch.empty(shape, dtype=dtype, device=device)
        try:
            y = self._decode(core, shape, dtype, eb, device)
        except PayloadError:
            raise
        except Exception as e:  # a malformed body must never escape as another error
            raise PayloadError(f"{self.codec_id}: corrupt body ({type(e).__name__}: {e})") from e
        if tuple(y.shape) != shape or y.dtype != dtype:
            raise PayloadError(
                f"{self.codec_id}: body decodes to {tuple(y.shape)} {y.dtype}, "
                f"header says {shape} {dtype}"
            )
        if oidx.size or oval.size:
            y = y.contiguous()
            idx, val = _unpack_outliers(oidx, oval, dtype, n)
            if idx.numel():
                y.view(-1)[idx.to(y.device)] = val.to(y.device)
        return y

    def _header(self, shape: torch.Size, dtype: torch.dtype, eb: float, body: bytes) -> bytes:
        h = self._header_fields(shape, dtype, eb, len(body))
        return MAGIC + struct.pack("<BI", FORMAT_VERSION, zlib.crc32(body, zlib.crc32(h))) + h

    def _header_fields(self, shape: torch.Size, dtype: torch.dtype, eb: float, blen: int) -> bytes:
        cid = self.codec_id.encode("ascii")
        cfg = self._config_bytes
        return b"".join(
            [
                struct.pack("<B", len(cid)),
                cid,
                struct.pack("<B", self.version),
                uvarint(len(cfg)),
                cfg,
                struct.pack("<BB", _DTYPES[dtype], len(shape)),
                *(uvarint(d) for d in shape),
                struct.pack("<d", eb),
                uvarint(blen),
            ]
        )


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
    payload: torch.Tensor,
) -> tuple[dict[str, Any], np.ndarray | torch.Tensor]:
    """Check and parse a payload's header; return (header fields, body).

    The body is host bytes for format 1, and stays on the payload's device for format 2
    (only the first bytes, where the headers are, are copied to the host)."""
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
        if zlib.crc32(rest.data) != crc:
            raise PayloadError("checksum mismatch: payload corrupted or truncated")
        fields, o = _parse_header(rest)
        host_body = rest[o:]
        size = int(host_body.size)
        body: np.ndarray | torch.Tensor = host_body
    elif fver == DEVICE_FORMAT:
        got = word_hash(payload[_PREFIX.size :])
        want = torch.frombuffer(bytearray(buf[4:8].tobytes()), dtype=torch.uint8)
        if not torch.equal(got.cpu(), want):
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


def _uvarint_at(b: bytes, o: int) -> tuple[int, int]:
    """read_uvarint on Python bytes (indexing bytes is several times cheaper than numpy)."""
    n = shift = 0
    while True:
        if o >= len(b) or shift > 63:
            raise PayloadError("truncated or oversized varint")
        v = b[o]
        o += 1
        n |= (v & 0x7F) << shift
        shift += 7
        if not v & 0x80:
            return n, o


def _parse_header(rest: np.ndarray) -> tuple[dict[str, Any], int]:
    """The header fields after the prefix, and the offset where the body starts."""
    b = rest[:_HEAD_WINDOW].tobytes()
    try:
        clen = b[0]
        codec = b[1 : 1 + clen].decode("ascii")
        o = 1 + clen
        cver = b[o]
        cfglen, o = _uvarint_at(b, o + 1)
        raw_cfg = b[o : o + cfglen]
        if len(raw_cfg) != cfglen:
            raise IndexError("config runs past the header")
        config = json.loads(raw_cfg) if raw_cfg else {}
        o += cfglen
        dcode, ndim = b[o], b[o + 1]
        o += 2
        shape = []
        for _ in range(ndim):
            d, o = _uvarint_at(b, o)
            shape.append(d)
        (eb,) = struct.unpack_from("<d", b, o)
        blen, o = _uvarint_at(b, o + 8)
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


# ---- bytes on a device --------------------------------------------------------------------
def word_hash(t: torch.Tensor) -> torch.Tensor:
    """Checksum of a uint8 tensor, computed on its device: 4 bytes (uint8, same device).

    The bytes as little-endian u32 words (zero padded), each times an odd 64-bit weight
    that depends on its position, summed modulo 2^64 and folded to 32 bits. Any change of
    one word changes the sum (an odd weight is invertible mod 2^64); words swapped or
    shifted change it with overwhelming probability. Integer arithmetic only, so every
    device computes the same value; unlike a CRC it is one parallel reduction.
    """
    n = t.numel()
    pad = (-n) % 4
    b = torch.cat([t, t.new_zeros(pad)]) if pad else t
    sh = torch.arange(0, 32, 8, device=t.device)
    words = (b.view(-1, 4).to(torch.int64) << sh).sum(1)
    i = torch.arange(1, words.numel() + 1, device=t.device, dtype=torch.int64)
    weights = (i * -7046029254386353131 + 0x632BE59BD9B4E019) | 1  # wraps mod 2^64
    h = (words * weights).sum() + n
    fold = (h ^ (h >> 32)) & 0xFFFFFFFF
    return ((fold >> sh) & 255).to(torch.uint8)


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


def read_uvarint(buf: np.ndarray, o: int) -> tuple[int, int]:
    """Decode a varint at ``o``; returns (value, next offset). Raises PayloadError."""
    n = shift = 0
    while True:
        if o >= buf.size or shift > 63:
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
