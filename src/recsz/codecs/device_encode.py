"""The quantizing codecs on the tensor's device, batched: many chunks in one pass.

Why batched: on a GPU a chunk of one table (a few hundred KB) codes in microseconds of
kernel time but costs ~200 kernel launches and a dozen host synchronizations; the
exchange sends 26+ such chunks a step. Here all chunks of a call share every launch and
synchronization (about six per call, each for sizes or histograms: the data stay on the
device). ``encode`` of one tensor is this with one chunk, so the bytes do not depend on
how chunks were grouped, and CPU runs of this code write what a GPU writes.

Per chunk the payload is format 2 (:mod:`recsz.codecs.payload`):

    prefix (magic, version 2, word_hash) | header | sections (core, outlier positions,
    outlier values) | core = u8 count, (u8 width, varint n) per stream, u8 mode,
    then SPLIT: per stream (u8 coder, varint length, bytes) | RAW: the byte planes

Streams: [row references, literal codes] when repeated rows pay for their references,
else [codes]; codes zig-zagged; each stream as byte planes, Huffman-coded
(:mod:`recsz.codecs.huffman`) or raw, whichever is smaller.

Row repeats are found by a 40-bit row hash keyed by chunk and verified element by
element (a collision costs ratio, never correctness).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from recsz.codecs import huffman as H
from recsz.codecs import kernels
from recsz.codecs.devbuf import Uploads, excl, nonzero_known, u32_bytes
from recsz.codecs.devframe import frame_device, outlier_bytes
from recsz.codecs.payload import uvarint
from recsz.codecs.stages import (
    HUFF_PLANES,
    PLANES,
    QMAX,
    RAW,
    SPLIT,
    bound_below,
    repeats_pay,
    work_dtype,
)

if TYPE_CHECKING:
    from recsz.codecs.hybrid import QuantPipeline


@dataclass
class _Seg:
    """One byte plane of one stream of one chunk."""

    chunk: int
    stream: int  # 0 refs, 1 codes (index into the chunk's streams)
    plane: int
    src: int  # start of its values in the stream array
    n: int
    elem: int = 0  # start in the global symbol array
    kind: int = H.RAW
    meta: bytes = b""
    nbits: int = 0
    word: int = 0  # first word in the global word array
    nw: int = 0
    block_idx: list[int] = field(default_factory=list)
    block_base: int = 0  # its first block start in the global offsets array
    lengths: np.ndarray | None = None


def encode_batch(
    codec: QuantPipeline, xs: list[torch.Tensor], ebs: list[float]
) -> list[torch.Tensor]:
    """Encode same-dtype, same-width 2-D chunks on their (common) device."""
    x0 = xs[0]
    dev, dtype, d = x0.device, x0.dtype, int(x0.shape[1])
    wd = work_dtype(dtype)
    ns = [int(x.shape[0]) for x in xs]
    k = len(xs)
    n_all = sum(ns)
    X = torch.cat([x.detach().reshape(-1, d) for x in xs]) if k > 1 else x0.detach().contiguous()
    flat = X.reshape(-1)
    below_h = [float(bound_below(e, wd)) for e in ebs]  # exact in float64
    up = Uploads()
    h_ns = up.add(ns)
    h_inv = up.add([1.0 / (2.0 * e) for e in ebs])
    h_step = up.add([2.0 * e for e in ebs])
    h_below = up.add(below_h)
    g = torch.Generator().manual_seed(d)
    h_mult = up.add((torch.randint(1, 2**62, (d,), generator=g, dtype=torch.int64) | 1).numpy())
    up.send(dev)
    row_chunk = torch.repeat_interleave(torch.arange(k, device=dev), up[h_ns], output_size=n_all)

    # Quantize: q = round(x / 2eb) per chunk; every reconstruction checked in the working
    # precision (see stages.quantize for why the check is exact); misses travel exactly.
    finite = torch.isfinite(flat).view(n_all, d)
    xs_w = X.to(wd).masked_fill(~finite, 0)
    # Each per-chunk constant rounded once to the working type, as a scalar would be.
    inv = up.f64(h_inv).to(wd)[row_chunk].view(-1, 1)
    step = up.f64(h_step).to(wd)[row_chunk].view(-1, 1)
    below = up.f64(h_below).to(wd)[row_chunk].view(-1, 1)
    qmax = QMAX if wd == torch.float64 else 2**24
    q = (xs_w * inv).round_().clamp_(-qmax, qmax)
    y = q * step
    if dtype != wd:
        y = y.to(dtype).to(wd)
    exact = (y.sub_(xs_w).abs_() >= below) | ~finite
    codes = q.to(torch.int64).masked_fill_(exact, 0)

    # Row repeats, per chunk.
    key = (row_chunk << 40) + ((codes * up[h_mult]).sum(1) & (2**40 - 1))
    _, inverse = torch.unique(key, return_inverse=True)
    ar = torch.arange(n_all, device=dev)
    first = torch.full((n_all,), n_all, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, inverse, ar, reduce="amin")
    rep = first[inverse]
    rep = torch.where((codes != codes[rep]).any(1), ar, rep)
    literal = rep == ar
    zz = (codes << 1) ^ (codes >> 63)
    cmax = torch.zeros(k, dtype=torch.int64, device=dev).scatter_reduce_(
        0, row_chunk, zz.amax(1) if d else torch.zeros_like(row_chunk), reduce="amax"
    )
    stats = torch.stack(
        [
            torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, row_chunk, literal.long()),
            cmax,
            torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, row_chunk, exact.sum(1)),
        ]
    ).cpu()  # sync 1: literal rows, largest code, outliers per chunk
    n_lit = stats[0].tolist()
    c_max = stats[1].tolist()
    n_exact = stats[2].tolist()
    use = [
        codec.dedup == "on" or (codec.dedup == "auto" and repeats_pay(ns[c], n_lit[c], d))
        for c in range(k)
    ]
    up2 = Uploads()
    h_use = up2.add([int(u) for u in use])
    h_litbase = up2.add(excl(n_lit))
    h_celem = up2.add(excl([n * d for n in ns]))
    up2.send(dev)
    use_t = up2[h_use][row_chunk].bool()
    lit_base = up2[h_litbase]
    ordinal = torch.cumsum(literal, 0) - 1 - lit_base[row_chunk]
    refs = torch.where(literal, torch.zeros_like(rep), ordinal[rep] + 1)
    sent_rows = [n_lit[c] if use[c] else ns[c] for c in range(k)]
    rows_sel = nonzero_known(literal | ~use_t, sum(sent_rows))
    code_vals = zz.index_select(0, rows_sel).reshape(-1)
    ref_rows = [ns[c] if use[c] else 0 for c in range(k)]
    ref_vals = refs.index_select(0, nonzero_known(use_t, sum(ref_rows)))

    # Byte planes of every stream of every chunk, as segments of one symbol array.
    ref_src, code_src = excl(ref_rows), excl([r * d for r in sent_rows])
    streams: list[list[tuple[int, int]]] = []  # per chunk: (width, count) per stream
    segs: list[_Seg] = []
    for c in range(k):
        st: list[tuple[int, int]] = []
        if ns[c] * d == 0:  # an empty tensor's payload has an empty core
            streams.append(st)
            continue
        if use[c]:
            w = kernels.width(n_lit[c])
            st.append((w, ns[c]))
            segs += [_Seg(c, 0, j, ref_src[c], ns[c]) for j in range(w)]
        w = kernels.width(int(c_max[c]))
        st.append((w, sent_rows[c] * d))
        segs += [_Seg(c, len(st) - 1, j, code_src[c], sent_rows[c] * d) for j in range(w)]
        streams.append(st)
    elem = excl([s.n for s in segs])
    for s, e in zip(segs, elem, strict=True):
        s.elem = e
    n_sym = sum(s.n for s in segs)
    values = torch.cat([ref_vals, code_vals])
    off_ref = len(ref_vals)
    up3 = Uploads()
    h_n = up3.add([s.n for s in segs])
    h_src = up3.add([s.src + (0 if s.stream == 0 and use[s.chunk] else off_ref) for s in segs])
    h_elem = up3.add(elem)
    h_shift = up3.add([8 * s.plane for s in segs])
    up3.send(dev)
    owner = torch.repeat_interleave(
        torch.arange(len(segs), device=dev), up3[h_n], output_size=n_sym
    )
    idx = torch.arange(n_sym, device=dev) - up3[h_elem][owner] + up3[h_src][owner]
    sym = (values[idx] >> up3[h_shift][owner]) & 255

    if codec.entropy and n_sym:
        counts = torch.bincount(owner * 256 + sym, minlength=256 * len(segs))
        hist = counts.view(len(segs), 256).cpu().numpy()  # sync 2: the histograms
        _plan_huffman(segs, hist)
        words, offsets = _pack_bits(segs, sym, owner)
    else:
        words = offsets = torch.empty(0, dtype=torch.int64, device=dev)
    sym8 = sym.to(torch.uint8)
    wbytes = u32_bytes(words)
    obytes = u32_bytes(offsets)

    # Outliers: positions inside each chunk, exact values.
    pos = nonzero_known(exact, sum(n_exact))
    chunk_elem = up2[h_celem]
    local = pos - chunk_elem[row_chunk[pos // max(d, 1)]] if pos.numel() else pos
    pbytes, vbytes = outlier_bytes(flat, pos, local)

    # Each payload: its stream table (host) and stream bytes (device), framed together.
    by_chunk: list[list[_Seg]] = [[] for _ in range(k)]
    for s in segs:
        by_chunk[s.chunk].append(s)
    e0 = excl(n_exact)
    cores: list[list[bytes | torch.Tensor]] = []
    outs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for c in range(k):
        core: list[bytes | torch.Tensor] = []
        if streams[c]:
            head = bytearray([len(streams[c])])
            for w, n in streams[c]:
                head.append(w)
                head += uvarint(n)
            head.append(SPLIT if codec.entropy else RAW)
            core.append(bytes(head))
            if codec.entropy:
                for si in range(len(streams[c])):
                    ss = [s for s in by_chunk[c] if s.stream == si]
                    core += _stream_parts(ss, sym8, wbytes, obytes)
            else:
                core += [sym8[s.elem : s.elem + s.n] for s in by_chunk[c]]
        cores.append(core)
        sl = slice(e0[c], e0[c] + n_exact[c])
        outs.append((pbytes[sl], vbytes[sl]) if n_exact[c] else None)
    return frame_device(codec, dtype, [(n, d) for n in ns], ebs, cores, outs, dev)


def _plan_huffman(segs: list[_Seg], hist: np.ndarray) -> None:
    """Per segment: constant, raw or Huffman (whichever is smallest), its metadata."""
    block = 1 << H.LOG2_BLOCK
    word = blocks = 0
    for s, hs in zip(segs, hist, strict=True):
        used = np.flatnonzero(hs)
        if s.n and used.size == 1:
            s.kind, s.meta = H.CONST, bytes([H.CONST, int(used[0])])
            continue
        if not s.n:
            s.kind, s.meta = H.RAW, bytes([H.RAW])
            continue
        lengths = H.code_lengths(hs)
        nbits = int((hs * lengths).sum())
        nblocks = -(-s.n // block)
        nw = -(-nbits // 32)
        size = min(H._HUFF_META, 6 + 2 * used.size) + 4 * (nblocks - 1) + 4 * nw
        if size >= s.n + 1 or nbits >= 2**31:
            s.kind, s.meta = H.RAW, bytes([H.RAW])
            continue
        if used.size < 64:
            meta = bytes([H.SPARSE, used.size])
            meta += np.stack([used, lengths[used]], 1).astype(np.uint8).tobytes()
        else:
            nib = lengths.astype(np.uint8)
            meta = bytes([H.HUFF]) + (nib[0::2] | (nib[1::2] << 4)).tobytes()
        s.kind, s.meta = H.HUFF, meta + nbits.to_bytes(4, "little")
        s.nbits, s.nw, s.word, s.lengths = nbits, nw, word, lengths
        s.block_idx = [s.elem + m * block for m in range(1, nblocks)]
        s.block_base = blocks
        blocks += nblocks - 1
        word += nw


def _pack_bits(
    segs: list[_Seg], sym: torch.Tensor, owner: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Huffman planes' words and block offsets (other planes contribute nothing)."""
    huff = [s for s in segs if s.kind == H.HUFF]
    if not huff:
        z = torch.empty(0, dtype=torch.int64, device=sym.device)
        return z, z
    lengths = np.zeros((len(segs), 256), np.int64)
    base = np.zeros((len(segs), 2), np.int64)
    acc = 0
    for i, s in enumerate(segs):
        base[i, 1] = acc
        if s.kind == H.HUFF:
            assert s.lengths is not None
            lengths[i] = s.lengths
            base[i, 0] = 32 * s.word
            acc += s.nbits
    bidx = [i for h in huff for i in h.block_idx]
    return H.pack_bits(sym, owner, lengths, base, bidx, sum(h.nw for h in huff))


def _stream_parts(
    ss: list[_Seg], sym8: torch.Tensor, wbytes: torch.Tensor, obytes: torch.Tensor
) -> list[bytes | torch.Tensor]:
    """One stream of a SPLIT block: Huffman-coded planes, or raw planes if not smaller."""
    raw_len = sum(s.n for s in ss)
    meta = bytes([H.LOG2_BLOCK]) + b"".join(s.meta for s in ss)
    data: list[torch.Tensor] = []
    coded = len(meta)
    for s in ss:
        if s.kind == H.RAW:
            data.append(sym8[s.elem : s.elem + s.n])
            coded += s.n
        elif s.kind == H.HUFF:
            nb = len(s.block_idx)
            o = s.block_base
            data.append(obytes[4 * o : 4 * (o + nb)])
            data.append(wbytes[4 * s.word : 4 * (s.word + s.nw)])
            coded += 4 * nb + 4 * s.nw
    if raw_len <= coded:
        return [bytes([PLANES]) + uvarint(raw_len), *(sym8[s.elem : s.elem + s.n] for s in ss)]
    return [bytes([HUFF_PLANES]) + uvarint(coded) + meta, *data]
