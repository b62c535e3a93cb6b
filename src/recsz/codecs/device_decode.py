"""Decoding device-made (format 2) payloads of the quantizing codecs, batched.

The inverse of :mod:`recsz.codecs.device_encode` (which describes the layout): headers and
stream tables are read from small host copies (one for all payloads per round), the
Huffman planes of every payload are decoded together (:func:`recsz.codecs.huffman.
decode_planes`), and rows are rebuilt, dequantized and patched with outliers for all
payloads of one dtype and width at once. Damaged payloads raise PayloadError: every index
into device memory is clamped first, and one check at the end rejects what did not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from recsz.codecs import huffman as H
from recsz.codecs.devbuf import Uploads, excl, nonzero_known
from recsz.codecs.devframe import Frame, HostWindows, fetch_windows, open_device, read_outliers
from recsz.codecs.payload import PayloadError, read_uvarint
from recsz.codecs.stages import HUFF_PLANES, PLANES, RAW, SPLIT, work_dtype

if TYPE_CHECKING:
    from recsz.codecs.hybrid import QuantPipeline


@dataclass
class _DSeg:
    payload: int
    stream: int
    plane: int
    n: int
    kind: int
    value: int = 0  # CONST
    at: int = 0  # RAW: byte offset in the payload; HUFF: offset of its block starts
    nbits: int = 0
    nw: int = 0
    words_at: int = 0
    lengths: np.ndarray | None = None


def decode_batch(codec: QuantPipeline, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Decode format-2 payloads of ``codec`` on their (common) device."""
    dev = payloads[0].device
    buf, frames, readers = open_device(codec, payloads)
    # Stream tables are read from the host copies; what lies beyond them (the second
    # stream's metadata after the first stream's data) comes in one more copy per round.
    for _ in range(4):
        need: list[tuple[int, int, int]] = []
        metas = [_streams(c, f, readers[c], need) for c, f in enumerate(frames)]
        if not need:
            return _reconstruct(metas, frames, buf, dev)
        fetch_windows(payloads, readers, need)
    raise PayloadError("payload metadata is nested too deep to parse")


def _streams(c: int, f: Frame, r: HostWindows, need: list[tuple[int, int, int]]) -> dict:
    """The stream layout of payload ``c``'s core; appends to ``need`` what to fetch."""
    if len(f.shape) != 2:
        raise PayloadError(f"shape {f.shape} is not 2-D")
    n, d = f.shape
    m: dict = {"shape": (n, d), "dtype": f.dtype, "eb": f.eb, "segs": [], "dims": []}
    core, core_len = f.core
    if n * d == 0:
        return m
    hd = r.get(core, 64)
    if hd is None:
        need.append((c, core, 64))
        return m
    cnt = int(hd[0])
    if cnt not in (1, 2):
        raise PayloadError(f"{cnt} integer streams, expected 1 or 2")
    p = 1
    for _ in range(cnt):
        w = int(hd[p])
        num, p = read_uvarint(hd, p + 1)
        if w not in (1, 2, 4, 8) or num > n * d:
            raise PayloadError(f"bad integer stream header (width {w}, count {num})")
        m["dims"].append((w, num))
    mode = int(hd[p])
    o = core + p + 1
    end = core + core_len
    for si, (w, num) in enumerate(m["dims"]):
        if mode == RAW:
            for j in range(w):
                m["segs"].append(_DSeg(c, si, j, num, H.RAW, at=o + j * num))
            o += w * num
            continue
        if mode != SPLIT:
            raise PayloadError(f"integer stream mode {mode} in a device-made payload")
        sh = r.get(o, 11)
        if sh is None or sh.size < 2:
            need.append((c, o, 16 + w * H.MAX_META))
            return m
        coder = int(sh[0])
        ln, q = read_uvarint(sh, 1)
        o += q
        if o + ln > end:
            raise PayloadError("integer stream runs past the body")
        if coder == PLANES:
            if ln != w * num:
                raise PayloadError(f"stream holds {ln} bytes, expected {w * num}")
            for j in range(w):
                m["segs"].append(_DSeg(c, si, j, num, H.RAW, at=o + j * num))
        elif coder == HUFF_PLANES:
            meta = r.get(o, min(ln, 1 + w * H.MAX_META))
            if meta is None:
                need.append((c, o, 1 + w * H.MAX_META))
                return m
            m["segs"] += _huff_segs(meta, c, si, w, num, o, ln)
        else:
            raise PayloadError(f"stream coder {coder} in a device-made payload")
        o += ln
    if o != end:
        raise PayloadError(f"{end - o} stray bytes after the integer streams")
    return m


def _huff_segs(meta: np.ndarray, c: int, si: int, w: int, n: int, at: int, ln: int) -> list[_DSeg]:
    """The planes of a Huffman-coded stream at payload offset ``at`` (``ln`` bytes)."""
    planes, size = H.read_meta(meta, w)
    nblocks = -(-n // (1 << H.LOG2_BLOCK))
    p = at + size
    out = []
    for j, pm in enumerate(planes):
        if pm.kind == H.CONST:
            out.append(_DSeg(c, si, j, n, H.CONST, value=pm.value))
        elif pm.kind == H.RAW:
            out.append(_DSeg(c, si, j, n, H.RAW, at=p))
            p += n
        else:
            if pm.nbits > n * H.MAX_LEN:
                raise PayloadError("Huffman plane with an invalid code")
            nw = -(-pm.nbits // 32)
            words_at = p + 4 * (nblocks - 1)
            out.append(
                _DSeg(
                    c,
                    si,
                    j,
                    n,
                    H.HUFF,
                    at=p,
                    nbits=pm.nbits,
                    nw=nw,
                    words_at=words_at,
                    lengths=pm.lengths,
                )
            )
            p = words_at + 4 * nw
    if p != at + ln:
        raise PayloadError(f"{at + ln - p} stray bytes after a Huffman stream")
    return out


def _reconstruct(
    metas: list[dict], frames: list[Frame], buf: torch.Tensor, dev: torch.device
) -> list[torch.Tensor]:
    starts = [f.base for f in frames]
    segs: list[_DSeg] = [s for m in metas for s in m["segs"]]
    symbols = _decode_huffman([s for s in segs if s.kind == H.HUFF], buf, starts, dev)
    # Stream values: every plane added into its (payload, stream) at its shift.
    keys = sorted({(s.payload, s.stream) for s in segs})
    counts = {key: 0 for key in keys}
    for s in segs:
        counts[(s.payload, s.stream)] = s.n
    vbase = dict(zip(keys, excl([counts[key] for key in keys]), strict=True))
    values = torch.zeros(sum(counts.values()), dtype=torch.int64, device=dev)
    up = Uploads()
    var = [s for s in segs if s.kind != H.CONST]
    const = [s for s in segs if s.kind == H.CONST]
    h_var = [
        up.add([s.n for s in var]),
        up.add(excl([s.n for s in var])),
        up.add([vbase[(s.payload, s.stream)] for s in var]),
        up.add([8 * s.plane for s in var]),
    ]
    h_const = [
        up.add([s.n for s in const]),
        up.add([s.value << (8 * s.plane) for s in const]),
        up.add([vbase[(s.payload, s.stream)] for s in const]),
        up.add(excl([s.n for s in const])),
    ]
    groups: dict[tuple[torch.dtype, int], list[int]] = {}
    for c, m in enumerate(metas):
        groups.setdefault((m["dtype"], m["shape"][1]), []).append(c)
    plans = [_plan_group(metas, frames, idx, d, vbase, up) for (_, d), idx in groups.items()]
    up.send(dev)
    if var:
        hi, parts = 0, []
        for s in var:
            if s.kind == H.HUFF:
                parts.append(symbols[hi : hi + s.n])
                hi += s.n
            else:
                a = starts[s.payload] + s.at
                parts.append(buf[a : a + s.n])
        sym = torch.cat(parts).to(torch.int64)
        owner = torch.repeat_interleave(
            torch.arange(len(var), device=dev), up[h_var[0]], output_size=sym.numel()
        )
        dst = torch.arange(sym.numel(), device=dev) - up[h_var[1]][owner] + up[h_var[2]][owner]
        values.index_add_(0, dst, sym << up[h_var[3]][owner])
    if const:
        total = sum(s.n for s in const)
        owner = torch.repeat_interleave(
            torch.arange(len(const), device=dev), up[h_const[0]], output_size=total
        )
        dst = torch.arange(total, device=dev) - up[h_const[3]][owner] + up[h_const[2]][owner]
        values.index_add_(0, dst, up[h_const[1]][owner])
    outs: list[torch.Tensor | None] = [None] * len(metas)
    ok_terms: list[torch.Tensor] = []
    for plan in plans:
        _finish_group(plan, metas, frames, values, buf, up, dev, outs, ok_terms)
    if ok_terms and not bool(torch.stack(ok_terms).all()):  # the one check of them all
        raise PayloadError("row references or outlier positions do not fit the tensor")
    return [y for y in outs if y is not None]


def _plan_group(
    metas: list[dict], frames: list[Frame], idx: list[int], d: int, vbase: dict, up: Uploads
) -> dict:
    """Host bookkeeping of payloads of one dtype and width: sizes, bases, bounds."""
    live = [c for c in idx if metas[c]["shape"][0] * d]
    n = [metas[c]["shape"][0] for c in live]
    lit: list[int] = []
    refs: list[bool] = []
    for c in live:
        dims = metas[c]["dims"]
        codes_n = dims[-1][1]
        if (
            len(dims) not in (1, 2)
            or codes_n % d
            or (len(dims) == 1 and codes_n != n[len(lit)] * d)
        ):
            raise PayloadError(f"{codes_n} codes do not fit rows of {d}")
        if len(dims) == 2 and dims[0][1] != n[len(lit)]:
            raise PayloadError(f"{dims[0][1]} row references for {n[len(lit)]} rows")
        lit.append(codes_n // d)
        refs.append(len(dims) == 2)
    outl = [c for c in live if frames[c].n_outliers]
    rowbase = excl(n)
    return {
        "idx": idx,
        "live": live,
        "d": d,
        "n": n,
        "lit": lit,
        "refs": refs,
        "outl": outl,
        "codes_at": [vbase[(c, len(metas[c]["dims"]) - 1)] for c in live],
        "refs_at": [vbase[(c, 0)] for c, r in zip(live, refs, strict=True) if r],
        "h": {
            "n": up.add(n),
            "rowbase": up.add(rowbase),
            "lit": up.add(lit),
            "litbase": up.add(excl(lit)),
            "step": up.add([2.0 * metas[c]["eb"] for c in live]),
            "hasref": up.add([int(r) for r in refs]),
            "elem": up.add([rb * d for rb in rowbase]),
            "ocount": up.add([frames[c].n_outliers for c in outl]),
            "oowner": up.add([live.index(c) for c in outl]),
        },
    }


def _finish_group(
    g: dict,
    metas: list[dict],
    frames: list[Frame],
    values: torch.Tensor,
    buf: torch.Tensor,
    up: Uploads,
    dev: torch.device,
    outs: list[torch.Tensor | None],
    ok_terms: list[torch.Tensor],
) -> None:
    """Rows of every payload of a group: references resolved, dequantized, outliers set."""
    d, live, h = g["d"], g["live"], g["h"]
    dtype = metas[g["idx"][0]]["dtype"]
    wd = work_dtype(dtype)
    for c in g["idx"]:
        if c not in live:
            outs[c] = torch.empty(metas[c]["shape"], dtype=dtype, device=dev)
    if not live:
        return
    rows = sum(g["n"])
    z = torch.cat([values[a : a + lt * d] for a, lt in zip(g["codes_at"], g["lit"], strict=True)])
    lit_rows = ((z >> 1) ^ -(z & 1)).view(-1, d)
    owner = torch.repeat_interleave(
        torch.arange(len(live), device=dev), up[h["n"]], output_size=rows
    )
    refs = torch.zeros(rows, dtype=torch.int64, device=dev)
    with_refs = [i for i, r in enumerate(g["refs"]) if r]
    if with_refs:
        at = nonzero_known(up[h["hasref"]][owner].bool(), sum(g["n"][i] for i in with_refs))
        refs[at] = torch.cat(
            [values[a : a + g["n"][i]] for a, i in zip(g["refs_at"], with_refs, strict=True)]
        )
    literal = refs == 0
    csum = torch.cumsum(literal, 0)
    before = torch.cat([csum.new_zeros(1), csum])[up[h["rowbase"]]]
    src = torch.where(literal, csum - 1 - before[owner], refs - 1)
    lit_of_row = up[h["lit"]][owner]
    ends = torch.cat([csum.new_zeros(1), csum])[up[h["rowbase"]] + up[h["n"]]]
    ok_terms.append(((src >= 0) & (src < lit_of_row)).all() & (ends - before == up[h["lit"]]).all())
    pick = (up[h["litbase"]][owner] + src).clamp_(0, max(lit_rows.shape[0] - 1, 0))
    codes = lit_rows[pick] if lit_rows.shape[0] else lit_rows.new_zeros(rows, d)
    y = codes.to(wd) * up.f64(h["step"]).to(wd)[owner].view(-1, 1)
    y = y.to(dtype) if dtype != wd else y
    if g["outl"]:
        pos, val64 = read_outliers(buf, [frames[c] for c in g["outl"]])
        val = val64.to(dtype)
        oo = torch.repeat_interleave(up[h["oowner"]], up[h["ocount"]], output_size=pos.numel())
        limit = up[h["n"]][oo] * d
        ok_terms.append(((pos >= 0) & (pos < limit)).all())
        flat_at = up[h["elem"]][oo] + pos.clamp(0, None).minimum(limit - 1)
        y.view(-1)[flat_at] = val
    for i, c in enumerate(live):
        outs[c] = y[sum(g["n"][:i]) : sum(g["n"][: i + 1])]


def _decode_huffman(
    segs: list[_DSeg], buf: torch.Tensor, starts: list[int], dev: torch.device
) -> torch.Tensor:
    """Every Huffman plane's symbols, concatenated, from one batched decode."""
    if not segs:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    block = 1 << H.LOG2_BLOCK
    words, stored = [], []
    for s in segs:
        a = starts[s.payload]
        words.append(buf[a + s.words_at : a + s.words_at + 4 * s.nw])
        stored.append(buf[a + s.at : a + s.at + 4 * (-(-s.n // block) - 1)])
    lengths = np.stack([s.lengths for s in segs if s.lengths is not None])
    return H.decode_planes(words, stored, lengths, [s.nbits for s in segs], [s.n for s in segs])
