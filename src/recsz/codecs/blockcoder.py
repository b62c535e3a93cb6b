"""Format-3 payloads made and read where the tensors live, by a few Triton kernels and
torch operations, with no host synchronization (:mod:`recsz.codecs.blockformat` defines
the bytes and codes them with numpy on the CPU; CI runs these kernels under
``TRITON_INTERPRET=1`` and compares).

One call codes G groups (e.g. one per destination rank, each holding several tables) into
one buffer, each payload at a place fixed by the shapes alone (its capacity: no row
deduplicated, every block raw), so nothing waits for sizes. Encoding: row dedup by hash,
stable sort and bitwise check, literal rows compacted, one quantize launch, one width
launch, a prefix sum, the widths packed, one pack launch, header fields written by index.
The used sizes come back as a device tensor; a caller that sends the payloads reads it
once. Decoding is the inverse: widths, prefix sum, unpack launches, one row gather; the
checks (header, lengths, references, checksum) become one device flag per payload, read
once by :func:`check` where the caller wants a PayloadError.

On a GPU, the second call with the same shapes (and, decoding, the same buffer) captures
the call's device work as a CUDA graph; later calls copy their inputs in and replay it
(one launch instead of about a hundred). Their outputs then live in the graph's buffers:
valid until the next call of the same shapes (``static=True`` asks for this).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import triton

from recsz.codecs import blockformat as bf
from recsz.codecs import blockplan as bp
from recsz.codecs.blockkernels import (
    pack_kernel,
    quantize_kernel,
    row_key_kernel,
    same_rows_kernel,
    unpack_kernel,
    widths_kernel,
)
from recsz.codecs.payload import PayloadError

ELEMS = 2048  # elements per quantize program
BLOCKS = 64  # blocks per width / pack / unpack program
_PLANS: OrderedDict[tuple, bp.Plan] = OrderedDict()
_MAX_PLANS = 16


def _plan(key: tuple, make: Any) -> bp.Plan:
    p = _PLANS.get(key)
    if p is None:
        p = _PLANS[key] = make()
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    return p


def _replay(p: bp.Plan, run: Any, static: bool) -> Any:
    """run() eagerly, or, from the second call on a GPU with ``static``, through a CUDA
    graph captured from it."""
    p.calls += 1
    if not static or p.dev.type != "cuda" or p.calls < 2:
        return run()
    if p.graph is None:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):  # batches load aside
            outs = run()
        p.graph = (g, outs)
    g, outs = p.graph
    g.replay()
    return outs


def encode(
    lays: list[bf.Layout], xs: list[torch.Tensor], ebs: torch.Tensor, static: bool = False
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Code group g's rows ``xs[g]`` (float32, its segments as ``lays[g].seg_rows``) under
    ``ebs`` (one bound per segment, all groups in order, on the device).

    Returns (buffer, each payload's first byte, each payload's used length on the device):
    payload g is ``buffer[base[g] : base[g] + used[g]]``; any longer slice inside its
    capacity decodes the same."""
    dev = xs[0].device
    caps = [lay.capacity for lay in lays]
    base = np.concatenate([[0], np.cumsum(caps)])[:-1].tolist()
    ends = [b + c for b, c in zip(base, caps, strict=True)]
    p = _plan(("enc", tuple(lays), dev), lambda: bp.build(lays, base, ends, dev))
    if "x" not in p.t:  # the inputs' places (pad rows stay zero)
        p.t["x"] = torch.zeros(p.rows, p.dim, dtype=torch.float32, device=dev)
        p.t["ebs"] = torch.zeros(ebs.numel(), dtype=torch.float64, device=dev)
    for lay, x, r0 in zip(lays, xs, _row_starts(lays), strict=True):
        p.t["x"][r0 : r0 + lay.rows].copy_(x)
    p.t["ebs"].copy_(ebs)
    out, used = _replay(p, lambda: _encode(p), static)
    return out, base, used


def _encode(p: bp.Plan) -> tuple[torch.Tensor, torch.Tensor]:
    t, dim, dev = p.t, p.dim, p.dev
    x, ebs = t["x"], t["ebs"]
    eb_row = torch.cat([ebs, ebs.new_ones(1)])[t["rext"]]
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    if p.dedup:
        rep = _duplicates(p, x.view(torch.int32))
        lit = rep < 0
        rank, literal = bp.literal_rank(p, lit)
        ref = torch.where(lit, 0, rank[rep.clamp(min=0)] - rank[t["rfirst"]] + 1)
        refs[t["rslot"]] = ref.to(torch.int32)
        at = torch.where(lit, t["rrow0"] + rank, p.rows)  # duplicates: to a spare slot
        rows = torch.arange(p.rows, device=dev)
        row_map = rows.new_full((p.rows + 1,), -1).index_copy_(0, at, rows)[:-1]
    else:
        literal, row_map = t["npad"], torch.arange(p.rows, device=dev)
    n = x.numel()
    zz = torch.empty(n, dtype=torch.int32, device=dev)
    raw = torch.empty(n // bf.LANES, dtype=torch.int8, device=dev)
    if n:
        grid = (triton.cdiv(n, ELEMS),)
        quantize_kernel[grid](x, row_map, eb_row, zz, raw, n, dim, bf.QMAX, BLOCK=ELEMS)
    n_blocks, data_at = bp.block_counts(p, literal)
    nb = p.blocks
    w = torch.zeros(nb, dtype=torch.uint8, device=dev)
    out = torch.empty(p.size, dtype=torch.uint8, device=dev)
    parts = torch.zeros(nb, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(nb, BLOCKS),)
    if nb:
        widths_kernel[grid](t["src"], zz, refs, raw, w, nb, B=BLOCKS)
    off, data_len = bp.offsets(p, w, data_at)
    # The width nibbles first: the data overwrites the tail of their capacity.
    wg, k = t["wg"], t["wk"]
    first = t["bs"][wg] + 2 * k
    lo = torch.where(2 * k < n_blocks[wg], w[first.clamp(max=max(nb - 1, 0))], 0)
    hi = torch.where(2 * k + 1 < n_blocks[wg], w[(first + 1).clamp(max=max(nb - 1, 0))], 0)
    out[t["wpos"]] = lo | (hi << 4)
    if nb:
        pack_kernel[grid](t["src"], zz, refs, x.view(torch.int32), row_map, dim, w, off,
                          t["bbase"], out.view(torch.int32), parts, nb, B=BLOCKS)  # fmt: skip
    out[t["ipos"]] = t["ival"]
    out[t["eb_pos"]] = ebs.view(torch.uint8)
    out[t["field_pos"]] = (
        torch.stack([bp.as_u32(literal), bp.as_u32(data_len)], 1).view(torch.uint8).view(-1)
    )
    total = bp.head_hash(p, out.view(torch.int32), data_at) + bp.part_hash(p, parts)
    out[t["ck_pos"]] = bp.as_u32(total).view(torch.uint8)
    return out, data_at + data_len


ROWS = 32  # rows per dedup-kernel program
DB = 32  # dims per step of its loop


def _duplicates(p: bp.Plan, bits: torch.Tensor) -> torch.Tensor:
    """blockformat.duplicates on the device: keys by a kernel, a stable sort, the first
    row of each run of equal keys as the target, checked bit for bit by a kernel."""
    t = p.t
    n, dim = bits.shape
    r = torch.arange(n, device=p.dev)
    key = torch.empty(n, dtype=torch.int64, device=p.dev)
    grid = (triton.cdiv(n, ROWS),)
    if n:
        row_key_kernel[grid](bits, t["mult"], t["piece"], t["rpad"], key, n,
                             (1 << bf.HASH_BITS) - 1, bf.HASH_BITS, dim=dim, ROWS=ROWS,
                             DB=DB)  # fmt: skip
    ks, perm = torch.sort(key, stable=True)
    start = torch.ones(n, dtype=torch.bool, device=p.dev)
    start[1:] = ks[1:] != ks[:-1]
    run = torch.cumsum(start.to(torch.int64), 0) - 1  # each sorted row's run
    first = r.new_zeros(n + 1).index_copy_(0, torch.where(start, run, n), r)  # run -> its start
    rep = perm[first[run]]
    same = torch.empty(n, dtype=torch.int8, device=p.dev)
    if n:
        same_rows_kernel[grid](bits, perm, rep, same, n, dim=dim, ROWS=ROWS, DB=DB)
    out = torch.full((n,), -1, dtype=torch.int64, device=p.dev)
    out[perm] = torch.where((same != 0) & ~start, rep, -1)
    return out


def _row_starts(lays: list[bf.Layout]) -> list[int]:
    return np.concatenate([[0], np.cumsum([lay.padded for lay in lays])])[:-1].tolist()


def common_buffer(payloads: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One uint8 buffer holding every payload at a 4-byte aligned offset: their own
    storage when they share one (slices of a received buffer), else a copy."""
    st = payloads[0].untyped_storage()
    offs = [int(p.storage_offset()) for p in payloads]
    if (
        all(p.untyped_storage().data_ptr() == st.data_ptr() and p.is_contiguous() for p in payloads)
        and all(o % 4 == 0 for o in offs)
        and st.nbytes() % 4 == 0
    ):
        buf = torch.empty(0, dtype=torch.uint8, device=payloads[0].device)
        return buf.set_(st, 0, (st.nbytes(),), (1,)), offs
    parts: list[torch.Tensor] = []
    offs, at = [], 0
    for q in payloads:
        pad = -int(q.numel()) % 4
        parts += [q.reshape(-1), q.new_zeros(pad)]
        offs.append(at)
        at += int(q.numel()) + pad
    return torch.cat(parts), offs


def read_layouts(payloads: list[torch.Tensor]) -> list[bf.Layout]:
    """The layouts the payloads' headers state (one host copy of their first bytes)."""
    heads = [p[: min(p.numel(), 4096)].reshape(-1) for p in payloads]
    host = torch.cat(heads).cpu().numpy()
    out, at = [], 0
    for p, h in zip(payloads, heads, strict=True):
        chunk = host[at : at + h.numel()]
        at += h.numel()
        lay = bf.read_layout(chunk)[0]
        if lay.widths_at > chunk.size and p.numel() >= lay.widths_at:  # many tables: read on
            lay = bf.read_layout(p[: lay.widths_at].cpu().numpy())[0]
        out.append(lay)
    return out


def decode(
    payloads: list[torch.Tensor], lays: list[bf.Layout], static: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Rows of each payload (as ``lays`` expects them), the bounds (all segments), and a
    device flag per payload: True where every check passed."""
    for i, (q, lay) in enumerate(zip(payloads, lays, strict=True)):
        if q.numel() < lay.widths_at:
            raise PayloadError(f"payload {i}: {q.numel()} bytes, its header needs {lay.widths_at}")
    buf, base = common_buffer(payloads)
    ends = [b + q.numel() for b, q in zip(base, payloads, strict=True)]
    dev = buf.device
    key = ("dec", tuple(lays), buf.data_ptr(), buf.numel(), tuple(base), tuple(ends), dev)
    p = _plan(key, lambda: bp.build(lays, base, ends, dev))
    p.t["buf"] = buf
    y, ebs, ok = _replay(p, lambda: _decode(p), static)
    rows = [y[r0 : r0 + lay.rows] for r0, lay in zip(_row_starts(lays), lays, strict=True)]
    return rows, ebs, ok


def _decode(p: bp.Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, dim, dev, buf = p.t, p.dim, p.dev, p.t["buf"]
    words = buf.view(torch.int32)
    bad = torch.zeros(p.g, dtype=torch.int64, device=dev)
    bad += bp.segment_sum(buf[t["ipos"]] != t["ival"], t["ibounds"])
    fields = buf[t["field_pos"]].view(torch.int32).to(torch.int64).view(p.g, 2) & bf.MASK32
    stated_l, stated_len = fields[:, 0], fields[:, 1]
    bad += stated_l > t["npad"]
    literal = torch.minimum(stated_l, t["npad"])
    n_blocks, data_at = bp.block_counts(p, literal)
    gid, local = t["gid"], t["blocal"]
    wpos = (t["base"] + t["wat"])[gid] + local // 2
    w = (buf[wpos.clamp(max=buf.numel() - 1)] >> (4 * (local % 2)).to(torch.uint8)) & 15
    w = torch.where(local < n_blocks[gid], w, 0)
    off, data_len = bp.offsets(p, w, data_at)
    bad += (stated_len != data_len) | (t["base"] + data_at + data_len > t["end"])
    ebs = buf[t["eb_pos"]].view(torch.float64)
    eb_row = torch.cat([ebs, ebs.new_ones(1)])[t["rext"]]
    y = torch.empty(p.rows * dim, dtype=torch.float32, device=dev)  # pass 2 writes all
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    parts = torch.zeros(p.blocks, dtype=torch.int32, device=dev)
    if p.dedup:  # the references first: the literal rows' bounds depend on them
        _unpack(p, words, w * (t["src"] < 0), off, eb_row, y, refs, parts, codes=False)
        ref = refs[t["rslot"]].to(torch.int64)
        lit = ref == 0
        rank, count = bp.literal_rank(p, lit)
        bad += count != literal
        at = torch.where(lit, t["rrow0"] + rank, p.rows)
        eb_row = eb_row.new_ones(p.rows + 1).index_copy_(0, at, eb_row)[:-1]
        w = w * (t["src"] >= 0)
    _unpack(p, words, w, off, eb_row, y, refs, parts, refs_too=not p.dedup)
    total = (bp.head_hash(p, words, data_at) + bp.part_hash(p, parts)) & bf.MASK32
    bad += total != (buf[t["ck_pos"]].view(torch.int32).to(torch.int64) & bf.MASK32)
    out = y.view(p.rows, dim)
    if p.dedup:
        want = torch.where(lit, rank, rank[t["rfirst"]] + ref - 1)
        wrong = ~lit & ((ref < 0) | (want >= rank))
        bad += bp.segment_sum(wrong, t["rbounds"])
        want = torch.minimum(torch.where(wrong, 0, want), t["npad"][t["rgroup"]] - 1)
        out = out.index_select(0, t["rrow0"] + want)
    return out, ebs, bad == 0


def _unpack(
    p: bp.Plan,
    words: torch.Tensor,
    w: torch.Tensor,
    off: torch.Tensor,
    eb_row: torch.Tensor,
    y: torch.Tensor,
    refs: torch.Tensor,
    parts: torch.Tensor,
    codes: bool = True,
    refs_too: bool = True,
) -> None:
    """The unpack kernel over the blocks of nonzero width; adds their checksum parts.
    ``codes`` / ``refs_too``: write the element / reference stream."""
    if not p.blocks:
        return
    part = torch.zeros_like(parts)
    unpack_kernel[(triton.cdiv(p.blocks, BLOCKS),)](
        p.t["src"], w, off, p.t["bbase"], words, words.numel(), eb_row, p.dim,
        y, refs, part, p.blocks, B=BLOCKS, CODES=codes, REFS=refs_too,
    )  # fmt: skip
    parts += part


def check(ok: torch.Tensor, what: str = "payload") -> None:
    """Raise PayloadError naming the first payload whose checks failed (one host read)."""
    flags = ok.cpu().tolist()
    if not all(flags):
        i = flags.index(False)
        raise PayloadError(f"{what} {i}: corrupted or truncated (format-{bf.FORMAT} checks failed)")
