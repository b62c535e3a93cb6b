"""The error-bounded hybrid codec and its single stages (arXiv 2407.04272, section 4).

    x (N, D) ──quantize(2 eb)──► codes ──vector dedup──► literal rows + refs ──entropy──► bytes

``hybrid`` deduplicates a chunk's rows when that pays (the paper chooses LZ or Huffman per
table), then entropy-codes; ``quant``, ``quant+lz`` and ``quant+zstd`` expose single stages
so the contribution of each can be measured. Every variant writes the same body layout,
which records the stages it used, so decoding depends on the bytes alone.

The entropy stage is zstd (Huffman-coded literals, FSE-coded sequences) over byte planes
of the zig-zagged codes, one frame per chunk.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
import zstandard

from recsz.codecs.base import Codec, PayloadError
from recsz.codecs.registry import register_codec
from recsz.codecs.stages import (
    ZSTD_MAGICLESS,
    dedup_rows,
    dequantize,
    magicless_zstd,
    pack_streams,
    quantize,
    undedup_rows,
    unpack_streams,
    unzigzag,
    zigzag,
)


class _QuantPipeline(Codec):
    """Quantize, then optionally deduplicate rows and entropy-code."""

    error_bounded = True
    dedup: ClassVar[str] = "off"  # "off", "on", or "auto" (when repeats save more than refs)
    entropy: ClassVar[bool] = False

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

    def _encode(self, x: torch.Tensor, eb: float) -> tuple[bytes, torch.Tensor]:
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
        return pack_streams(streams, self._cctx, ZSTD_MAGICLESS), missed

    def _decode(
        self,
        body: np.ndarray,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        eb: float,
        device: torch.device,
    ) -> torch.Tensor:
        n, d = shape
        streams = unpack_streams(body, self._dctx, n * d, self._dctx_magicless)
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
