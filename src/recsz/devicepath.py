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
from collections.abc import Sequence

import torch

DEVICE_PATH_ON_CPU = "RECSZ_DEVICE_PATH_ON_CPU"


def device_path(device: torch.device) -> bool:
    """Whether code on ``device`` takes the GPU's path."""
    return device.type == "cuda" or os.environ.get(DEVICE_PATH_ON_CPU) == "1"


class Indices:
    """Index tensors on a device, each made once: ``indices(order, device)``. A Python list
    used as an index, or ``torch.tensor(list, device=)`` in every step, copies host values
    to a GPU from pageable memory: the host waits for the GPU's queue each time."""

    def __init__(self) -> None:
        self._made: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def __call__(self, order: Sequence[int], device: torch.device) -> torch.Tensor:
        key = (tuple(order), device)
        if key not in self._made:
            self._made[key] = torch.tensor(order, dtype=torch.int64, device=device)
        return self._made[key]
