"""Format-3 payloads for a codec: groups of segments in, one payload per group out, on
the tensors' device (CUDA: the Triton kernels of :mod:`recsz.codecs.blockcoder`; CPU: the
compiled loops of :mod:`recsz.codecs.blockcpu`, which write the same bytes).

A *group* is what one destination gets in one step: the rows of several tables (its
segments), each table under its own bound. The exchange hands every group of a direction
over in one call, with the bounds as one device tensor, so a GPU step codes a whole
direction in a handful of launches and reads nothing back but, where bytes leave the
rank, the payload sizes (``trim``).
"""

from __future__ import annotations

import torch

from recsz.codecs import blockcpu
from recsz.codecs import blockformat as bf
from recsz.codecs.checks import read_sizes
from recsz.codecs.payload import DTYPES, PayloadError
from recsz.devicepath import device_path

#: dtypes the block coder takes: float32, and fp16/bf16 (exact in float32; decoded as
#: float32, within the bound of the values sent).
TAKES = (torch.float32, torch.float16, torch.bfloat16)


def layouts(codec: str, dim: int, sizes: list[list[int]], dedup: bool) -> list[bf.Layout]:
    return [bf.Layout(codec, DTYPES[torch.float32], dim, tuple(s), dedup) for s in sizes]


def _kernels(device: torch.device) -> bool:
    return device_path(device)


def encode_segments(
    codec: str,
    dedup: bool,
    groups: list[tuple[torch.Tensor, list[int]]],
    ebs: torch.Tensor,
    trim: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One payload per group (rows (sum(sizes), D), sizes), and their used lengths (an
    int64 tensor on the groups' device); ``ebs``: a bound per segment, every group's in
    order. ``trim=False`` returns each payload in its whole capacity (no host read at
    all: for payloads that never leave this process and are decoded before the next call
    with the same shapes, which may reuse their memory)."""
    if not groups:
        return [], torch.zeros(0, dtype=torch.int64)
    dim = groups[0][0].shape[1]
    for x, sizes in groups:
        if x.dim() != 2 or x.shape[1] != dim or x.shape[0] != sum(sizes):
            raise ValueError(
                f"{codec}: group of shape {tuple(x.shape)} does not hold {sizes} x {dim}"
            )
        if x.dtype not in TAKES:
            raise ValueError(f"{codec}: the block coder takes {TAKES}, got {x.dtype}")
    if ebs.numel() != sum(len(s) for _, s in groups):
        raise ValueError(
            f"{codec}: {ebs.numel()} bounds for {sum(len(s) for _, s in groups)} segments"
        )
    lays = layouts(codec, dim, [s for _, s in groups], dedup)
    xs = [x.detach().to(torch.float32).contiguous() for x, _ in groups]
    dev = xs[0].device
    if not _kernels(dev):
        e = ebs.detach().to(torch.float64).cpu().numpy()
        out, k = [], 0
        for lay, x in zip(lays, xs, strict=True):
            n = len(lay.seg_rows)
            payload = blockcpu.encode_group(lay, x.numpy(), e[k : k + n])
            out.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            k += n
        return out, torch.tensor([p.numel() for p in out], dtype=torch.int64)
    from recsz.codecs import blockcoder

    # Shapes that repeat replay a CUDA graph, whose buffers the next call of the same
    # shapes reuses (blockcoder, static): untrimmed payloads never leave this process and
    # stay there; trimmed ones (read once for their sizes) are copied out, a few bytes.
    buf, base, used = blockcoder.encode(lays, xs, ebs.detach().to(device=dev), static=True)
    if not trim:
        return [buf[b : b + lay.capacity] for b, lay in zip(base, lays, strict=True)], used.clone()
    ends = read_sizes(used)  # held checks may ride along (HeldChecks.riding)
    kept = torch.cat([buf[b : b + n] for b, n in zip(base, ends, strict=True)])
    return list(kept.split(ends)), used.clone()


def decode_segments(
    payloads: list[torch.Tensor],
    codec: str,
    expect: list[bf.Layout] | None = None,
    check: bool = True,
) -> list[torch.Tensor]:
    """Rows of each payload, made by ``codec``. ``expect``: the layouts the caller knows
    (then no header is read on the host; a payload that differs fails its checks).
    ``check=False`` skips the one host read of the checks' flags, for payloads this
    process made itself (the rows then may live in memory that the next call with the
    same payload buffer reuses)."""
    if not payloads:
        return []
    dev = payloads[0].device
    if not _kernels(dev):
        out = []
        for i, p in enumerate(payloads):
            lay, y, _ = blockcpu.decode_group(p.detach().cpu().numpy())
            if lay.codec != codec:
                raise PayloadError(f"payload {i} was made by codec {lay.codec!r}, not {codec!r}")
            if expect is not None and lay != expect[i]:
                raise PayloadError(f"payload {i} holds {lay}, expected {expect[i]}")
            out.append(torch.from_numpy(y).to(dev))
        return out
    from recsz.codecs import blockcoder

    lays = expect if expect is not None else blockcoder.read_layouts(payloads)
    for i, lay in enumerate(lays):
        if lay.codec != codec:
            raise PayloadError(f"payload {i} was made by codec {lay.codec!r}, not {codec!r}")
    rows, _, ok = blockcoder.decode(payloads, lays, static=not check)
    if check:
        blockcoder.check(ok)
    return rows
