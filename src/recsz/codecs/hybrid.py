"""The error-bounded hybrid codec and its single stages (arXiv 2407.04272, section 4).

    x (N, D) ──quantize(2 eb)──► codes ──vector dedup──► literal rows + refs ──entropy──► bytes

``hybrid`` deduplicates a chunk's rows when that pays (the paper chooses LZ or Huffman per
table), then entropy-codes; ``quant``, ``quant+lz`` and ``quant+zstd`` expose single stages
so the contribution of each can be measured. Every variant writes the same body layout,
which records the stages it used, so decoding depends on the bytes alone.

The entropy stage codes each integer stream on its own: the literal codes by zstd
(Huffman-coded literals) over byte planes of the zig-zagged codes, the row references by an
adaptive range coder (:mod:`recsz.codecs.kernels`), each kept only where it is smaller than
the raw planes. ``hybrid-ac`` also tries a context-modelled arithmetic coder on the codes.

Float32/float64 tensors on the CPU take fused numba kernels (:mod:`recsz.codecs.kernels`)
for everything but zstd; other dtypes and CUDA tensors take the torch stages, which run on
the tensor's device. Both write the same bytes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
import zstandard

from recsz.codecs import kernels
from recsz.codecs.base import Codec, PayloadError
from recsz.codecs.registry import register_codec
from recsz.codecs.stages import (
    SPLIT,
    dedup_rows,
    dequantize,
    magicless_zstd,
    pack_planes,
    pack_streams,
    quantize,
    undedup_rows,
    unpack_planes,
    unpack_streams,
    unzigzag,
    zigzag,
)

_KERNEL_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
_DEDUP_MODES = {"off": 0, "on": 1, "auto": 2}
_DECODE_ERRORS = {
    kernels.BAD_LITERAL_COUNT: "row references and literal codes do not fit the shape",
    kernels.BAD_REFERENCE: "vector reference points past the literal rows",
}


def _fused(t: torch.Tensor | torch.device, dtype: torch.dtype) -> bool:
    """Whether the numba kernels handle this device and dtype."""
    device = t.device if isinstance(t, torch.Tensor) else t
    return device.type == "cpu" and dtype in _KERNEL_DTYPES


class _QuantPipeline(Codec):
    """Quantize, then optionally deduplicate rows and entropy-code."""

    error_bounded = True
    dedup: ClassVar[str] = "off"  # "off", "on", or "auto" (when repeats save more than refs)
    entropy: ClassVar[bool] = False
    #: Also try the context-modelled arithmetic coder on the codes (smallest wins): ~5x
    #: the CPU of zstd's entropy stage for 5-25% fewer bytes; for slow links.
    modelled: ClassVar[bool] = False

    def __init__(self, level: int = 1) -> None:
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        self.level = int(level)
        # Reused (de)compression contexts: creating one costs more than coding a chunk.
        cctx, self._dctx_magicless = magicless_zstd(self.level)
        self._cctx = cctx if self.entropy else None
        self._dctx = zstandard.ZstdDecompressor()  # blocks written with the frame magic

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level} if self.entropy else {}

    def _row(self, d: int) -> int:
        """Row length handed to the stream packer: > 0 enables the modelled coder."""
        return d if self.modelled else 0

    def warm_up(self) -> None:
        # Repeated rows exercise every kernel: quantize, dedup, range-coded references.
        x = torch.arange(64, dtype=torch.float32).view(16, 4).remainder_(3)
        self.decode(self.encode(x, 0.1))

    def _takes_nonfinite(self, x: torch.Tensor) -> bool:
        # The kernel's bound check fails for NaN/Inf, which makes them outliers.
        return _fused(x, x.dtype)

    def _encode(self, x: torch.Tensor, eb: float) -> tuple[bytes, torch.Tensor]:
        if _fused(x, x.dtype):
            return self._encode_fused(x, eb)
        codes, missed = quantize(x, eb)
        n, d = codes.shape
        use_dedup = self.dedup == "on"
        refs = None
        if self.dedup != "off":
            refs = dedup_rows(codes)
            # A reference costs about one code; a repeated row saves d codes.
            n_lit = int((refs == 0).sum())
            use_dedup = use_dedup or (n - n_lit) * d > n
        if use_dedup and refs is not None:
            lit = codes[refs == 0]
            streams = [refs.cpu().numpy(), zigzag(lit).view(-1).cpu().numpy()]
        else:
            streams = [zigzag(codes).view(-1).cpu().numpy()]
        return pack_streams(streams, self._cctx, SPLIT, self._row(d)), missed

    def _encode_fused(self, x: torch.Tensor, eb: float) -> tuple[bytes, torch.Tensor]:
        a = x.numpy()
        qmax = kernels.QMAX32 if a.dtype == np.float32 else kernels.QMAX64
        step = np.array([2.0 * eb], a.dtype)
        planes, w_refs, n_refs, w_codes, n_codes, missed = kernels.encode_rows(
            a, step, eb, _DEDUP_MODES[self.dedup], qmax
        )
        dims = [(w_refs, n_refs), (w_codes, n_codes)] if n_refs else [(w_codes, n_codes)]
        return pack_planes(
            dims, planes, self._cctx, SPLIT, self._row(a.shape[1])
        ), torch.from_numpy(missed)

    def _decode(
        self,
        body: np.ndarray,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        eb: float,
        device: torch.device,
    ) -> torch.Tensor:
        n, d = shape
        if _fused(device, dtype):
            dims, raw = unpack_planes(body, self._dctx, n * d, self._dctx_magicless, d)
            if len(dims) not in (1, 2):
                raise PayloadError(f"{len(dims)} integer streams, expected 1 or 2")
            (w_refs, n_refs), (w_codes, n_codes) = dims if len(dims) == 2 else [(1, 0), *dims]
            out = np.empty((n, d), _KERNEL_DTYPES[dtype])
            step = np.array([2.0 * eb], out.dtype)
            status = kernels.decode_rows(raw, w_refs, n_refs, w_codes, n_codes, out, step)
            if status != kernels.OK:
                raise PayloadError(_DECODE_ERRORS[status])
            return torch.from_numpy(out)
        streams = unpack_streams(body, self._dctx, n * d, self._dctx_magicless, d)
        if len(streams) == 2:
            refs = torch.from_numpy(streams[0]).to(device)
            lit = unzigzag(torch.from_numpy(streams[1]).to(device))
            if refs.numel() != n or lit.numel() % d:
                raise PayloadError(
                    f"{refs.numel()} row references / {lit.numel()} codes do not "
                    f"fit {n} rows of {d}"
                )
            codes = undedup_rows(lit.view(-1, d), refs)
        elif len(streams) == 1:
            codes = unzigzag(torch.from_numpy(streams[0]).to(device))
            if codes.numel() != n * d:
                raise PayloadError(f"{codes.numel()} codes for a {n} x {d} tensor")
            codes = codes.view(n, d)
        else:
            raise PayloadError(f"{len(streams)} integer streams, expected 1 or 2")
        return dequantize(codes, eb, dtype)


@register_codec
class HybridCodec(_QuantPipeline):
    """Quantize + vector dedup (where it pays) + entropy coding."""

    codec_id = "hybrid"
    dedup = "auto"
    entropy = True


@register_codec
class HybridACCodec(_QuantPipeline):
    """hybrid, with codes arithmetic-coded under row-magnitude contexts where that is
    smaller than zstd: the most compact codec here, for links slower than its CPU cost."""

    codec_id = "hybrid-ac"
    dedup = "auto"
    entropy = True
    modelled = True


@register_codec
class QuantCodec(_QuantPipeline):
    """Quantization alone; codes packed at the narrowest byte width."""

    codec_id = "quant"


@register_codec
class QuantLZCodec(_QuantPipeline):
    """Quantization + vector dedup, no entropy coding."""

    codec_id = "quant+lz"
    dedup = "on"


@register_codec
class QuantEntropyCodec(_QuantPipeline):
    """Quantization + entropy coding (zstd on byte planes), no vector dedup."""

    codec_id = "quant+zstd"
    entropy = True
