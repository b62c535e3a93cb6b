"""Baselines behind the same interface: what a practitioner would use instead.

- ``none``: raw bytes (the uncompressed all-to-all).
- ``fp16``, ``bf16``, ``fp8`` (e4m3, row-wise scale), ``int8`` (row-wise scale and offset):
  the precisions TorchRec's quantized comms offer. Their error is relative to the values
  and unbounded in absolute terms, so they are not ``error_bounded``.
- ``lz4``, ``zstd``: lossless general-purpose compressors.
- ``sz3`` (PyPI ``pysz``) and ``zfp`` (PyPI ``zfpy``): general error-bounded compressors,
  optional extras (``pip install 'recsz[baselines]'``). Their output is checked against
  the bound and any miss is carried exactly (``verify_bound``), so the guarantee is ours.
"""

from __future__ import annotations

import importlib
from typing import Any

import lz4.frame
import numpy as np
import torch
import zstandard

from recsz.codecs.base import Codec, saturating_cast
from recsz.codecs.payload import Header, PayloadError, tensor_bytes, tensor_from_bytes
from recsz.codecs.registry import register_codec


def _from_raw(
    b: bytes, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return tensor_from_bytes(b, dtype, int(np.prod(shape))).view(shape).to(device)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device (little endian, C order)."""
    if not t.numel():  # an empty tensor may carry strides no byte view takes
        return t.new_empty(0, dtype=torch.uint8)
    return t.contiguous().view(torch.uint8).reshape(-1)


def _as(core: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """Bytes back into a ``dtype`` tensor of ``shape`` (copied: ``core`` may be unaligned)."""
    item = torch.empty(0, dtype=dtype).element_size()
    if core.numel() != item * int(np.prod(shape)):
        raise PayloadError(f"{what}: {core.numel()} bytes do not hold {shape} x {dtype}")
    return core.clone().view(dtype).view(shape)


@register_codec
class NoneCodec(Codec):
    """No compression: the payload body is the tensor's bytes."""

    codec_id = "none"
    lossless = identity = joinable = True
    takes_nonfinite = True  # NaN and Inf are bytes like any other

    def cast_width(self, dtype: torch.dtype) -> int | None:
        return torch.empty(0, dtype=dtype).element_size()

    def _encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return _bytes_of(x)

    def _decode_tensor(
        self, core: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, eb: float
    ) -> torch.Tensor:
        return _as(core, dtype, shape, "none")


class _CastCodec(Codec):
    target: torch.dtype
    joinable = True
    takes_nonfinite = True  # the casts keep NaN and Inf (saturating_cast)

    def cast_width(self, dtype: torch.dtype) -> int | None:
        return torch.empty(0, dtype=self.target).element_size()

    def _encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return _bytes_of(saturating_cast(x, self.target))

    def _decode_tensor(
        self, core: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, eb: float
    ) -> torch.Tensor:
        return saturating_cast(_as(core, self.target, shape, self.codec_id), dtype)


@register_codec
class FP16Codec(_CastCodec):
    """Cast to IEEE half precision (TorchRec's FP16 comms)."""

    codec_id = "fp16"
    target = torch.float16


@register_codec
class BF16Codec(_CastCodec):
    """Cast to bfloat16 (TorchRec's BF16 comms)."""

    codec_id = "bf16"
    target = torch.bfloat16


@register_codec
class FP8Codec(Codec):
    """float8 e4m3 with one float32 scale per row (amax / 448). Body: the n scales, then
    the n x d codes."""

    codec_id = "fp8"
    joinable = True

    def _encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        xf = saturating_cast(x, torch.float32)
        amax = xf.abs().amax(1, keepdim=True)
        scale = amax / 448.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # 0, or underflowed
        q = (xf / scale).to(torch.float8_e4m3fn)
        return torch.cat([_bytes_of(scale), _bytes_of(q)])

    def _decode_tensor(
        self, core: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, eb: float
    ) -> torch.Tensor:
        n, d = shape
        if core.numel() != 4 * n + n * d:
            raise PayloadError(f"fp8 body of {core.numel()} bytes does not fit {shape}")
        scale = _as(core[: 4 * n], torch.float32, (n, 1), "fp8 scales")
        q = _as(core[4 * n :], torch.float8_e4m3fn, (n, d), "fp8 codes")
        return saturating_cast(q.float() * scale, dtype)


@register_codec
class Int8Codec(Codec):
    """uint8 codes with a float32 offset (row min) and scale ((max - min) / 255) per row.
    Body: n (offset, scale) pairs, then the n x d codes."""

    codec_id = "int8"
    joinable = True

    def _encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        xf = saturating_cast(x, torch.float32)
        if bool(torch.isinf(xf.amax(1) - xf.amin(1)).any()):
            xf = xf.double()  # a row's max - min overflows float32: work in float64
        lo = xf.amin(1, keepdim=True)
        span = xf.amax(1, keepdim=True) - lo
        scale = torch.where(span > 0, span / 255.0, torch.ones_like(span)).float().to(xf.dtype)
        q = torch.round((xf - lo) / scale).clamp(0, 255).to(torch.uint8)
        return torch.cat([_bytes_of(torch.cat([lo, scale], 1).float()), _bytes_of(q)])

    def _decode_tensor(
        self, core: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, eb: float
    ) -> torch.Tensor:
        n, d = shape
        if core.numel() != 8 * n + n * d:
            raise PayloadError(f"int8 body of {core.numel()} bytes does not fit {shape}")
        head = _as(core[: 8 * n], torch.float32, (n, 2), "int8 offsets")
        q = _as(core[8 * n :], torch.uint8, (n, d), "int8 codes").float()
        y = q * head[:, 1:2] + head[:, 0:1]
        if not bool(torch.isfinite(y).all()):  # beyond float32: again in float64, saturated
            y = saturating_cast(q.double() * head[:, 1:2].double() + head[:, 0:1].double(), y.dtype)
        return saturating_cast(y, dtype)


@register_codec
class LZ4Codec(Codec):
    """Lossless LZ4 frame of the raw bytes."""

    codec_id = "lz4"
    lossless = True
    joinable = True

    def _encode(self, x: torch.Tensor, eb: float) -> bytes:
        return lz4.frame.compress(tensor_bytes(x))

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        try:
            raw = lz4.frame.decompress(body.tobytes())
        except RuntimeError as e:
            raise PayloadError(f"lz4 frame does not decode: {e}") from None
        return _from_raw(raw, h.shape, h.dtype, device)


@register_codec
class ZstdCodec(Codec):
    """Lossless zstd of the raw bytes."""

    codec_id = "zstd"
    lossless = True
    joinable = True

    def __init__(self, level: int = 3) -> None:
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        self.level = int(level)

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level}

    def _encode(self, x: torch.Tensor, eb: float) -> bytes:
        return zstandard.ZstdCompressor(level=self.level).compress(tensor_bytes(x))

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=h.dtype).element_size()
        try:
            raw = zstandard.ZstdDecompressor().decompress(
                body.tobytes(), max_output_size=int(np.prod(h.shape)) * itemsize
            )
        except zstandard.ZstdError as e:
            raise PayloadError(f"zstd frame does not decode: {e}") from None
        return _from_raw(raw, h.shape, h.dtype, device)


def _optional(module: str, package: str, codec: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"codec {codec!r} needs the optional package {package!r}: "
            f"pip install {package}  (or pip install 'recsz[baselines]')"
        ) from None


def _wide(x: torch.Tensor) -> np.ndarray:
    """float32/float64 numpy copy of x (the external libraries take nothing narrower)."""
    t = x.cpu()
    return (t.double() if t.dtype == torch.float64 else t.float()).numpy()


@register_codec
class SZ3Codec(Codec):
    """SZ3 in absolute-error mode (NOPRED measured best on embedding rows)."""

    codec_id = "sz3"
    error_bounded = True
    verify_bound = True

    def __init__(self, algorithm: str = "NOPRED") -> None:
        if algorithm not in ("NOPRED", "INTERP_LORENZO", "LORENZO_REG", "INTERP"):
            raise ValueError(f"unknown SZ3 algorithm {algorithm!r}")
        self.algorithm = algorithm

    def get_config(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm}

    def check_installed(self) -> None:
        _optional("pysz", "pysz", self.codec_id)

    def _encode(self, x: torch.Tensor, eb: float) -> bytes:
        pysz = _optional("pysz", "pysz", self.codec_id)
        a = _wide(x)
        cfg = pysz.szConfig(a.shape)
        cfg.errorBoundMode = pysz.szErrorBoundMode.ABS
        cfg.absErrorBound = eb
        cfg.cmprAlgo = getattr(pysz.szAlgorithm, self.algorithm)
        comp, _ = pysz.sz.compress(a, cfg)
        return np.uint8(a.dtype == np.float64).tobytes() + np.asarray(comp, np.uint8).tobytes()

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        pysz = _optional("pysz", "pysz", self.codec_id)
        if body.size < 2:
            raise PayloadError("sz3 body too short")
        npdt = np.float64 if body[0] else np.float32
        out, _ = pysz.sz.decompress(np.ascontiguousarray(body[1:]), npdt, h.shape)
        return torch.from_numpy(np.array(out, copy=True)).view(h.shape).to(h.dtype).to(device)


@register_codec
class ZFPCodec(Codec):
    """ZFP in fixed-accuracy mode (tolerance = eb)."""

    codec_id = "zfp"
    error_bounded = True
    verify_bound = True

    def check_installed(self) -> None:
        _optional("zfpy", "zfpy==1.0.1", self.codec_id)

    def _encode(self, x: torch.Tensor, eb: float) -> bytes:
        zfpy = _optional("zfpy", "zfpy==1.0.1", self.codec_id)
        return bytes(zfpy.compress_numpy(np.ascontiguousarray(_wide(x)), tolerance=eb))

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        zfpy = _optional("zfpy", "zfpy==1.0.1", self.codec_id)
        out = zfpy.decompress_numpy(body.tobytes())
        if tuple(out.shape) != tuple(h.shape):
            raise PayloadError(f"zfp stream holds shape {out.shape}, header says {h.shape}")
        return torch.from_numpy(np.array(out, copy=True)).to(h.dtype).to(device)
