"""TorchRec's quantized comms, as the anchors of our benchmarks: fbgemm's own codecs.

TorchRec's ``QCommsConfig`` (torchrec/distributed/fbgemm_qcomm_codec.py) builds its
all-to-all codecs from ``fbgemm_gpu.quantize_comm.QuantizedCommCodec``; these codecs call
exactly that, so benchmark rows named ``tr-*`` are the real anchor, not an imitation. They
need ``fbgemm-gpu-cpu==1.8.0`` (the ``anchors`` extra; 1.9 does not load on torch 2.13).

- ``tr-fp16``, ``tr-bf16``: casts; ``tr-fp8``: fbgemm's HFP8 (one byte an element, no
  row scale); ``tr-mx4``: OCP MX4 (4-bit elements, a shared exponent per 32), rows padded
  to a multiple of 32 as fbgemm's row layout requires.
None is error-bounded: their error is relative to the values.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import numpy as np
import torch

from recsz.codecs.base import Codec, saturating_cast
from recsz.codecs.payload import Header, PayloadError, tensor_bytes, tensor_from_bytes
from recsz.codecs.registry import register_codec

_QDTYPE = {"FP16": torch.float16, "BF16": torch.bfloat16, "FP8": torch.uint8, "MX4": torch.uint8}


def fbgemm_available() -> bool:
    try:
        importlib.import_module("fbgemm_gpu.quantize_comm")
    except Exception:  # ImportError, or a build that does not load on this torch
        return False
    return True


class _FbgemmCodec(Codec):
    sparse_type: ClassVar[str]

    def check_installed(self) -> None:
        self._modules()

    def _modules(self) -> tuple[Any, Any]:
        try:
            return (importlib.import_module("fbgemm_gpu.quantize_comm"),
                    importlib.import_module("fbgemm_gpu.split_embedding_configs"))  # fmt: skip
        except Exception as e:  # ImportError, or a build that does not load on this torch
            raise ImportError(
                f"codec {self.codec_id!r} needs fbgemm: pip install --no-deps "
                f"fbgemm-gpu-cpu==1.8.0  (or pip install 'recsz[anchors]'); {e}"
            ) from None

    def _codec(self, row_dim: int) -> Any:
        qc, cfg = self._modules()
        st = getattr(cfg.SparseType, self.sparse_type)
        if self.sparse_type in ("FP8", "MX4"):
            return qc.QuantizedCommCodec(st, row_dim=row_dim)
        return qc.QuantizedCommCodec(st)

    def _padded_dim(self, d: int) -> int:
        return -(-d // 32) * 32 if self.sparse_type == "MX4" else d

    def _encode(self, x: torch.Tensor, eb: float) -> bytes:
        _n, d = x.shape
        dp = self._padded_dim(d)
        xf = saturating_cast(x, torch.float32)
        if dp != d:
            xf = torch.nn.functional.pad(xf, (0, dp - d))
        return tensor_bytes(self._codec(dp).encode(xf.contiguous()))

    def _decode(self, body: np.ndarray, h: Header, device: torch.device) -> torch.Tensor:
        n, d = h.shape
        dp = self._padded_dim(d)
        qd = _QDTYPE[self.sparse_type]
        raw = tensor_from_bytes(body, qd)
        if self.sparse_type != "MX4":
            if raw.numel() != n * dp:
                raise PayloadError(f"{self.codec_id}: {raw.numel()} values for {n} x {dp}")
            raw = raw.view(n, dp)
        y = self._codec(dp).decode(raw).float().reshape(-1)
        if y.numel() < n * dp:
            raise PayloadError(f"{self.codec_id}: decodes to {y.numel()} values, need {n * dp}")
        return saturating_cast(y[: n * dp].view(n, dp)[:, :d].contiguous(), h.dtype).to(device)


@register_codec
class TorchRecFP16(_FbgemmCodec):
    """fbgemm QuantizedCommCodec(FP16)."""

    codec_id = "tr-fp16"
    sparse_type = "FP16"


@register_codec
class TorchRecBF16(_FbgemmCodec):
    """fbgemm QuantizedCommCodec(BF16)."""

    codec_id = "tr-bf16"
    sparse_type = "BF16"


@register_codec
class TorchRecFP8(_FbgemmCodec):
    """fbgemm QuantizedCommCodec(FP8): HFP8, one byte an element."""

    codec_id = "tr-fp8"
    sparse_type = "FP8"


@register_codec
class TorchRecMX4(_FbgemmCodec):
    """fbgemm QuantizedCommCodec(MX4): 4-bit elements with a shared exponent per 32."""

    codec_id = "tr-mx4"
    sparse_type = "MX4"
