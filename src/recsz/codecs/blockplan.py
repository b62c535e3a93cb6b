"""Where everything of a call of the format-3 device coder sits, from the shapes alone.

A :class:`Plan` is built once per set of layouts (and payload places): the host works out
the per-group and per-piece numbers and uploads them in one asynchronous copy; the per-row
and per-block indices the kernels need (:mod:`recsz.codecs.blockkernels` names the index
spaces) are derived from them on the device. Nothing after the upload reads or writes
host memory, so the coder's work can be captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recsz.codecs import blockformat as bf
from recsz.codecs.payload import MAGIC, upload
from recsz.devicepath import device_path

_pad1 = torch.nn.functional.pad
#: Per group: payload start and end, header places, rows, blocks, segments, the fixed
#: header words' checksum share.
_GROUP = ("base", "end", "wat", "fat", "ebat", "row0", "npad", "nrb", "rb0", "bs", "nb", "k",
          "seg0", "hfix")  # fmt: skip


@dataclass
class Plan:
    """One call's layouts, the payloads' first bytes, and the device tensors of their
    indices (``t[name]``)."""

    lays: list[bf.Layout]
    base: list[int]
    dev: torch.device
    t: dict[str, torch.Tensor] = field(default_factory=dict)
    ends: list[int] = field(default_factory=list)
    graph: tuple[Any, Any] | None = None  # a captured CUDA graph and its outputs
    calls: int = 0

    @property
    def g(self) -> int:
        return len(self.lays)

    @property
    def dim(self) -> int:
        return self.lays[0].dim

    @property
    def rows(self) -> int:
        return sum(lay.padded for lay in self.lays)

    @property
    def blocks(self) -> int:
        return sum(lay.max_blocks for lay in self.lays)

    @property
    def ref_blocks(self) -> int:
        return sum(lay.ref_blocks for lay in self.lays)

    @property
    def segments(self) -> int:
        return sum(len(lay.seg_rows) for lay in self.lays)

    @property
    def dedup(self) -> bool:
        return self.lays[0].dedup

    @property
    def size(self) -> int:
        return self.base[-1] + self.lays[-1].capacity if self.lays else 0


def build(
    lays: list[bf.Layout],
    base: list[int],
    ends: list[int],
    dev: torch.device,
    relative: bool = False,
) -> Plan:
    """The plan of payloads ``lays`` at bytes ``base`` (each ending by ``ends``): per group
    and per piece (a segment's rows, or a group's pad rows) numbers from the host, in one
    upload; the per-row and per-block indices derived from them on the device (sizes
    change every step under id-aware traffic, so plans are made often). ``relative``: the
    header image's positions from each payload's first byte (a decoder's, whose payloads
    may sit elsewhere in the next buffer: only ``t["base"]`` and ``t["end"]`` then change)."""
    p = Plan(lays, list(base), dev, ends=list(ends))
    cols: dict[str, list[int]] = {k: [] for k in _GROUP}
    pseg, pfirst = [], []
    row0 = rb0 = bs = seg0 = 0
    for lay, b, e in zip(lays, base, ends, strict=True):
        k, npad = len(lay.seg_rows), lay.padded
        head = np.frombuffer(lay.head(), "<u4")  # words [8, eb_at), L and data_len zero
        vals = (b, e, lay.widths_at, lay.fields_at, lay.eb_at, row0, npad, lay.ref_blocks, rb0,
                bs, lay.max_blocks, k, seg0, bf.word_hash(head))  # fmt: skip
        for name, v in zip(_GROUP, vals, strict=True):
            cols[name].append(v)
        c = [*lay.seg_rows, npad - lay.rows]
        pseg += [*range(seg0, seg0 + k), -1]
        pfirst += (row0 + np.cumsum(c) - c).tolist()
        row0 += npad
        rb0 += lay.ref_blocks
        bs += lay.max_blocks
        seg0 += k
    ipos, ival, ig = _image(lays, [0] * len(lays) if relative else base)
    arrays = {**{k: np.asarray(v, np.int64) for k, v in cols.items()}, "pseg": pseg,
              "pfirst": pfirst, "ipos": ipos,
              "ibounds": np.searchsorted(ig, np.arange(len(lays) + 1)),
              "mult": bf.HASH_MULT[: lays[0].dim]}  # fmt: skip
    flat = np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in arrays.values()])
    # the header bytes ride in the same upload, as the int64 words after the indices
    tail = np.zeros(-(-ival.size // 8) * 8, np.uint8)
    tail[: ival.size] = ival
    dev_flat = upload(np.concatenate([flat, tail.view(np.int64)]), torch.int64, dev)
    at = 0
    for name, a in arrays.items():
        n = np.asarray(a).size
        p.t[name] = dev_flat[at : at + n]
        at += n
    p.t["ival"] = dev_flat[at:].view(torch.uint8)[: ival.size]
    _derive(p)
    return p


def _derive(p: Plan) -> None:
    """Per row: its index, group, segment (-1: pad), first row of its piece, reference
    slot; per block and per reference block: group. One Triton launch (no host sync;
    ``tests/reference.py`` has them in torch operations)."""
    import triton

    from recsz.codecs.blockkernels import plan_kernel

    t, rows, dev = p.t, p.rows, p.dev
    i64 = torch.empty(3 * rows, dtype=torch.int64, device=dev)
    i32 = torch.empty(2 * rows + p.blocks + p.ref_blocks, dtype=torch.int32, device=dev)
    t["arange"], t["rfirst"], t["rslot"] = i64.split([rows] * 3)
    t["rgroup"], t["rseg"], t["bgid"], t["refg"] = i32.split([rows, rows, p.blocks, p.ref_blocks])
    n, pieces = max(rows, p.blocks, p.ref_blocks), t["pfirst"].numel()
    if n:
        plan_kernel[(triton.cdiv(n, PLAN_ROWS),)](
            t["pfirst"], t["pseg"], t["row0"], t["rb0"], t["bs"], t["arange"], t["rgroup"],
            t["rseg"], t["rfirst"], t["rslot"], t["bgid"], t["refg"], rows, pieces, p.g,
            p.blocks, p.ref_blocks, pieces.bit_length(), p.g.bit_length(), B=PLAN_ROWS,
        )  # fmt: skip


PLAN_ROWS = 1024  # indices per program of plan_kernel


def _image(lays: list[bf.Layout], base: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, bytes and groups of what the shapes fix: prefix, header but L/data_len."""
    pos, val, grp = [], [], []
    for i, (lay, b) in enumerate(zip(lays, base, strict=True)):
        head = np.frombuffer(lay.head(), np.uint8)
        at = lay.fields_at - 8 + bf.L_AT
        keep = np.r_[0:at, at + 8 : head.size]
        pos += [b + np.arange(4), b + 8 + keep]
        val += [np.frombuffer(MAGIC + bytes([bf.FORMAT]), np.uint8), head[keep]]
        grp.append(np.full(4 + keep.size, i))
    return np.concatenate(pos), np.concatenate(val), np.concatenate(grp)


def ranges(starts: torch.Tensor, lens: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenated aranges starts[g] + [0, lens[g]) on the device."""
    shift = starts - (torch.cumsum(lens, 0) - lens)
    return torch.arange(total, device=lens.device) + torch.repeat_interleave(
        shift, lens, output_size=total
    )


def group_of(lens: torch.Tensor, total: int) -> torch.Tensor:
    ids = torch.arange(lens.numel(), device=lens.device)
    return torch.repeat_interleave(ids, lens, output_size=total)


def word_spans(
    first: torch.Tensor, lens: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The words of spans ``[first[g], first[g] + lens[g])``: their indices, span, index
    within the span, and the spans' bounds in that list (for :func:`word_sums`)."""
    idx = ranges(first, lens, total)
    g = group_of(lens, total)
    return idx, g, idx - first[g], _pad1(torch.cumsum(lens, 0), (1, 0))


def span_sums(
    words: torch.Tensor, first: torch.Tensor, lens: torch.Tensor, longest: int
) -> torch.Tensor:
    """Per span g, the sum of words[first[g] + i] x (2i + 1) for i < lens[g], modulo 2^32
    (int64): one Triton launch on a GPU (no index tensors), :func:`word_sums` elsewhere."""
    if not device_path(words.device):
        idx, _, local, bounds = word_spans(first, lens, int(lens.sum()))
        return word_sums(words, idx, local, bounds)
    import triton

    from recsz.codecs.blockkernels import word_sum_kernel

    out = torch.zeros(first.numel(), dtype=torch.int32, device=words.device)
    if longest and first.numel():
        grid = (triton.cdiv(longest, SUM_CHUNK), first.numel())
        word_sum_kernel[grid](words, first, lens, out, CHUNK=SUM_CHUNK)
    return out.to(torch.int64) & bf.MASK32


SUM_CHUNK = 4096  # words per program of span_sums


def word_sums(
    words: torch.Tensor, idx: torch.Tensor, local: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """The checksum of formats 3 and 4 over spans of words (:func:`word_spans`): per span,
    the sum of words[idx] x (2 local + 1), modulo 2^32."""
    v = (words[idx].to(torch.int64) & bf.MASK32) * (2 * local + 1)
    return segment_sum(v, bounds) & bf.MASK32


def segment_sum(v: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Sums of v over consecutive segments [bounds[g], bounds[g + 1]) (int64, wrapping):
    a prefix sum, not atomics (a few segments of many values would contend)."""
    cz = _pad1(torch.cumsum(v.to(torch.int64), 0), (1, 0))
    return cz[bounds[1:]] - cz[bounds[:-1]]


def as_u32(v: torch.Tensor) -> torch.Tensor:
    """Values modulo 2^32 as int32 (their bytes are the u32's)."""
    v = v & bf.MASK32
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)
