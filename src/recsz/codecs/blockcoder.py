"""Format-3 payloads made and read where the tensors live, by Triton kernels and a few
torch scans, with no host synchronization (:mod:`recsz.codecs.blockformat` defines the
bytes and codes them with numpy on the CPU; CI runs these kernels under
``TRITON_INTERPRET=1`` and compares).

One call codes G groups (e.g. one per destination rank, each holding several tables) into
one buffer, each payload at a place fixed by the shapes alone (its capacity: no row
deduplicated, every block raw), so nothing waits for sizes. Encoding: row keys into a hash table
that keeps each key's first row, a bitwise check against it, a prefix sum (literal ranks),
the rows placed; one launch quantizes and sizes every code block, one sizes the
reference blocks; a prefix sum of the sizes; one launch packs every block and the width
nibbles; the fixed header bytes by one index copy; one launch per call writes each
group's fields, bounds and checksum. The used sizes come back as a device tensor; a
caller that sends the payloads reads it once. Decoding is the inverse (headers, widths, a
prefix sum, the references, literal ranks, the values, the duplicated rows, a verdict):
the checks (header, lengths, references, checksum) become one device flag per payload,
read once by :func:`check` where the caller wants a PayloadError.

On a GPU, the third call with the same shapes (and, decoding, the same buffer) captures
the call's device work as a CUDA graph; later calls copy their inputs in and replay it
(one launch instead of about twenty). Their outputs then live in the graph's buffers:
valid until the next call of the same shapes (``static=True`` asks for this). Shapes that
change every step (id-aware traffic) run eagerly: kernels take their sizes as plain
arguments (no recompilation), and a plan's indices are derived on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import triton

from recsz.codecs import blockformat as bf
from recsz.codecs import blockkernels as k
from recsz.codecs import blockplan as bp
from recsz.codecs import blockunpack as u
from recsz.codecs.checks import verdict
from recsz.codecs.payload import PayloadError, constant
from recsz.interpreter import interpreted


@dataclasses.dataclass(frozen=True)
class Launch:
    """Work per program of the kernels. No byte depends on it: CI checks the GPU's
    on chunks that cross every program boundary (``tests/test_blocks.py``)."""

    elems: int  # elements per quantize program
    blocks: int  # blocks per pack / unpack program
    rows: int  # rows per program of the row-comparing kernels (dedup, row gather)
    rows_b: int  # rows per program of the per-row kernels


#: On a GPU (blocks: the H100 sweep's best of 16-256).
GPU = Launch(elems=2048, blocks=128, rows=32, rows_b=256)
#: Under Triton's interpreter a program costs about its operations' count whatever their
#: width: fewer, wider programs.
WIDE = Launch(elems=16384, blocks=1024, rows=256, rows_b=2048)
LAUNCH = WIDE if interpreted() else GPU
DB = 32  # dims per step of the row-comparing kernels' loops
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


def clear_plans() -> None:
    """Forget every plan and graph (after changing the launch constants above)."""
    _PLANS.clear()


#: Calls of one plan before its work is captured as a CUDA graph. A step's forward and
#: backward share their shapes, so under id-aware traffic (new sizes every step) each plan
#: sees two calls: capturing then (a sync, a private memory pool) would never pay.
REPLAY_FROM = 3


def _graphed(p: bp.Plan, static: bool) -> bool:
    """Whether this call of ``p`` runs through its CUDA graph (counts the call); never
    while a graph of the caller's is being captured (the whole step's, ``--cuda-graph``)."""
    p.calls += 1
    if not (static and p.dev.type == "cuda" and p.calls >= REPLAY_FROM):
        return False
    return not torch.cuda.is_current_stream_capturing()


def _replay(p: bp.Plan, run: Any) -> Any:
    """run() through the plan's CUDA graph, captured on first use."""
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
    if not _graphed(p, static):
        out, used = _encode(p, _stacked(lays, xs), ebs.to(torch.float64))
        return out, base, used
    if "x" not in p.t:  # the graph's inputs (pad rows stay zero)
        p.t["x"] = torch.zeros(p.rows, p.dim, dtype=torch.float32, device=dev)
        p.t["ebs"] = torch.zeros(ebs.numel(), dtype=torch.float64, device=dev)
    for lay, x, r0 in zip(lays, xs, _row_starts(lays), strict=True):
        p.t["x"][r0 : r0 + lay.rows].copy_(x)
    p.t["ebs"].copy_(ebs)
    out, used = _replay(p, lambda: _encode(p, p.t["x"], p.t["ebs"]))
    return out, base, used


def _stacked(lays: list[bf.Layout], xs: list[torch.Tensor]) -> torch.Tensor:
    """The groups' rows end to end, each group padded with zero rows."""
    if len(xs) == 1 and lays[0].rows == lays[0].padded:
        return xs[0]
    parts = []
    for lay, x in zip(lays, xs, strict=True):
        parts += [x, x.new_zeros(lay.padded - lay.rows, lay.dim)]
    return torch.cat(parts)


def _encode(p: bp.Plan, x: torch.Tensor, ebs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, dim, dev, nr = p.t, p.dim, p.dev, p.rows
    # One zeroed workspace (one memset): the dedup table, literal counts, references and
    # checksum parts.
    n_ref, slots = p.ref_blocks * bf.LANES, _slots(nr) if p.dedup and nr else 0
    ws = torch.zeros(2 * slots + p.g + (n_ref + p.g + 1) // 2, dtype=torch.int64, device=dev)
    ws32 = ws[2 * slots + p.g :].view(torch.int32)
    refs, ck = ws32[:n_ref], ws32[n_ref : n_ref + p.g]
    if p.dedup:
        row_map = torch.empty(nr, dtype=torch.int64, device=dev)  # -1s by row_insert_kernel
        n_lit = ws[2 * slots : 2 * slots + p.g]
        if nr:
            dup, lit, cz = _duplicates(p, x.view(torch.int32), ws[: 2 * slots], row_map)
            k.encode_rows_kernel[(triton.cdiv(nr, LAUNCH.rows_b),)](
                dup, lit, cz, t["rgroup"], t["rfirst"], t["rslot"], t["row0"], t["npad"],
                row_map, refs, n_lit, nr, B=LAUNCH.rows_b,
            )  # fmt: skip
    else:
        row_map, n_lit = t["arange"], t["npad"]
    n, nb = x.numel(), p.blocks
    zz = torch.empty(n, dtype=torch.int32, device=dev)
    w = torch.empty(nb, dtype=torch.uint8, device=dev)
    size = torch.empty(nb, dtype=torch.int64, device=dev)
    if n:
        k.quantize_kernel[(triton.cdiv(n, LAUNCH.elems),)](
            x, row_map, t["rseg"], ebs, zz, w, size, t["rgroup"], t["bs"], t["nrb"],
            t["row0"], n, bf.QMAX, DIM=dim, BLOCK=LAUNCH.elems,
        )  # fmt: skip
    if p.ref_blocks:
        k.ref_widths_kernel[(triton.cdiv(p.ref_blocks, LAUNCH.blocks),)](
            refs, t["refg"], t["rb0"], t["bs"], w, size, p.ref_blocks, B=LAUNCH.blocks
        )
    cs = torch.cumsum(size, 0)
    out = torch.empty(p.size, dtype=torch.uint8, device=dev)
    if nb:
        k.pack_kernel[(triton.cdiv(nb, LAUNCH.blocks),)](
            t["bgid"], t["bs"], t["base"], t["wat"], t["nrb"], n_lit, t["rb0"], t["row0"],
            w, size, cs, zz, refs, x.view(torch.int32), row_map, out, out.view(torch.int32),
            ck, nb, DIM=dim, B=LAUNCH.blocks,
        )  # fmt: skip
    out[t["ipos"]] = t["ival"]
    used = torch.empty(p.g, dtype=torch.int64, device=dev)
    k.head_kernel[(p.g,)](
        t["base"], t["wat"], t["fat"], t["ebat"], t["nrb"], t["bs"], t["nb"], t["k"],
        t["seg0"], t["hfix"], n_lit, cs, size, ebs.view(torch.int64), ck, out,
        out.view(torch.int32), used, DIM=dim,
    )  # fmt: skip
    return out, used


def _slots(rows: int) -> int:
    """Slots of the dedup hash table for ``rows`` rows: a power of two, at most half full."""
    return 1 << max(4, (2 * rows - 1).bit_length())


def _duplicates(
    p: bp.Plan, bits: torch.Tensor, tab: torch.Tensor, row_map: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """blockformat.duplicates on the device: each row's key (segment, 32-bit hash) into a
    hash table (``tab``, zeros) that keeps each key's first row, then each row checked bit
    for bit against that row (equal to the reference's stable sort by key: a run's first
    row is the key's first row); ``row_map`` filled with -1 on the way. Returns each row's
    target (-1: none), whether it is literal (int32) and the inclusive prefix sum of that."""
    n = bits.shape[0]
    slots = tab.numel() // 2
    key = torch.empty(n, dtype=torch.int64, device=p.dev)
    dup = torch.empty(n, dtype=torch.int64, device=p.dev)
    lit = torch.empty(n, dtype=torch.int32, device=p.dev)
    rows = LAUNCH.rows
    grid, cfg = (triton.cdiv(n, rows),), {"DIM": p.dim, "ROWS": rows, "DB": DB}
    k.row_insert_kernel[grid](
        bits, p.t["mult"], p.t["rseg"], tab, key, row_map, n, slots - 1, **cfg
    )
    k.row_match_kernel[grid](bits, tab, key, dup, lit, n, slots - 1, **cfg)
    return dup, lit, torch.cumsum(lit, 0, dtype=torch.int32)


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
    # A plan per buffer (its graph reads that buffer), its indices shared by every buffer
    # of the same layouts wherever their payloads sit (positions relative to a payload's
    # first byte), its places uploaded once per places: none inside a caller's capture
    # (--cuda-graph) for places seen before. Received buffers place payloads anew every step.
    key = ("dec", tuple(lays), tuple(base), tuple(ends), dev, buf.data_ptr(), buf.numel())
    shared = functools.partial(
        _plan, ("idx", tuple(lays), dev), lambda: bp.build(lays, base, ends, dev, relative=True)
    )

    def placed() -> bp.Plan:
        first = shared()
        t = dict(first.t)
        if (first.base, first.ends) != (base, ends):  # not the places it was made with
            at = constant(np.asarray([*base, *ends], np.int64), torch.int64, dev)
            t["base"], t["end"] = at[: len(lays)], at[len(lays) :]
        return bp.Plan(lays, base, dev, t=t)

    p = _plan(key, placed)
    p.t["buf"] = buf
    y, ebs, ok = _replay(p, lambda: _decode(p)) if _graphed(p, static) else _decode(p)
    rows = [y[r0 : r0 + lay.rows] for r0, lay in zip(_row_starts(lays), lays, strict=True)]
    return rows, ebs, ok


def _decode(p: bp.Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, dim, dev, buf, nr, nb = p.t, p.dim, p.dev, p.t["buf"], p.rows, p.blocks
    words = buf.view(torch.int32)
    n_lit = torch.empty(p.g, dtype=torch.int64, device=dev)
    stated = torch.empty(p.g, dtype=torch.int64, device=dev)
    ebs = torch.empty(p.segments, dtype=torch.int64, device=dev)
    ck = torch.empty(p.g, dtype=torch.int32, device=dev)
    bad = torch.empty(p.g, dtype=torch.int32, device=dev)
    u.read_head_kernel[(p.g,)](
        buf, words, buf.numel(), t["base"], t["fat"], t["ebat"], t["npad"], t["nrb"],
        t["wat"], t["k"], t["seg0"], t["ipos"], t["ival"], t["ibounds"], n_lit, stated, ebs,
        ck, bad, DIM=dim,
    )  # fmt: skip
    w = torch.empty(nb, dtype=torch.uint8, device=dev)
    size = torch.empty(nb, dtype=torch.int64, device=dev)
    grid = (triton.cdiv(nb, LAUNCH.blocks),)
    if nb:
        u.read_widths_kernel[grid](
            buf, buf.numel(), t["bgid"], t["bs"], t["base"], t["wat"], t["nrb"], n_lit, w,
            size, ck, nb, DIM=dim, B=LAUNCH.blocks,
        )  # fmt: skip
    cs = torch.cumsum(size, 0)
    y = torch.empty(nr * dim, dtype=torch.float32, device=dev)  # every literal slot written
    refs = torch.zeros(p.ref_blocks * bf.LANES, dtype=torch.int32, device=dev)
    ebs_f = ebs.view(torch.float64)

    def unpack(seg: torch.Tensor, refs_pass: bool) -> None:
        n = p.ref_blocks if refs_pass else nb  # the reference blocks, or all of them
        u.unpack_kernel[(triton.cdiv(n, LAUNCH.blocks),)](
            t["bgid"], t["bs"], t["base"], t["wat"], t["nrb"], n_lit, t["rb0"], t["row0"],
            t["refg"], w, size, cs, words, words.numel(), seg, ebs_f, y, refs, ck, n,
            DIM=dim, B=LAUNCH.blocks, REFS=refs_pass,
        )  # fmt: skip

    out = y.view(nr, dim)
    if p.dedup and nr:  # the references first: the literal slots' bounds depend on them
        if p.ref_blocks:
            unpack(t["rseg"], True)
        lit = torch.empty(nr, dtype=torch.int32, device=dev)
        rgrid = (triton.cdiv(nr, LAUNCH.rows_b),)
        u.literal_kernel[rgrid](refs, t["rslot"], lit, nr, B=LAUNCH.rows_b)
        cz = torch.cumsum(lit, 0, dtype=torch.int32)
        src = torch.empty(nr, dtype=torch.int64, device=dev)
        slot_seg = torch.full((nr,), -1, dtype=torch.int32, device=dev)
        u.decode_rows_kernel[rgrid](
            refs, lit, cz, t["rgroup"], t["rfirst"], t["rslot"], t["rseg"], t["row0"],
            t["npad"], n_lit, src, slot_seg, bad, nr, B=LAUNCH.rows_b,
        )  # fmt: skip
        if nb:
            unpack(slot_seg, False)
        out = torch.empty(nr, dim, dtype=torch.float32, device=dev)
        rows = LAUNCH.rows
        u.gather_rows_kernel[(triton.cdiv(nr, rows),)](y, src, out, nr, DIM=dim, ROWS=rows,
                                                       DB=DB)  # fmt: skip
    elif nb:
        unpack(t["rseg"], False)
    ok = torch.empty(p.g, dtype=torch.int8, device=dev)
    u.verdict_kernel[(p.g,)](
        words, t["base"], t["end"], t["wat"], t["nrb"], t["bs"], t["nb"], n_lit, stated, cs,
        size, ck, bad, ok, DIM=dim,
    )  # fmt: skip
    return out, ebs_f, ok != 0


def check(ok: torch.Tensor, what: str = "payload") -> None:
    """Raise PayloadError naming the first payload whose checks failed (one host read, or
    held by :class:`recsz.codecs.checks.HeldChecks`)."""
    verdict(ok, lambda i: f"{what} {i}: corrupted or truncated (format-{bf.FORMAT} checks failed)")
