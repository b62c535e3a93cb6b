"""Where everything of a call of the format-3 device coder sits, from the shapes alone.

A :class:`Plan` is built once per set of layouts (and payload places): the host works out
per-group and per-piece numbers and the small index sets (header fields, bounds), and
uploads them in one asynchronous copy; the per-row and per-block indices are derived from
them on the device by a few torch operations. Nothing after the upload reads or writes
host memory, so the coder's work can be captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recsz.codecs import blockformat as bf
from recsz.codecs.payload import MAGIC, upload

_pad1 = torch.nn.functional.pad
_GROUP_COLS = ("nrb", "nb", "cb0", "rb0", "bs", "base", "wat", "row0", "npad", "ebat", "fat", "end")


@dataclass
class Plan:
    """One call's layouts, the payloads' first bytes, and the device tensors derived from
    them (``t[name]``)."""

    lays: list[bf.Layout]
    base: list[int]
    dev: torch.device
    t: dict[str, torch.Tensor] = field(default_factory=dict)
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
    def dedup(self) -> bool:
        return self.lays[0].dedup

    @property
    def size(self) -> int:
        return self.base[-1] + self.lays[-1].capacity if self.lays else 0


def build(lays: list[bf.Layout], base: list[int], ends: list[int], dev: torch.device) -> Plan:
    """The plan of payloads ``lays`` at bytes ``base`` (each ending by ``ends``)."""
    p = Plan(lays, base, dev)
    cols: dict[str, list[int]] = {k: [] for k in _GROUP_COLS}
    counts, ext, is_pad, wb, hh = [], [], [], [], []
    row0 = cb0 = rb0 = bs = s = 0
    for lay, b, e in zip(lays, base, ends, strict=True):
        k = len(lay.seg_rows)
        for name, v in zip(_GROUP_COLS, (lay.ref_blocks, lay.max_blocks, cb0, rb0, bs, b,
                                         lay.widths_at, row0, lay.padded, lay.eb_at,
                                         lay.fields_at, e), strict=True):  # fmt: skip
            cols[name].append(v)
        row0 += lay.padded
        cb0 += lay.code_blocks(lay.padded)
        rb0 += lay.ref_blocks
        bs += lay.max_blocks
        counts += [*lay.seg_rows, lay.padded - lay.rows]
        ext += [*range(s, s + k), -1]  # -1: the pad rows' bound (1.0)
        is_pad += [0] * k + [1]
        s += k
        wb.append(lay.data_at(lay.padded) - lay.widths_at)  # widths with their zero pad
        hh.append((lay.data_at(lay.padded) - 8) // 4)
    ipos, ival, ig = _image(lays, base)
    small = {
        "eb_pos": _spans(
            [b + lay.eb_at for lay, b in zip(lays, base, strict=True)],
            [8 * len(lay.seg_rows) for lay in lays],
        ),
        "field_pos": _spans(
            [b + lay.fields_at + bf.L_AT for lay, b in zip(lays, base, strict=True)],
            [8] * len(lays),
        ),
        "ck_pos": _spans([b + 4 for b in base], [4] * len(lays)),
        "ipos": ipos,
        "ibounds": np.searchsorted(ig, np.arange(len(lays) + 1)),
        "mult": bf.HASH_MULT[: lays[0].dim],
    }
    arrays = {**{k: np.asarray(v, np.int64) for k, v in cols.items()}, "counts": counts,
              "ext": ext, "is_pad": is_pad, "wb": wb, "hh": hh, **small}  # fmt: skip
    flat = np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in arrays.values()])
    dev_flat = upload(flat, torch.int64, dev)
    at = 0
    for name, a in arrays.items():
        n = np.asarray(a).size
        p.t[name] = dev_flat[at : at + n]
        at += n
    p.t["ival"] = upload(ival, torch.uint8, dev)
    _derive(p)
    return p


def _spans(starts: list[int], lens: list[int]) -> np.ndarray:
    if not starts:
        return np.zeros(0, np.int64)
    return np.concatenate([s + np.arange(n) for s, n in zip(starts, lens, strict=True)])


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


def _derive(p: Plan) -> None:
    """Per-row and per-block indices, on the device."""
    t = p.t
    r = torch.arange(p.rows, device=p.dev)
    t["piece"] = group_of(t["counts"], p.rows)
    t["rgroup"] = group_of(t["npad"], p.rows)
    t["rlocal"] = r - t["row0"][t["rgroup"]]
    t["rfirst"] = (torch.cumsum(t["counts"], 0) - t["counts"])[t["piece"]]
    t["rpad"] = t["is_pad"][t["piece"]].to(torch.int8)
    t["rslot"] = t["rb0"][t["rgroup"]] * bf.LANES + t["rlocal"]
    t["rrow0"] = t["row0"][t["rgroup"]]
    t["rext"] = t["ext"][t["piece"]]
    gid = group_of(t["nb"], p.blocks)
    local = torch.arange(p.blocks, device=p.dev) - t["bs"][gid]
    nrb = t["nrb"][gid]
    t["gid"], t["blocal"] = gid, local
    t["src"] = torch.where(local < nrb, -(t["rb0"][gid] + local) - 1, t["cb0"][gid] + local - nrb)
    t["bbase"] = t["base"][gid]
    wb_total = int(sum(lay.data_at(lay.padded) - lay.widths_at for lay in p.lays))
    t["wpos"] = ranges(t["base"] + t["wat"], t["wb"], wb_total)
    t["wg"] = group_of(t["wb"], wb_total)
    t["wk"] = t["wpos"] - (t["base"] + t["wat"])[t["wg"]]
    t["rbounds"] = _pad1(torch.cumsum(t["npad"], 0), (1, 0))
    t["bbounds"] = _pad1(torch.cumsum(t["nb"], 0), (1, 0))
    hh_total = int(sum((lay.data_at(lay.padded) - 8) // 4 for lay in p.lays))
    t["hidx"], t["hg"], t["hi"], t["hbounds"] = word_spans((t["base"] + 8) // 4, t["hh"], hh_total)


def word_spans(
    first: torch.Tensor, lens: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The words of spans ``[first[g], first[g] + lens[g])``: their indices, span, index
    within the span, and the spans' bounds in that list (for :func:`word_sums`)."""
    idx = ranges(first, lens, total)
    g = group_of(lens, total)
    return idx, g, idx - first[g], _pad1(torch.cumsum(lens, 0), (1, 0))


def literal_rank(p: Plan, lit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's rank among its group's literal rows, and each group's literal count."""
    cz = _pad1(torch.cumsum(lit.to(torch.int64), 0), (1, 0))
    r0 = p.t["row0"]
    return cz[:-1] - cz[r0][p.t["rgroup"]], cz[r0 + p.t["npad"]] - cz[r0]


def block_counts(p: Plan, literal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's block count and data start, given its literal rows."""
    n_blocks = p.t["nrb"] + (literal * p.dim + bf.LANES - 1) // bf.LANES
    return n_blocks, p.t["wat"] + ((n_blocks + 1) // 2 + 3) // 4 * 4


def offsets(p: Plan, w: torch.Tensor, data_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offset of every block, and each group's data length."""
    size = torch.where(w == bf.RAW, 4 * bf.LANES, 4 * w.to(torch.int64))
    cz = _pad1(torch.cumsum(size, 0), (1, 0))
    start = cz[p.t["bs"]]
    data_len = cz[p.t["bs"] + p.t["nb"]] - start
    off = cz[:-1] + (p.t["base"] + data_at - start)[p.t["gid"]]
    return off, data_len


def head_hash(p: Plan, words: torch.Tensor, data_at: torch.Tensor) -> torch.Tensor:
    """Checksum share of each payload's words from byte 8 to its data (header, widths)."""
    i = p.t["hi"]
    keep = i < (data_at[p.t["hg"]] - 8) // 4
    idx = p.t["hidx"].clamp(max=words.numel() - 1)
    return word_sums(words, idx, i, p.t["hbounds"], keep)


def word_sums(
    words: torch.Tensor,
    idx: torch.Tensor,
    local: torch.Tensor,
    bounds: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The checksum of formats 3 and 4 over spans of words (:func:`word_spans`): per span,
    the sum of words[idx] x (2 local + 1) (only where ``keep``), modulo 2^32."""
    v = (words[idx].to(torch.int64) & bf.MASK32) * (2 * local + 1)
    return segment_sum(v if keep is None else v * keep, bounds) & bf.MASK32


def segment_sum(v: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Sums of v over consecutive segments [bounds[g], bounds[g + 1]) (int64, wrapping):
    a prefix sum, not atomics (a few segments of many values would contend)."""
    cz = _pad1(torch.cumsum(v.to(torch.int64), 0), (1, 0))
    return cz[bounds[1:]] - cz[bounds[:-1]]


def part_hash(p: Plan, parts: torch.Tensor) -> torch.Tensor:
    """Checksum share of each payload's blocks (the kernels' per-block parts)."""
    return segment_sum(parts.to(torch.int64) & bf.MASK32, p.t["bbounds"])


def as_u32(v: torch.Tensor) -> torch.Tensor:
    """Values modulo 2^32 as int32 (their bytes are the u32's)."""
    v = v & bf.MASK32
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)
