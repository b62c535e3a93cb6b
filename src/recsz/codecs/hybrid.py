"""The error-bounded hybrid codec and its single stages (arXiv 2407.04272, section 4).

    x (N, D) ──quantize(2 eb)──► codes ──vector dedup──► literal rows + refs ──entropy──► bytes

``hybrid`` deduplicates a chunk's rows when that pays (the paper chooses LZ or Huffman per
table), then entropy-codes; ``quant`` is the quantizer alone (the fastest to code: it wins
at 10 Gbit/s here). Both write the same body layout, which records the stages it used, so
decoding depends on the bytes alone. (``quant+lz`` and ``quant+zstd``, the single later
stages, went: they won no row of ``bench_train.py``; results/issue18/session8.)

On the CPU (format 1) the entropy stage codes each integer stream on its own: the literal
codes and the row references by zstd (Huffman-coded literals) over byte planes of the
zig-zagged integers, each kept only where it is smaller than the raw planes; fused numba
kernels (:mod:`recsz.codecs.kernels`) do everything but zstd. fp16/bf16 chunks are coded
from their float32 values and checked in their own precision (misses travel exactly).

float32 on a GPU (and ``coder="blocks"`` anywhere) takes format 3
(:mod:`recsz.codecs.blocks`): a destination's tables in one payload, bit-plane blocks made
by Triton kernels without a host sync. Other dtypes on a GPU go through the host.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from recsz.codecs import blocks, kernels
from recsz.codecs.base import Codec
from recsz.codecs.payload import Header, PayloadError
from recsz.codecs.registry import register_codec
from recsz.codecs.stages import magicless_zstd, pack_planes, unpack_planes
from recsz.devicepath import device_path

_KERNEL_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
CODERS = ("auto", "blocks")
_DECODE_ERRORS = {
    kernels.BAD_LITERAL_COUNT: "row references and literal codes do not fit the shape",
    kernels.BAD_REFERENCE: "vector reference points past the literal rows",
}


class QuantPipeline(Codec):
    """Quantize, then optionally deduplicate rows and entropy-code."""

    error_bounded = True
    dedup: ClassVar[bool] = False  # references to repeated rows, where they save bytes
    entropy: ClassVar[bool] = False
    #: Payload format: "auto" = format 1 (zstd) on the CPU, format 3 for
    #: float32 on a GPU; "blocks" = format 3 on every device (what GPUs send).
    default_coder: ClassVar[str] = "auto"

    def __init__(self, level: int = 1, coder: str | None = None) -> None:
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        coder = self.default_coder if coder is None else coder
        if coder not in CODERS:
            raise ValueError(f"coder must be one of {CODERS}, got {coder!r}")
        self.level = int(level)
        self.coder = coder
        # Reused (de)compression contexts: creating one costs more than coding a chunk.
        cctx, self._dctx = magicless_zstd(self.level)
        self._cctx = cctx if self.entropy else None

    def get_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"level": self.level} if self.entropy else {}
        if self.coder != self.default_coder:
            cfg["coder"] = self.coder
        return cfg

    #: The kernel's bound check fails for NaN/Inf, which makes them outliers.
    takes_nonfinite = True

    def _own_format(self, x: torch.Tensor) -> bool:
        # Format 3 for float32; other dtypes are coded on the host.
        return x.dtype == torch.float32 and self.segments_on(x.device)

    def segments_on(self, device: torch.device) -> bool:
        return self.coder == "blocks" or (self.coder == "auto" and device_path(device))

    def _encode_own_groups(
        self, groups: list[tuple[torch.Tensor, list[int]]], ebs: torch.Tensor | None, trim: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        if ebs is None:
            raise ValueError(f"{self.codec_id} needs an error bound per table")
        return blocks.encode_segments(self.codec_id, self.dedup, groups, ebs, trim)

    def _decode_own_groups(
        self, payloads: list[torch.Tensor], sizes: list[list[int]] | None, dim: int, check: bool
    ) -> list[torch.Tensor]:
        expect = None
        if sizes is not None:
            expect = blocks.layouts(self.codec_id, dim, sizes, self.dedup)
        return blocks.decode_segments(payloads, self.codec_id, expect, check)

    def _decode_blocks(self, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        return blocks.decode_segments(payloads, self.codec_id)

    def warm_up(self) -> None:
        # Repeated rows exercise every kernel: quantize, dedup, references.
        x = torch.arange(64, dtype=torch.float32).view(16, 4).remainder_(3)
        self.decode(self.encode(x, 0.1))

    def _encode(self, x: torch.Tensor, eb: float) -> tuple[bytes, torch.Tensor]:
        narrow = x.dtype not in _KERNEL_DTYPES  # fp16/bf16: coded from float32
        a = (x.float() if narrow else x).numpy()
        qmax = kernels.QMAX32 if a.dtype == np.float32 else kernels.QMAX64
        step = np.array([2.0 * eb], a.dtype)
        planes, w_refs, n_refs, w_codes, n_codes, missed = kernels.encode_rows(
            a, step, eb, self.dedup, qmax
        )
        dims = [(w_refs, n_refs), (w_codes, n_codes)] if n_refs else [(w_codes, n_codes)]
        body = pack_planes(dims, planes, self._cctx)
        miss = torch.from_numpy(missed)
        if narrow:  # decoded values round to x's dtype: check them there
            h = Header(self.codec_id, self.version, {}, x.dtype, tuple(x.shape), eb, 0)
            y = self._decode(np.frombuffer(body, np.uint8), h, x.device)
            far = torch.nonzero(((y.double() - x.double()).abs() > eb).view(-1)).view(-1)
            miss = torch.cat([miss.to(torch.int64), far])
        return body, miss

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        # Host-made (format 1) payloads of any h.dtype: the kernel reconstructs q * 2eb in the
        # working precision, rounded once to the h.dtype, as the encoder's check assumed.
        n, d = h.shape
        dims, raw = unpack_planes(body, n * d, self._dctx)
        if len(dims) not in (1, 2):
            raise PayloadError(f"{len(dims)} integer streams, expected 1 or 2")
        (w_refs, n_refs), (w_codes, n_codes) = dims if len(dims) == 2 else [(1, 0), *dims]
        out = np.empty((n, d), _KERNEL_DTYPES.get(h.dtype, np.float32))
        step = np.array([2.0 * h.eb], out.dtype)
        status = kernels.decode_rows(raw, w_refs, n_refs, w_codes, n_codes, out, step)
        if status != kernels.OK:
            raise PayloadError(_DECODE_ERRORS[status])
        return torch.from_numpy(out).to(device=device, dtype=h.dtype)


@register_codec
class HybridCodec(QuantPipeline):
    """Quantize + vector dedup (where it pays) + entropy coding."""

    codec_id = "hybrid"
    dedup = True
    entropy = True


@register_codec
class QuantCodec(QuantPipeline):
    """Quantization alone; codes packed at the narrowest byte width."""

    codec_id = "quant"
