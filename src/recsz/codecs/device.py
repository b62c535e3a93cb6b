"""The quantizing codecs on the tensor's device, batched: many chunks in one pass.

Why batched: on a GPU a chunk of one table (a few hundred KB) codes in microseconds of
kernel time but costs ~200 kernel launches and a dozen host synchronizations; the
exchange sends 26+ such chunks a step. Here all chunks of a call share every launch and
synchronization (about six per call, each for sizes or histograms: the data stay on the
device). ``encode`` of one tensor is this with one chunk, so the bytes do not depend on
how chunks were grouped, and CPU runs of this code write what a GPU writes.

Per chunk the payload is format 2 (:mod:`recsz.codecs.base`):

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
from recsz.codecs.base import (
    DEVICE_FORMAT,
    MAGIC,
    PayloadError,
    _parse_header,
    read_uvarint,
    uvarint,
)
from recsz.codecs.stages import _HUFF_PLANES, _PLANES, QMAX, RAW, SPLIT

if TYPE_CHECKING:
    from recsz.codecs.hybrid import _QuantPipeline

_HEAD = 512  # bytes of each payload copied to the host for parsing, first round
_HASH_MUL = -7046029254386353131  # word_hash's weights (odd, position-dependent)
_HASH_ADD = 0x632BE59BD9B4E019


def _wd(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rep(counts: list[int], dev: torch.device) -> torch.Tensor:
    """[0]*c0 + [1]*c1 + ...: the owner of each element (sizes known: no sync)."""
    total = int(sum(counts))
    c = torch.tensor(counts, dtype=torch.int64).to(dev)
    return torch.repeat_interleave(torch.arange(len(counts), device=dev), c, output_size=total)


def _nonzero(mask: torch.Tensor, size: int) -> torch.Tensor:
    """Flat positions of a mask whose count is already known on the host (no sync)."""
    return torch.nonzero_static(mask.reshape(-1), size=size).view(-1)


def _excl(counts: list[int]) -> list[int]:
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


def _u32(v: torch.Tensor) -> torch.Tensor:
    sh = torch.arange(0, 32, 8, device=v.device)
    return ((v.reshape(-1, 1) >> sh) & 255).to(torch.uint8).reshape(-1)


def _from_le(b: torch.Tensor, w: int) -> torch.Tensor:
    sh = torch.arange(0, 8 * w, 8, device=b.device)
    return (b.reshape(-1, w).to(torch.int64) << sh).sum(1)


class _Up:
    """Small host arrays bound for the device, sent in one copy (each copy from pageable
    memory stalls the host: tens of them a call add up)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.at: list[tuple[int, int]] = []
        self.n = 0
        self.dev: torch.Tensor | None = None

    def add(self, a: list[int] | list[float] | np.ndarray) -> int:
        v = np.asarray(a)
        v = v.view(np.int64) if v.dtype == np.float64 else v.astype(np.int64)
        self.parts.append(v.reshape(-1))
        self.at.append((self.n, v.size))
        self.n += v.size
        return len(self.at) - 1

    def send(self, dev: torch.device) -> _Up:
        host = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        self.dev = torch.from_numpy(host).to(dev)
        return self

    def __getitem__(self, h: int) -> torch.Tensor:
        assert self.dev is not None
        o, n = self.at[h]
        return self.dev[o : o + n]

    def f64(self, h: int) -> torch.Tensor:
        return self[h].view(torch.float64)


def segmented_hash(buf: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
    """word_hash of buf[s + 8 : e] for every payload [s, e), as (K, 4) uint8: the same
    sum, taken byte by byte (a word times a weight is the sum of its bytes' shares)."""
    dev = buf.device
    k = len(starts)
    lens = [e - s - 8 for s, e in zip(starts, ends, strict=True)]
    owner = _rep(lens, dev)
    base = torch.tensor([s + 8 for s in starts], dtype=torch.int64).to(dev)
    local = torch.arange(int(sum(lens)), device=dev) - torch.tensor(_excl(lens)).to(dev)[owner]
    src = local + base[owner]
    words = (local >> 2) + 1
    contrib = (buf[src].to(torch.int64) << (8 * (local & 3))) * (words * _HASH_MUL + _HASH_ADD | 1)
    h = torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, owner, contrib)
    h += torch.tensor(lens, dtype=torch.int64).to(dev)
    fold = (h ^ (h >> 32)) & 0xFFFFFFFF
    sh = torch.arange(0, 32, 8, device=dev)
    return ((fold.view(k, 1) >> sh) & 255).to(torch.uint8)


# ---- encoding ---------------------------------------------------------------------------
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


class _Pieces:
    """The payload bytes as a list of host bytes and device slices, joined at the end
    with one host-to-device copy and one concatenation."""

    def __init__(self) -> None:
        self.host = bytearray()
        self.parts: list[tuple[str, int, int] | torch.Tensor] = []

    def add_host(self, b: bytes) -> None:
        if b:
            self.parts.append(("h", len(self.host), len(b)))
            self.host += b

    def add(self, t: torch.Tensor) -> None:
        if t.numel():
            self.parts.append(t.reshape(-1))

    def join(self, dev: torch.device) -> torch.Tensor:
        h = torch.frombuffer(bytearray(self.host), dtype=torch.uint8).to(dev)
        ts = [h[p[1] : p[1] + p[2]] if isinstance(p, tuple) else p for p in self.parts]
        return torch.cat(ts) if ts else torch.empty(0, dtype=torch.uint8, device=dev)


def encode_batch(
    codec: _QuantPipeline, xs: list[torch.Tensor], ebs: list[float]
) -> list[torch.Tensor]:
    """Encode same-dtype, same-width 2-D chunks on their (common) device."""
    x0 = xs[0]
    dev, dtype, d = x0.device, x0.dtype, int(x0.shape[1])
    wd = _wd(dtype)
    ns = [int(x.shape[0]) for x in xs]
    k = len(xs)
    n_all = sum(ns)
    X = torch.cat([x.detach().reshape(-1, d) for x in xs]) if k > 1 else x0.detach().contiguous()
    flat = X.reshape(-1)
    f32 = wd == torch.float32
    below_h = []  # the largest working value <= eb (stages._bound_below, on the host)
    for e in ebs:
        t = np.float32(e) if f32 else np.float64(e)
        below_h.append(float(np.nextafter(t, t.dtype.type(0)) if float(t) > e else t))
    up = _Up()
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
    use = []
    for c in range(k):
        if codec.dedup == "on":
            use.append(True)
        elif codec.dedup == "auto":
            use.append((ns[c] - n_lit[c]) * d > ns[c])  # a reference costs about one code
        else:
            use.append(False)
    up2 = _Up()
    h_use = up2.add([int(u) for u in use])
    h_litbase = up2.add(_excl(n_lit))
    h_celem = up2.add(_excl([n * d for n in ns]))
    up2.send(dev)
    use_t = up2[h_use][row_chunk].bool()
    lit_base = up2[h_litbase]
    ordinal = torch.cumsum(literal, 0) - 1 - lit_base[row_chunk]
    refs = torch.where(literal, torch.zeros_like(rep), ordinal[rep] + 1)
    sent_rows = [n_lit[c] if use[c] else ns[c] for c in range(k)]
    rows_sel = _nonzero(literal | ~use_t, sum(sent_rows))
    code_vals = zz.index_select(0, rows_sel).reshape(-1)
    ref_rows = [ns[c] if use[c] else 0 for c in range(k)]
    ref_vals = refs.index_select(0, _nonzero(use_t, sum(ref_rows)))

    # Byte planes of every stream of every chunk, as segments of one symbol array.
    ref_src, code_src = _excl(ref_rows), _excl([r * d for r in sent_rows])
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
    elem = _excl([s.n for s in segs])
    for s, e in zip(segs, elem, strict=True):
        s.elem = e
    n_sym = sum(s.n for s in segs)
    values = torch.cat([ref_vals, code_vals])
    off_ref = len(ref_vals)
    up3 = _Up()
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
        words, offsets = _pack_bits(segs, sym, owner, dev)
    else:
        words = offsets = torch.empty(0, dtype=torch.int64, device=dev)
    sym8 = sym.to(torch.uint8)
    wbytes = _u32(words)
    obytes = _u32(offsets)

    # Outliers: positions inside each chunk, exact values (one NaN bit pattern).
    pos = _nonzero(exact, sum(n_exact))
    chunk_elem = up2[h_celem]
    local = pos - chunk_elem[row_chunk[pos // max(d, 1)]] if pos.numel() else pos
    pbytes = local.contiguous().view(torch.uint8).view(-1, 8)
    val = flat[pos].to(torch.float64)
    val = val.masked_fill(val.isnan(), float("nan"))  # CUDA and CPU widen NaN differently
    vbytes = val.contiguous().view(torch.uint8).view(-1, 8)

    # Assemble every payload from host-made headers and device slices.
    pieces = _Pieces()
    bounds: list[tuple[int, int]] = []
    total = 0
    by_chunk: list[list[_Seg]] = [[] for _ in range(k)]
    for s in segs:
        by_chunk[s.chunk].append(s)
    e0 = _excl(n_exact)
    for c in range(k):
        core_head = bytearray([len(streams[c])]) if streams[c] else bytearray()
        for w, n in streams[c]:
            core_head.append(w)
            core_head += uvarint(n)
        body_core: list[bytes | torch.Tensor] = []
        if not streams[c]:
            pass
        elif codec.entropy:
            core_head.append(SPLIT)
            for si in range(len(streams[c])):
                ss = [s for s in by_chunk[c] if s.stream == si]
                body_core += _stream_parts(ss, sym8, wbytes, obytes)
        else:
            core_head.append(RAW)
            body_core += [sym8[s.elem : s.elem + s.n] for s in by_chunk[c]]
        core_len = len(core_head) + sum(
            len(b) if isinstance(b, bytes) else b.numel() for b in body_core
        )
        wide = ns[c] * d >= 2**32
        pw = 8 if wide else 4
        n_out = n_exact[c]
        oidx_len = 1 + pw * n_out if n_out else 0
        oval_len = 8 * n_out
        table = bytes([3]) + uvarint(core_len) + uvarint(oidx_len) + uvarint(oval_len)
        body_len = len(table) + core_len + oidx_len + oval_len
        hdr = codec._header_fields(torch.Size((ns[c], d)), dtype, ebs[c], body_len)
        start = total
        pieces.add_host(MAGIC + bytes([DEVICE_FORMAT, 0, 0, 0, 0]) + hdr + table + bytes(core_head))
        for b in body_core:
            if isinstance(b, bytes):
                pieces.add_host(b)
            else:
                pieces.add(b)
        if n_out:
            pieces.add_host(bytes([pw]))
            pieces.add(pbytes[e0[c] : e0[c] + n_out, :pw])
            pieces.add(vbytes[e0[c] : e0[c] + n_out])
        total += 8 + len(hdr) + body_len
        bounds.append((start, total))
    buf = pieces.join(dev)
    starts = [b[0] for b in bounds]
    h = segmented_hash(buf, starts, [b[1] for b in bounds])
    at = (torch.tensor(starts, dtype=torch.int64).view(-1, 1) + torch.arange(4, 8)).to(dev)
    buf[at.view(-1)] = h.view(-1)
    return [buf[a:b] for a, b in bounds]


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
    segs: list[_Seg], sym: torch.Tensor, owner: torch.Tensor, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """All Huffman segments' codes added into one word array (disjoint bits: add = OR)."""
    huff = [s for s in segs if s.kind == H.HUFF]
    if not huff:
        z = torch.empty(0, dtype=torch.int64, device=dev)
        return z, z
    lengths = np.zeros((len(segs), 256), np.int64)
    base = np.zeros((len(segs), 2), np.int64)  # (first bit of the segment's words, bits before)
    acc = 0
    for i, s in enumerate(segs):
        base[i, 1] = acc
        if s.kind == H.HUFF:
            assert s.lengths is not None
            lengths[i] = s.lengths
            base[i, 0] = 32 * s.word
            acc += s.nbits
    up = _Up()
    h_tab = up.add(np.stack([lengths, kernels.canonical_codes_many(lengths)], 1))
    h_base = up.add(base)
    bidx = [i for h in huff for i in h.block_idx]
    h_bidx = up.add(bidx)
    up.send(dev)
    tab_t = up[h_tab].view(len(segs), 2, 256)
    base_t = up[h_base].view(len(segs), 2)
    ln = tab_t[owner, 0, sym]
    code = tab_t[owner, 1, sym]
    off = torch.cumsum(ln, 0).sub_(ln) - base_t[owner, 1]  # bit offset inside the segment
    pos = off + base_t[owner, 0]
    q, sh = pos >> 5, pos & 31
    nw = sum(h.nw for h in huff)
    words = torch.zeros(nw + 1, dtype=torch.int64, device=dev)
    words.index_add_(0, q, (code << sh) & 0xFFFFFFFF)
    words.index_add_(0, q + 1, code >> (32 - sh))
    offsets = off[up[h_bidx]]
    return words[:nw], offsets


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
        return [bytes([_PLANES]) + uvarint(raw_len), *(sym8[s.elem : s.elem + s.n] for s in ss)]
    return [bytes([_HUFF_PLANES]) + uvarint(coded) + meta, *data]


# ---- decoding ---------------------------------------------------------------------------
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


class _Reader:
    """Host views of a payload's bytes: the first window, plus windows fetched later."""

    def __init__(self, head: np.ndarray, size: int) -> None:
        self.windows = [(0, head)]
        self.size = size

    def get(self, o: int, n: int) -> np.ndarray | None:
        n = min(n, self.size - o)
        for s, w in self.windows:
            if s <= o and o + n <= s + w.size:
                return w[o - s : o - s + n]
        return None


def decode_batch(codec: _QuantPipeline, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Decode format-2 payloads of ``codec`` on their (common) device."""
    dev = payloads[0].device
    k = len(payloads)
    sizes = [int(p.numel()) for p in payloads]
    buf = torch.cat(payloads) if k > 1 else payloads[0]
    starts = _excl(sizes)
    heads = torch.cat([p[:_HEAD] for p in payloads]).cpu().numpy()  # sync: the headers
    readers, o = [], 0
    for sz in sizes:
        n = min(sz, _HEAD)
        readers.append(_Reader(heads[o : o + n], sz))
        o += n
    for c, r in enumerate(readers):
        if sizes[c] < 8:
            raise PayloadError(f"payload of {sizes[c]} bytes is shorter than the fixed prefix")
        head = r.get(0, 8)
        assert head is not None
        if head[:3].tobytes() != MAGIC or int(head[3]) != DEVICE_FORMAT:
            raise PayloadError("not a device-made (format 2) recsz payload")
    got = segmented_hash(buf, starts, [s + z for s, z in zip(starts, sizes, strict=True)]).cpu()
    for c, r in enumerate(readers):
        want = r.get(4, 4)
        assert want is not None
        if not np.array_equal(got[c].numpy(), want):
            raise PayloadError("checksum mismatch: payload corrupted or truncated")
    # Parse on the host copies; what lies beyond them (the second stream's metadata
    # after the first stream's data) comes in one more copy for all payloads per round.
    for _ in range(4):
        metas = [_parse_one(codec, c, readers[c], sizes[c]) for c in range(k)]
        missing = [(c, o, n) for c, m in enumerate(metas) for o, n in m["need"]]
        if not missing:
            return _reconstruct(metas, buf, starts, dev)
        if any(o >= sizes[c] for c, o, _ in missing):
            raise PayloadError("stream metadata runs past the payload")
        extra = torch.cat([payloads[c][o : o + n] for c, o, n in missing]).cpu().numpy()
        p = 0
        for c, o, n in missing:
            n = min(n, sizes[c] - o)
            readers[c].windows.append((o, extra[p : p + n]))
            p += n
    raise PayloadError("payload metadata is nested too deep to parse")


def _parse_one(codec: _QuantPipeline, c: int, r: _Reader, size: int) -> dict:
    """Header, sections and stream layout of one payload; ``need`` lists windows still
    to fetch."""
    rest = r.get(8, _HEAD - 8)
    assert rest is not None
    fields, o = _parse_header(rest)
    o += 8
    if fields["codec"] != codec.codec_id:
        raise PayloadError(f"payload was made by codec {fields['codec']!r}, not {codec.codec_id!r}")
    if fields["blen"] != size - o:
        raise PayloadError(
            f"body is {size - o} bytes, header says {fields['blen']}: payload truncated or padded"
        )
    shape = fields["shape"]
    if len(shape) != 2:
        raise PayloadError(f"shape {shape} is not 2-D")
    n, d = shape
    m: dict = {
        "shape": (n, d),
        "dtype": fields["dtype"],
        "eb": fields["eb"],
        "need": [],
        "segs": [],
        "dims": [],
        "mode": RAW,
        "oidx": (0, 0),
        "oval": (0, 0),
    }
    sec = r.get(o, 31)
    if sec is None:
        m["need"].append((o, 31))
        return m
    if sec.size < 1 or int(sec[0]) != 3:
        raise PayloadError("malformed section table (expected 3 sections)")
    p, lens = 1, []
    for _ in range(3):
        ln, p = read_uvarint(sec, p)
        lens.append(ln)
    o += p
    if o + sum(lens) != size:
        raise PayloadError("section lengths do not add up to the body")
    core, core_len = o, lens[0]
    m["oidx"] = (core + lens[0], lens[1])
    m["oval"] = (core + lens[0] + lens[1], lens[2])
    m["ow"] = 0
    if lens[1]:
        wb = r.get(core + lens[0], 1)
        if wb is None:
            m["need"].append((core + lens[0], 1))
            return m
        m["ow"] = int(wb[0])
    if n * d == 0:
        if core_len or lens[1] > 1 or lens[2]:
            raise PayloadError("an empty tensor's payload carries data")
        return m
    hd = r.get(core, 64)
    if hd is None:
        m["need"].append((core, 64))
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
    m["mode"] = mode
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
            m["need"].append((o, 16 + w * H.MAX_META))
            return m
        coder = int(sh[0])
        ln, q = read_uvarint(sh, 1)
        o += q
        if o + ln > end:
            raise PayloadError("integer stream runs past the body")
        if coder == _PLANES:
            if ln != w * num:
                raise PayloadError(f"stream holds {ln} bytes, expected {w * num}")
            for j in range(w):
                m["segs"].append(_DSeg(c, si, j, num, H.RAW, at=o + j * num))
        elif coder == _HUFF_PLANES:
            meta = r.get(o, min(ln, 1 + w * H.MAX_META))
            if meta is None:
                m["need"].append((o, 1 + w * H.MAX_META))
                return m
            m["segs"] += _huff_segs(meta, c, si, w, num, o, ln)
        else:
            raise PayloadError(f"stream coder {coder} in a device-made payload")
        o += ln
    if o != end:
        raise PayloadError(f"{end - o} stray bytes after the integer streams")
    return m


def _huff_segs(meta: np.ndarray, c: int, si: int, w: int, n: int, at: int, ln: int) -> list[_DSeg]:
    if meta.size < 1 or int(meta[0]) != H.LOG2_BLOCK:
        raise PayloadError("Huffman stream with an unknown block size")
    nblocks = -(-n // (1 << H.LOG2_BLOCK))
    o = 1
    p = at + H.meta_size(meta, w)
    out = []
    for j in range(w):
        kind = int(meta[o])
        if kind == H.CONST:
            out.append(_DSeg(c, si, j, n, H.CONST, value=int(meta[o + 1])))
            o += 2
        elif kind == H.RAW:
            out.append(_DSeg(c, si, j, n, H.RAW, at=p))
            o += 1
            p += n
        else:
            lengths = np.zeros(256, np.int64)
            if kind == H.HUFF:
                nib = meta[o + 1 : o + 129]
                lengths[0::2], lengths[1::2] = nib & 15, nib >> 4
                o += 129
            else:
                mm = int(meta[o + 1])
                pairs = meta[o + 2 : o + 2 + 2 * mm].reshape(mm, 2).astype(np.int64)
                if np.unique(pairs[:, 0]).size != mm:
                    raise PayloadError("Huffman plane lists a symbol twice")
                lengths[pairs[:, 0]] = pairs[:, 1]
                o += 2 + 2 * mm
            nbits = int.from_bytes(meta[o : o + 4].tobytes(), "little")
            o += 4
            if not H._kraft_ok(lengths) or nbits > n * H.MAX_LEN:
                raise PayloadError("Huffman plane with an invalid code")
            nw = -(-nbits // 32)
            out.append(
                _DSeg(
                    c,
                    si,
                    j,
                    n,
                    H.HUFF,
                    at=p,
                    nbits=nbits,
                    nw=nw,
                    words_at=p + 4 * (nblocks - 1),
                    lengths=lengths,
                )
            )
            p += 4 * (nblocks - 1) + 4 * nw
    if p != at + ln:
        raise PayloadError(f"{at + ln - p} stray bytes after a Huffman stream")
    return out


def _reconstruct(
    metas: list[dict], buf: torch.Tensor, starts: list[int], dev: torch.device
) -> list[torch.Tensor]:
    for m, a in zip(metas, starts, strict=True):
        m["base"] = a
    segs: list[_DSeg] = [s for m in metas for s in m["segs"]]
    symbols = _decode_huffman([s for s in segs if s.kind == H.HUFF], buf, starts, dev)
    # Stream values: every plane added into its (payload, stream) at its shift.
    keys = sorted({(s.payload, s.stream) for s in segs})
    counts = {key: 0 for key in keys}
    for s in segs:
        counts[(s.payload, s.stream)] = s.n
    vbase = dict(zip(keys, _excl([counts[key] for key in keys]), strict=True))
    values = torch.zeros(sum(counts.values()), dtype=torch.int64, device=dev)
    up = _Up()
    var = [s for s in segs if s.kind != H.CONST]
    const = [s for s in segs if s.kind == H.CONST]
    h_var = [
        up.add([s.n for s in var]),
        up.add(_excl([s.n for s in var])),
        up.add([vbase[(s.payload, s.stream)] for s in var]),
        up.add([8 * s.plane for s in var]),
    ]
    h_const = [
        up.add([s.n for s in const]),
        up.add([s.value << (8 * s.plane) for s in const]),
        up.add([vbase[(s.payload, s.stream)] for s in const]),
        up.add(_excl([s.n for s in const])),
    ]
    groups: dict[tuple[torch.dtype, int], list[int]] = {}
    for c, m in enumerate(metas):
        groups.setdefault((m["dtype"], m["shape"][1]), []).append(c)
    plans = [_plan_group(metas, idx, d, vbase, starts, up) for (_, d), idx in groups.items()]
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
        _finish_group(plan, metas, values, buf, up, dev, outs, ok_terms)
    if ok_terms and not bool(torch.stack(ok_terms).all()):  # the one check of them all
        raise PayloadError("row references or outlier positions do not fit the tensor")
    return [y for y in outs if y is not None]


def _plan_group(
    metas: list[dict], idx: list[int], d: int, vbase: dict, starts: list[int], up: _Up
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
    outl = [
        (c, metas[c]["ow"], (metas[c]["oidx"][1] - 1) // max(metas[c]["ow"], 1))
        for c in live
        if metas[c]["oidx"][1] or metas[c]["oval"][1]
    ]
    for c, w, k in outl:
        m = metas[c]
        if w not in (4, 8) or (m["oidx"][1] - 1) % w or m["oval"][1] != 8 * k:
            raise PayloadError("malformed outlier section")
    outl = [o for o in outl if o[2]]
    rowbase = _excl(n)
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
            "litbase": up.add(_excl(lit)),
            "step": up.add([2.0 * metas[c]["eb"] for c in live]),
            "hasref": up.add([int(r) for r in refs]),
            "elem": up.add([rb * d for rb in rowbase]),
            "ocount": up.add([k for _, _, k in outl]),
            "oowner": up.add([live.index(c) for c, _, _ in outl]),
        },
    }


def _finish_group(
    g: dict,
    metas: list[dict],
    values: torch.Tensor,
    buf: torch.Tensor,
    up: _Up,
    dev: torch.device,
    outs: list[torch.Tensor | None],
    ok_terms: list[torch.Tensor],
) -> None:
    """Rows of every payload of a group: references resolved, dequantized, outliers set."""
    d, live, h = g["d"], g["live"], g["h"]
    dtype = metas[g["idx"][0]]["dtype"]
    wd = _wd(dtype)
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
        at = _nonzero(up[h["hasref"]][owner].bool(), sum(g["n"][i] for i in with_refs))
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
        pos_parts, val_parts = [], []
        for c, w, k in g["outl"]:
            m = metas[c]
            a = int(m["base"])
            oi, ov = m["oidx"][0], m["oval"][0]
            pos_parts.append(_from_le(buf[a + oi + 1 : a + oi + 1 + w * k], w))
            val_parts.append(buf[a + ov : a + ov + 8 * k])
        pos = torch.cat(pos_parts)
        val = torch.cat(val_parts).view(torch.float64).to(dtype)
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
    """Every Huffman segment's symbols, concatenated: one speculative decode of all.

    Each segment's words are followed by one zero word, so that its end is a bit position
    of its own (a fixed point of the successor map); the last position is a sink that
    every invalid code and overrun leads to."""
    if not segs:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    block = 1 << H.LOG2_BLOCK
    nseg = len(segs)
    lengths = np.stack([s.lengths for s in segs if s.lengths is not None])
    tab = kernels.decode_tables(lengths, kernels.canonical_codes_many(lengths), H.MAX_LEN)
    wbase = _excl([s.nw + 1 for s in segs])
    acc = wbase[-1] + segs[-1].nw + 1
    sink = 32 * acc
    nbs = [-(-s.n // block) for s in segs]
    counts = [s.n for s in segs]
    up = _Up()
    h_tab = up.add(tab)
    h_bits = up.add([32 * (s.nw + 1) for s in segs] + [1])
    h_gbase = up.add([32 * w for w in wbase])
    h_ends = up.add([32 * w + s.nbits for w, s in zip(wbase, segs, strict=True)])
    h_nbs = up.add(nbs)
    h_first = up.add(_excl(nbs))
    h_last = up.add(np.cumsum(nbs) - 1)
    h_counts = up.add(counts)
    h_cbase = up.add(_excl(counts))
    h_inblock = up.add(
        [min(block, s.n - b * block) for s, nb in zip(segs, nbs, strict=True) for b in range(nb)]
    )
    up.send(dev)
    tab_t = up[h_tab].view(nseg, 2, 1 << H.MAX_LEN)
    zero4 = torch.zeros(4, dtype=torch.uint8, device=dev)
    pieces = []
    for s in segs:
        a = starts[s.payload] + s.words_at
        pieces += [buf[a : a + 4 * s.nw], zero4]
    words = torch.cat(
        [_from_le(torch.cat(pieces), 4), torch.zeros(1, dtype=torch.int64, device=dev)]
    )
    pos = torch.arange(sink + 1, device=dev)
    owner = torch.repeat_interleave(
        torch.arange(nseg + 1, device=dev), up[h_bits], output_size=sink + 1
    ).clamp_(max=nseg - 1)
    ends = up[h_ends]
    qq = (pos >> 5).clamp_(max=words.numel() - 2)
    window = ((words[qq] | (words[qq + 1] << 32)) >> (pos & 31)) & ((1 << H.MAX_LEN) - 1)
    ln = tab_t[owner, 1, window]
    end_p = ends[owner]
    nxt = pos + ln
    nxt = torch.where((ln == 0) | (nxt > end_p) | (pos >= end_p), sink, nxt)
    nxt = torch.where(pos == end_p, pos, nxt)
    nxt[sink] = sink
    jumps = [nxt]
    for _ in range(H.LOG2_BLOCK - 1):
        jumps.append(jumps[-1][jumps[-1]])
    # Block starts: 0 and the stored offsets, each plus its segment's first bit.
    nb_total = sum(nbs)
    blk_owner = torch.repeat_interleave(
        torch.arange(nseg, device=dev), up[h_nbs], output_size=nb_total
    )
    begin_local = torch.zeros(nb_total, dtype=torch.int64, device=dev)
    if nb_total > nseg:
        stored = [
            buf[starts[s.payload] + s.at : starts[s.payload] + s.at + 4 * (nb - 1)]
            for s, nb in zip(segs, nbs, strict=True)
        ]
        later = torch.ones(nb_total, dtype=torch.bool, device=dev)
        later[up[h_first]] = False
        begin_local[_nonzero(later, nb_total - nseg)] = _from_le(torch.cat(stored), 4)
    begin = begin_local + up[h_gbase][blk_owner]
    seg_end = ends[blk_owner]
    is_last = torch.zeros(nb_total, dtype=torch.bool, device=dev)
    is_last[up[h_last]] = True
    block_end = torch.where(is_last, seg_end, torch.cat([begin[1:], begin.new_zeros(1)]))
    at = begin.clamp(0, sink).view(-1, 1)
    for lvl in reversed(range(H.LOG2_BLOCK)):
        at = torch.stack([at, jumps[lvl][at]], dim=2).view(at.shape[0], -1)
    at = at.view(-1)
    # Symbol i of segment s sits at its block row, column i % block.
    total = sum(counts)
    sym_owner = torch.repeat_interleave(
        torch.arange(nseg, device=dev), up[h_counts], output_size=total
    )
    flat = torch.arange(total, device=dev) - up[h_cbase][sym_owner] + up[h_first][sym_owner] * block
    sym_pos = at[flat]
    last_sym = at[torch.arange(nb_total, device=dev) * block + up[h_inblock] - 1]
    ok = (
        (nxt[last_sym] == block_end).all()
        & (sym_pos < ends[sym_owner]).all()
        & (begin <= seg_end).all()
        & (block_end >= begin).all()
    )
    if not bool(ok):  # the one synchronization of all the Huffman decoding
        raise PayloadError("Huffman plane does not decode to its symbol count")
    return tab_t[sym_owner, 0, window[sym_pos]].to(torch.uint8)
