"""Which way code takes on a device: the GPU's (no host sync, kernels) or the CPU's.

Codecs, bounds, the row optimizer, the exchange's counters and the adaptive policy's probe
each have a path for GPUs (sync-free, Triton kernels, formats 3 and 4) and one for the CPU
(numpy, zstd, host reads that cost nothing there). ``RECSZ_DEVICE_PATH_ON_CPU=1`` (with
Triton's interpreter on: ``TRITON_INTERPRET=1``) sends the CPU down the GPU's path, so that
tests run it without a GPU: between ranks (the same bytes either way), and step by step
with the host reads a GPU would wait for counted (``tests/hostreads.py``).
"""

from __future__ import annotations

import os

import torch

DEVICE_PATH_ON_CPU = "RECSZ_DEVICE_PATH_ON_CPU"


def device_path(device: torch.device) -> bool:
    """Whether code on ``device`` takes the GPU's path."""
    return device.type == "cuda" or os.environ.get(DEVICE_PATH_ON_CPU) == "1"
