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

Payload layout (little endian)::

    magic "RSZ" | format version u8 | header length u16 | header crc32 u32 | header | body
    header = codec id (u8 len + ascii) | codec version u8 | config json (u16 len + utf8)
           | dtype u8 | ndim u8 | shape (ndim x u64) | eb f64 | body length u64 | body crc32 u32

Body = sections (u8 count, u32 lengths): the codec's own bytes, then the positions and
exact values of "outliers". Non-finite values are taken out by this base class before a
codec sees the tensor; a codec may name elements it cannot represent within the bound;
an external compressor whose bound is not exact by construction (ZFP) is decoded and
checked here. All of them travel exactly, so every codec treats them the same way.
"""

from __future__ import annotations

import json
import struct
import zlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

MAGIC = b"RSZ"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<3sBHI")  # magic, format version, header length, header crc
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
        return type(self) is type(other) and self.get_config() == other.get_config()  # type: ignore[attr-defined]

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

    # ---- public API -----------------------------------------------------------------
    def encode(self, x: torch.Tensor, eb: float | None = None) -> torch.Tensor:
        """Encode ``x`` (2-D float) under absolute bound ``eb`` into a uint8 payload."""
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
        eb_f = float(eb) if (self.error_bounded and eb is not None) else 0.0
        device = x.device
        x = x.detach().contiguous()
        flat = x.view(-1)
        exact: list[torch.Tensor] = []  # flat positions carried exactly
        orig = x
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
        idx = torch.unique(torch.cat(exact)) if exact else torch.zeros(0, dtype=torch.int64)
        body = join_sections([core, *_pack_outliers(idx, orig.view(-1)[idx])])
        payload = self._header(x.shape, x.dtype, eb_f, body) + body
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """Rebuild the tensor; raises PayloadError if the bytes are not a valid payload."""
        hdr, body = parse_payload(payload)
        if hdr["codec"] != self.codec_id:
            raise PayloadError(f"payload was made by codec {hdr['codec']!r}, not {self.codec_id!r}")
        return self._decode_body(hdr, body, payload.device)

    # ---- internals ------------------------------------------------------------------
    def _decode_body(
        self, hdr: dict[str, Any], body: np.ndarray, device: torch.device
    ) -> torch.Tensor:
        shape, dtype, eb = tuple(hdr["shape"]), hdr["dtype"], hdr["eb"]
        core, oidx, oval = split_sections(body, 3)
        n = int(np.prod(shape)) if shape else 0
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
        y = y.contiguous()
        idx, val = _unpack_outliers(oidx, oval, dtype, n)
        if idx.numel():
            y.view(-1)[idx.to(y.device)] = val.to(y.device)
        return y

    def _header(self, shape: torch.Size, dtype: torch.dtype, eb: float, body: bytes) -> bytes:
        cid = self.codec_id.encode("ascii")
        cfg = json.dumps(self.get_config(), sort_keys=True, separators=(",", ":")).encode()
        h = b"".join(
            [
                struct.pack("<B", len(cid)),
                cid,
                struct.pack("<BH", self.version, len(cfg)),
                cfg,
                struct.pack("<BB", _DTYPES[dtype], len(shape)),
                struct.pack(f"<{len(shape)}Q", *shape),
                struct.pack("<dQI", eb, len(body), zlib.crc32(body)),
            ]
        )
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(h), zlib.crc32(h)) + h


def parse_payload(payload: torch.Tensor) -> tuple[dict[str, Any], np.ndarray]:
    """Check and parse a payload's header; return (header fields, body bytes)."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError("a payload is a 1-D torch.uint8 tensor")
    buf = payload.detach().cpu().numpy()
    if buf.size < _PREFIX.size:
        raise PayloadError(f"payload of {buf.size} bytes is shorter than the fixed prefix")
    magic, fver, hlen, hcrc = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}: not a recsz payload")
    if fver != FORMAT_VERSION:
        raise PayloadError(f"payload format version {fver}, this build reads {FORMAT_VERSION}")
    start = _PREFIX.size
    if buf.size < start + hlen:
        raise PayloadError("payload truncated inside its header")
    h = buf[start : start + hlen].tobytes()
    if zlib.crc32(h) != hcrc:
        raise PayloadError("header checksum mismatch: payload corrupted")
    try:
        o = 0
        (clen,) = struct.unpack_from("<B", h, o)
        o += 1
        codec = h[o : o + clen].decode("ascii")
        o += clen
        cver, cfglen = struct.unpack_from("<BH", h, o)
        o += 3
        config = json.loads(h[o : o + cfglen])
        o += cfglen
        dcode, ndim = struct.unpack_from("<BB", h, o)
        o += 2
        shape = struct.unpack_from(f"<{ndim}Q", h, o)
        o += 8 * ndim
        eb, blen, bcrc = struct.unpack_from("<dQI", h, o)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"malformed header: {e}") from None
    if dcode not in _DTYPE_BY_CODE:
        raise PayloadError(f"unknown dtype code {dcode}")
    body = buf[start + hlen :]
    if body.size != blen:
        raise PayloadError(
            f"body is {body.size} bytes, header says {blen}: payload truncated or padded"
        )
    if zlib.crc32(body) != bcrc:
        raise PayloadError("body checksum mismatch: payload corrupted")
    return {
        "codec": codec,
        "codec_version": cver,
        "config": config,
        "dtype": _DTYPE_BY_CODE[dcode],
        "shape": tuple(shape),
        "eb": eb,
    }, body


# ---- helpers shared by codecs -------------------------------------------------------
def _as_bytes(b: bytes | np.ndarray) -> bytes:
    return b if isinstance(b, bytes) else np.ascontiguousarray(b).view(np.uint8).tobytes()


def join_sections(parts: list[bytes]) -> bytes:
    """Length-prefixed concatenation: u8 count, u32 lengths, then the bytes."""
    head = struct.pack(f"<B{len(parts)}I", len(parts), *(len(p) for p in parts))
    return head + b"".join(parts)


def split_sections(buf: np.ndarray, n: int) -> list[np.ndarray]:
    """Split a body made by join_sections into exactly ``n`` parts, or raise PayloadError."""
    if buf.size < 1 + 4 * n or int(buf[0]) != n:
        raise PayloadError(f"malformed section table (expected {n} sections)")
    lens = struct.unpack_from(f"<{n}I", buf, 1)
    o = 1 + 4 * n
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
