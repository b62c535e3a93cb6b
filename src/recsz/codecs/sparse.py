"""Sparse codecs for Dynamic Communication Thresholding (Gupta et al., KDD 2021, arXiv 2010.08899).

- ``dct``: the hard threshold of DCT-MP. Entries with ``|x| >= eb`` travel exactly, the
  rest are dropped (decoded as 0). The bound handed in is the threshold, which the DCT
  policy refreshes every L iterations to keep a target fraction; since every dropped
  entry has ``|x| < eb``, the codec is error-bounded by that threshold.
- ``dct-mask``: lossless, sends the nonzero entries only: the backward pass of DCT-MP,
  whose gradients the training loop has masked to the entries kept in the forward pass.

Body: a zstd-compressed bitmap of kept positions (row-major), then the kept values in
the input dtype.
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard

from recsz.codecs.base import Codec
from recsz.codecs.payload import (
    Header,
    PayloadError,
    join_sections,
    split_sections,
    tensor_bytes,
    tensor_from_bytes,
)
from recsz.codecs.registry import register_codec


class _MaskCodec(Codec):
    """Bitmap + values of the entries ``_keep`` selects."""

    def __init__(self) -> None:
        self._cctx = zstandard.ZstdCompressor(
            level=1, write_content_size=False, write_dict_id=False
        )
        self._dctx = zstandard.ZstdDecompressor()

    def _keep(self, x: torch.Tensor, eb: float) -> torch.Tensor:
        raise NotImplementedError

    def _encode(self, x: torch.Tensor, eb: float) -> bytes:
        keep = self._keep(x, eb).view(-1)
        bits = np.packbits(keep.cpu().numpy())
        return join_sections([self._cctx.compress(bits.tobytes()), tensor_bytes(x.view(-1)[keep])])

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        bits_z, vals = split_sections(body, 2)
        n = int(np.prod(h.shape))
        try:
            bits = self._dctx.decompress(bits_z.tobytes(), max_output_size=(n + 7) // 8)
        except zstandard.ZstdError as e:
            raise PayloadError(f"{self.codec_id}: bitmap does not decode: {e}") from None
        if len(bits) != (n + 7) // 8:
            raise PayloadError(f"{self.codec_id}: bitmap of {len(bits)} bytes for {n} entries")
        keep = np.unpackbits(np.frombuffer(bits, np.uint8), count=n).astype(bool)
        kept = tensor_from_bytes(vals, h.dtype, int(keep.sum()))
        out = torch.zeros(n, dtype=h.dtype)
        out[torch.from_numpy(keep)] = kept
        return out.view(h.shape).to(device)


@register_codec
class DCTCodec(_MaskCodec):
    """Hard threshold: keep |x| >= eb exactly, drop the rest (error < eb)."""

    codec_id = "dct"
    error_bounded = True
    threshold = True

    def _keep(self, x: torch.Tensor, eb: float) -> torch.Tensor:
        return x.abs() >= eb


@register_codec
class DCTMaskCodec(_MaskCodec):
    """Backward of DCT-MP: the training loop masks gradients with the forward's kept set;
    only the nonzero entries travel (lossless)."""

    codec_id = "dct-mask"
    lossless = True
    forward_mask = True

    def _keep(self, x: torch.Tensor, eb: float) -> torch.Tensor:
        return x != 0
