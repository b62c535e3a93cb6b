"""Fused CPU kernels of the hybrid codec (numba): one pass per stage instead of ~20 torch ops.

On a 128 KB chunk (1024 vectors of dim 32, a typical per-table slice) the torch path spends
most of its time launching small operators; these kernels quantize, check the bound, hash
and deduplicate rows, zig-zag and lay out byte planes in a few loops, so what remains is
zstd's entropy stage (a kept library) and the payload header. Below them, the two coders
no library offers: an adaptive range coder for row references (multi-symbol, counts in a
Fenwick tree) and a context-modelled binary arithmetic coder for codes (``hybrid-ac``).
They write exactly the body layout of :mod:`recsz.codecs.stages` (tests/test_kernels.py
decodes one path's bytes with the other), so CUDA tensors keep using the torch path and
every payload decodes on both.

Exactness: the reconstruction is ``float(q) * float(2 eb)`` in the working precision
(float32 for float32 input, float64 for float64), one IEEE multiplication, bit-identical to
:func:`recsz.codecs.stages.dequantize`. The encoder checks every element's reconstruction
against the bound in float64 with ``>=`` (rounding is monotonic, so a true error above eb
never computes below eb) and hands every element that fails to the caller as an outlier.
No fastmath anywhere: contracting the check into an FMA would test a value the decoder
never produces.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

#: Largest code magnitude for float32 input (float32 holds integers exactly to 2^24) and
#: for float64 input (as in stages.QMAX: its zig-zag still fits 32 bits).
QMAX32 = 2**24
QMAX64 = 2**30 - 1

# Decode status codes (the caller turns them into PayloadError messages).
OK, BAD_LITERAL_COUNT, BAD_REFERENCE, BAD_WIDTH = 0, 1, 2, 3


def _like(q: float, like: float) -> float:
    """``q`` rounded to the float type of ``like`` (typed by the overload below)."""
    raise NotImplementedError  # only called inside jitted code


@overload(_like)
def _like_impl(q, like):
    # numba matches these argument names to _like's; the lambdas are the typed bodies.
    if like == types.float32:
        return lambda q, like: np.float32(q)
    return lambda q, like: np.float64(q)


@njit(cache=True, nogil=True)
def width(top: int | np.integer) -> int:
    """Narrowest byte width (1, 2, 4 or 8) of a non-negative integer stream whose largest
    value is ``top``: the one rule for the fused and the torch packers."""
    if top < 256:
        return 1
    if top < 65536:
        return 2
    if top < 2**32:
        return 4
    return 8


@njit(cache=True, nogil=True)
def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for 1-D views that never overlap (numba's slice assignment checks for
    overlap and may copy through a temporary, which costs more than a row)."""
    for j in range(dst.size):
        dst[j] = src[j]


@njit(cache=True, nogil=True)
def _put_planes(out: np.ndarray, base: int, vals: np.ndarray, n: int, w: int) -> None:
    """Write ``vals[:n]`` as ``w`` little-endian byte planes at ``out[base:]``.

    Loops run over slices: indexing ``out[base + i]`` makes numba guard every access
    against negative indices, which stops vectorization (10x slower here).
    """
    v = vals[:n]
    for b in range(w):
        o = out[base + b * n : base + (b + 1) * n]
        shift = 8 * b
        for i in range(n):
            o[i] = np.uint8((v[i] >> shift) & 0xFF)


@njit(cache=True, nogil=True)
def _get_planes(raw: np.ndarray, base: int, n: int, w: int) -> np.ndarray:
    """Inverse of :func:`_put_planes`: ``n`` values of ``w`` byte planes as int64."""
    v = np.zeros(n, np.int64)
    for b in range(w):
        p = raw[base + b * n : base + (b + 1) * n]
        shift = 8 * b
        for i in range(n):
            v[i] |= np.int64(p[i]) << shift
    return v


@njit(cache=True, nogil=True)
def encode_rows(
    x: np.ndarray, stepv: np.ndarray, eb: float, dedup: int, qmax: int
) -> tuple[np.ndarray, int, int, int, int, np.ndarray]:
    """Quantize, check, deduplicate and lay out one chunk.

    Args:
        x: (N, D) C-contiguous float32 or float64 array, every element finite.
        stepv: one-element array of x's dtype holding 2 eb rounded once to that dtype (the
            decoder's step; an array so that the multiplication below runs in x's dtype).
        eb: absolute error bound (> 0).
        dedup: 0 never, 1 always, 2 when repeated rows save more than the references cost.
        qmax: largest code magnitude (QMAX32 or QMAX64).
    Returns:
        planes (uint8: the refs stream's planes, if any, then the literal codes' planes),
        (w_refs, n_refs) with n_refs = 0 when no refs stream is written, (w_codes, n_codes),
        and the flat positions (int64) of elements that must travel exactly.
    """
    n, d = x.shape
    inv = 1.0 / (2.0 * eb)
    step = stepv[0]
    xf = x.reshape(n * d)
    zf = np.empty(n * d, np.uint32)
    n_miss = 0
    bits = np.uint32(0)  # OR of all codes: below 2^8 / 2^16 exactly when their maximum is
    # Branch-free so that LLVM vectorizes it; the rare misses are collected afterwards.
    for k in range(n * d):
        v = xf[k]
        q = min(max(np.rint(np.float64(v) * inv), -qmax), qmax)
        ok = abs(np.float64(_like(q, step) * step) - np.float64(v)) < eb
        qi = np.int64(q) if ok else np.int64(0)
        n_miss += not ok
        zz = np.uint32((qi << 1) ^ (qi >> 63))
        zf[k] = zz
        bits |= zz
    miss = np.empty(n_miss, np.int64)
    if n_miss:
        m = 0
        for k in range(n * d):
            v = xf[k]
            q = min(max(np.rint(np.float64(v) * inv), -qmax), qmax)
            if not abs(np.float64(_like(q, step) * step) - np.float64(v)) < eb:
                miss[m] = k
                m += 1
    # Rows: open-addressing table of row indices keyed by a hash of the codes; every hit is
    # verified element by element, so literal rows are exactly the first occurrences.
    refs = np.zeros(n, np.int64)
    lit_of = np.empty(n, np.int64)  # ordinal of each literal row, by row
    n_lit = n
    if dedup != 0 and n > 1:
        size = 1
        while size < 2 * n:
            size *= 2
        table = np.full(size, -1, np.int64)
        n_lit = 0
        # Hash = sum of codes times fixed odd 64-bit weights (wrapping): independent
        # products that vectorize, where a byte-serial hash would chain d multiplies.
        wts = np.empty(d, np.uint64)
        s64 = np.uint64(0x9E3779B97F4A7C15)
        for j in range(d):
            s64 = s64 * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
            wts[j] = s64 | np.uint64(1)
        for i in range(n):
            row = zf[i * d : (i + 1) * d]
            h = np.uint64(0)
            for j in range(d):
                h += np.uint64(row[j]) * wts[j]
            h ^= h >> np.uint64(31)
            slot = np.int64(h & np.uint64(size - 1))
            while True:
                r = table[slot]
                if r < 0:
                    table[slot] = i
                    lit_of[i] = n_lit
                    n_lit += 1
                    break
                other = zf[r * d : (r + 1) * d]
                diff = np.uint32(0)
                for j in range(d):
                    diff |= other[j] ^ row[j]
                if diff == 0:
                    refs[i] = lit_of[r] + 1
                    break
                slot = (slot + 1) & (size - 1)
        if dedup == 2 and (n - n_lit) * d <= n:
            n_lit = n
    use_refs = n_lit < n or dedup == 1
    w_codes = width(np.int64(bits))  # repeated rows hold no code the literal ones lack
    n_codes = n_lit * d if use_refs else n * d
    top_ref = np.int64(0)
    if use_refs:
        for i in range(n):
            top_ref = max(top_ref, refs[i])
    w_refs = width(top_ref) if use_refs else 1
    n_refs = n if use_refs else 0
    planes = np.empty(w_refs * n_refs + w_codes * n_codes, np.uint8)
    base = w_refs * n_refs
    if use_refs:
        _put_planes(planes, 0, refs, n, w_refs)
        lit = np.empty(n_codes, np.uint32)
        k = 0
        for i in range(n):
            if refs[i] == 0:
                _copy(lit[k : k + d], zf[i * d : i * d + d])
                k += d
        _put_planes(planes, base, lit, n_codes, w_codes)
    else:
        _put_planes(planes, base, zf, n_codes, w_codes)
    return planes, w_refs, n_refs, w_codes, n_codes, miss


@njit(cache=True, nogil=True)
def _dequantize_planes(
    raw: np.ndarray, base: int, n: int, w: int, step: float, out: np.ndarray
) -> None:
    """Zig-zagged codes in ``w`` byte planes -> code * step, in one pass for one-byte codes
    (the usual width at the paper's bounds) instead of through an int64 array."""
    if w == 1:
        p = raw[base : base + n]
        for i in range(n):
            zz = int(p[i])
            out[i] = _like((zz >> 1) ^ -(zz & 1), step) * step
        return
    codes = _get_planes(raw, base, n, w)
    for i in range(n):
        zz = codes[i]
        out[i] = _like((zz >> 1) ^ -(zz & 1), step) * step


@njit(cache=True, nogil=True)
def decode_rows(
    raw: np.ndarray,
    w_refs: int,
    n_refs: int,
    w_codes: int,
    n_codes: int,
    out: np.ndarray,
    stepv: np.ndarray,
) -> int:
    """Inverse of :func:`encode_rows` into ``out`` (N, D); returns a status code.

    The literal rows are dequantized once; then every row is copied from the literal it is
    (the k-th literal row) or refers to, in one pass."""
    n, d = out.shape
    if n_refs == 0:
        if n_codes != n * d:
            return BAD_LITERAL_COUNT
        _dequantize_planes(raw, 0, n_codes, w_codes, stepv[0], out.reshape(n * d))
        return OK
    if n_refs != n or d == 0 or n_codes % d:
        return BAD_LITERAL_COUNT
    n_lit = n_codes // d
    vals = np.empty((n_lit, d), out.dtype)
    _dequantize_planes(raw, w_refs * n_refs, n_codes, w_codes, stepv[0], vals.reshape(n_codes))
    refs = _get_planes(raw, 0, n_refs, w_refs)
    k = 0
    for i in range(n):
        r = refs[i]
        if r == 0:
            src = k
            k += 1
            if src >= n_lit:
                return BAD_LITERAL_COUNT
        else:
            src = r - 1
            if src >= k:  # a reference may only name a literal already sent
                return BAD_REFERENCE
        for j in range(d):
            out[i, j] = vals[src, j]
    if k != n_lit:
        return BAD_LITERAL_COUNT
    return OK


# ---- adaptive range coding of the row-reference stream ---------------------------------
# A repeated row refers to the literal it repeats; popular ids are referenced again and
# again, so the references follow the id frequencies of the batch. An adaptive model learns
# them while coding, without a frequency table in the payload: P(new literal) grows with
# the number of literals seen, P(ref k) with how often k was referenced (a Chinese-
# restaurant-process model, PPM's escape method C). zstd's byte-wise Huffman spends ~25%
# more on the same stream (measured on real Criteo lookups). The coder is Subbotin's
# carry-less 32-bit range coder; counts live in a Fenwick tree (O(log n) per symbol).
_TOP = np.uint64(1 << 24)
_BOT = np.uint64(1 << 16)
_M32 = np.uint64(0xFFFFFFFF)
_MAXTOT = 1 << 16  # the coder's frequency precision; counts are halved beyond it


@njit(cache=True, nogil=True)
def _fw_add(t: np.ndarray, i: int, v: int) -> None:
    i += 1
    while i < t.size:
        t[i] += v
        i += i & (-i)


@njit(cache=True, nogil=True)
def _fw_cum(t: np.ndarray, i: int) -> int:
    s = 0
    while i > 0:
        s += t[i]
        i -= i & (-i)
    return s


@njit(cache=True, nogil=True)
def _fw_find(t: np.ndarray, target: int, top_bit: int) -> tuple[int, int]:
    """The symbol whose cumulative interval holds ``target``, and target - its start."""
    pos = 0
    step = top_bit
    while step > 0:
        nxt = pos + step
        if nxt < t.size and t[nxt] <= target:
            pos = nxt
            target -= t[nxt]
        step >>= 1
    return pos, target


@njit(cache=True, nogil=True)
def _crp_init(n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A fresh model for ``n`` references: Fenwick tree, counts, total (escape count 1)."""
    t = np.zeros(n + 2, np.int64)
    cnt = np.zeros(n + 1, np.int64)
    cnt[0] = 1
    _fw_add(t, 0, 1)
    return t, cnt, 1


@njit(cache=True, nogil=True)
def _model_update(t: np.ndarray, cnt: np.ndarray, s: int, n_lit: int, tot: int) -> tuple[int, int]:
    """Count symbol ``s``; returns (literals seen, total)."""
    if s == 0:
        n_lit += 1
        cnt[n_lit] = 1
        _fw_add(t, n_lit, 1)
        cnt[0] += 1
        _fw_add(t, 0, 1)
        tot += 2
    else:
        cnt[s] += 1
        _fw_add(t, s, 1)
        tot += 1
    if tot > _MAXTOT:
        tot = 0
        t[:] = 0
        for k in range(n_lit + 1):
            cnt[k] = (cnt[k] + 1) >> 1
            _fw_add(t, k, cnt[k])
            tot += cnt[k]
    return n_lit, tot


@njit(cache=True, nogil=True)
def _settled(low: np.uint64, rng: np.uint64) -> tuple[bool, np.uint64]:
    """Subbotin's renormalization rule, shared by encoder and decoder so they cannot drift:
    (True, rng) when the top byte is still undecided and the range wide enough; else
    (False, rng), rng narrowed to the carry-free boundary when it had become too small,
    and the caller shifts one byte out (encoder) or in (decoder)."""
    if (low ^ ((low + rng) & _M32)) >= _TOP:
        if rng >= _BOT:
            return True, rng
        rng = (np.uint64(0) - low) & (_BOT - np.uint64(1))
    return False, rng


@njit(cache=True, nogil=True)
def encode_refs(raw: np.ndarray, n: int, w: int) -> np.ndarray:
    """Range-code a reference stream given as ``w`` byte planes of ``n`` values."""
    refs = _get_planes(raw, 0, n, w)
    out = np.empty(2 * n + 16, np.uint8)
    o = 0
    low = np.uint64(0)
    rng = _M32
    t, cnt, tot = _crp_init(n)
    n_lit = 0
    for i in range(n):
        s = refs[i]
        if s < 0 or s > n_lit:  # cannot happen for streams made by encode_rows
            return out[:0]
        r = rng // np.uint64(tot)
        low = (low + np.uint64(_fw_cum(t, s)) * r) & _M32
        rng = (r * np.uint64(cnt[s])) & _M32
        while True:
            done, rng = _settled(low, rng)
            if done:
                break
            if o >= out.size:  # incompressible: the caller keeps another coding
                return out[:0]
            out[o] = np.uint8(low >> np.uint64(24))
            o += 1
            low = (low << np.uint64(8)) & _M32
            rng = (rng << np.uint64(8)) & _M32
        n_lit, tot = _model_update(t, cnt, s, n_lit, tot)
    for _ in range(4):
        if o >= out.size:
            return out[:0]
        out[o] = np.uint8(low >> np.uint64(24))
        o += 1
        low = (low << np.uint64(8)) & _M32
    return out[:o]


@njit(cache=True, nogil=True)
def decode_refs(buf: np.ndarray, n: int, w: int) -> tuple[np.ndarray, int]:
    """Inverse of :func:`encode_refs`: the stream's ``w`` byte planes, and a status code.

    Reads past the end of ``buf`` as zeros, so that corrupt input can only produce wrong
    references (which the row decoder and the checksum reject), never a crash.
    """
    refs = np.empty(n, np.int64)
    low = np.uint64(0)
    rng = _M32
    code = np.uint64(0)
    p = 0
    for _ in range(4):
        b = np.uint64(buf[p]) if p < buf.size else np.uint64(0)
        p += 1
        code = ((code << np.uint64(8)) | b) & _M32
    t, cnt, tot = _crp_init(n)
    top_bit = 1
    while top_bit * 2 < t.size:
        top_bit *= 2
    n_lit = 0
    for i in range(n):
        r = rng // np.uint64(tot)
        if r == 0:
            return np.empty(0, np.uint8), BAD_REFERENCE
        v = min(int(((code - low) & _M32) // r), tot - 1)
        s, rem = _fw_find(t, v, top_bit)
        if s > n_lit:
            return np.empty(0, np.uint8), BAD_REFERENCE
        low = (low + np.uint64(v - rem) * r) & _M32
        rng = (r * np.uint64(cnt[s])) & _M32
        while True:
            done, rng = _settled(low, rng)
            if done:
                break
            b = np.uint64(buf[p]) if p < buf.size else np.uint64(0)
            p += 1
            code = ((code << np.uint64(8)) | b) & _M32
            low = (low << np.uint64(8)) & _M32
            rng = (rng << np.uint64(8)) & _M32
        refs[i] = s
        n_lit, tot = _model_update(t, cnt, s, n_lit, tot)
    planes = np.empty(n * w, np.uint8)
    _put_planes(planes, 0, refs, n, w)
    return planes, OK


# ---- context-modelled binary arithmetic coding of the literal codes --------------------
# zstd's Huffman stage is order-0 and spends whole bits: on backward traffic (gradients of
# distinct ids, half of them zero codes) it writes ~20% more than the codes' order-0
# entropy, and rows differ in scale (a popular id's summed gradient vs a rare one's), which
# an order-0 coder cannot see. This coder binarizes each code (zero?, magnitude by a
# 5-level bit tree, sign) and codes every decision with an adaptive probability chosen by
# the mean magnitude of the codes already seen in the same row (9 contexts). Measured on
# the link benchmark's traffic: backward 646 KB (zstd) vs 470 KB conditional entropy.
# The range coder is LZMA's (11-bit probabilities, carry propagation through a cache).
# State lives in local variables of one loop: numba keeps them in registers, where state
# in a small array passed to helper functions cost ~5x the time.
_PROB_BITS = 11
_PROB_ONE = 1 << _PROB_BITS
_ADAPT = 4  # adaptation shift: chunks are short, so probabilities must learn quickly
_N_CTX = 9
_TREE = 32  # magnitudes 1..31 by a bit tree; 32 and above escape to Elias-gamma bits
_NODES = 34  # per context: zero flag, sign, tree nodes 1..31 at 1 + node
_ESC = _N_CTX * _NODES  # one shared slot for escape bits
_N_SLOTS = _ESC + 1


@njit(cache=True, nogil=True)
def _ctx(total: int, j: int) -> int:
    """Context from the codes already coded in this row: j of them, magnitudes summing to
    ``total`` (mean thresholds 0, 1/2, 1, 2, 3, 5, 8, without dividing)."""
    if j == 0:
        return 0
    if total == 0:
        return 1
    if 2 * total < j:
        return 2
    if total < j:
        return 3
    if total < 2 * j:
        return 4
    if total < 3 * j:
        return 5
    if total < 5 * j:
        return 6
    if total < 8 * j:
        return 7
    return 8


@njit(cache=True, nogil=True)
def encode_codes_ac(raw: np.ndarray, base: int, n: int, w: int, d: int) -> np.ndarray:
    """Arithmetic-code ``n`` zig-zagged codes (``w`` byte planes at ``raw[base:]``) in rows
    of ``d``; an empty array when that would not beat one byte a code.

    Each code is a short sequence of decisions (state 0 zero flag, 1..5 magnitude tree,
    6/7 escape in Elias-gamma, 8 sign), walked by the same state machine as the decoder.
    """
    codes = _get_planes(raw, base, n, w)
    out = np.empty(n + 64, np.uint8)
    probs = np.full(_N_SLOTS, _PROB_ONE // 2, np.int64)
    low = 0
    rng = 0xFFFFFFFF
    cache = 0
    cache_size = 1
    o = 0
    total = 0
    for i in range(n + 5):
        if i < n:
            j = i % d
            if j == 0:
                total = 0
            c = _ctx(total, j) * _NODES
            zz = codes[i]
            q = (zz >> 1) ^ -(zz & 1)
            m = abs(q)
            total += m
            mm = min(m, _TREE)
            v = m - _TREE + 1
            nb = 0
            if mm == _TREE:
                while (v >> nb) > 1:
                    nb += 1
            state = 0
            slot = c
            bit = 1 if m else 0
            node = 1
            left = 0
        else:  # flush: five more shifts of low
            state = -1
            c = slot = bit = m = mm = q = v = nb = node = left = 0
        while True:
            shift = state < 0
            if not shift:
                p = probs[slot]
                bound = (rng >> _PROB_BITS) * p
                if bit == 0:
                    rng = bound
                    probs[slot] = p + ((_PROB_ONE - p) >> _ADAPT)
                else:
                    low += bound
                    rng -= bound
                    probs[slot] = p - (p >> _ADAPT)
                if rng < (1 << 24):
                    rng <<= 8
                    shift = True
            if shift:
                if low < 0xFF000000 or low >= (1 << 32):
                    carry = low >> 32
                    temp = cache
                    while True:
                        if o >= out.size:
                            return out[:0]
                        out[o] = (temp + carry) & 0xFF
                        o += 1
                        temp = 0xFF
                        cache_size -= 1
                        if cache_size == 0:
                            break
                    cache = (low >> 24) & 0xFF
                cache_size += 1
                low = (low & 0x00FFFFFF) << 8
            # the next decision of this code
            if state == 0:
                if m == 0:
                    break
                state = 1
                bit = ((mm - 1) >> 4) & 1
                slot = c + 1 + node
            elif 1 <= state <= 5:
                node = 2 * node + bit
                if state < 5:
                    bit = ((mm - 1) >> (4 - state)) & 1
                    state += 1
                    slot = c + 1 + node
                elif mm == _TREE:
                    state = 6
                    slot = _ESC
                    left = nb
                    bit = 0 if left else 1
                else:
                    state = 8
                    slot = c + 1
                    bit = 1 if q < 0 else 0
            elif state == 6:
                if left:
                    left -= 1
                    bit = 0 if left else 1
                elif nb == 0:  # the leading 1 of v went out and v has no more bits
                    state = 8
                    slot = c + 1
                    bit = 1 if q < 0 else 0
                else:
                    state = 7
                    left = nb - 1
                    bit = (v >> left) & 1
            elif state == 7:
                if left:
                    left -= 1
                    bit = (v >> left) & 1
                else:
                    state = 8
                    slot = c + 1
                    bit = 1 if q < 0 else 0
            else:
                break
    return out[:o]


@njit(cache=True, nogil=True)
def decode_codes_ac(buf: np.ndarray, n: int, w: int, d: int) -> tuple[np.ndarray, int]:
    """Inverse of :func:`encode_codes_ac`: ``w`` byte planes of ``n`` codes, and a status.

    Reads past the end of ``buf`` as zeros and rejects codes wider than ``w`` bytes, so
    corrupt input gives an error status or wrong codes (the payload checksum catches
    corruption before this runs), never an out-of-bounds access.
    """
    codes = np.empty(n, np.int64)
    probs = np.full(_N_SLOTS, _PROB_ONE // 2, np.int64)
    limit = (1 << (8 * w)) - 1 if w < 8 else (1 << 62)
    code = 0
    rng = 0xFFFFFFFF
    pos = 0
    for _ in range(5):
        code = ((code << 8) | (int(buf[pos]) if pos < buf.size else 0)) & 0xFFFFFFFF
        pos += 1
    total = 0
    for i in range(n):
        j = i % d
        if j == 0:
            total = 0
        c = _ctx(total, j) * _NODES
        # One decision per pass: state 0 zero flag, 1..5 tree levels, 6 escape zeros,
        # 7 escape bits, 8 sign; ``slot`` picks the probability of the next decision.
        state = 0
        slot = c
        node = 1
        nb = 0
        left = 0
        v = 0
        m = 0
        q = 0
        while True:
            p = probs[slot]
            bound = (rng >> _PROB_BITS) * p
            if code < bound:
                rng = bound
                probs[slot] = p + ((_PROB_ONE - p) >> _ADAPT)
                bit = 0
            else:
                code -= bound
                rng -= bound
                probs[slot] = p - (p >> _ADAPT)
                bit = 1
            if rng < (1 << 24):
                rng <<= 8
                code = ((code << 8) | (int(buf[pos]) if pos < buf.size else 0)) & 0xFFFFFFFF
                pos += 1
            if state == 0:
                if bit == 0:
                    break  # q = 0
                state = 1
                slot = c + 1 + node
            elif state <= 5:
                node = 2 * node + bit
                if state < 5:
                    state += 1
                    slot = c + 1 + node
                else:
                    m = node - _TREE + 1
                    if m == _TREE:
                        state = 6
                        slot = _ESC
                    else:
                        state = 8
                        slot = c + 1
            elif state == 6:
                if bit == 0:
                    nb += 1
                    if nb > 40:
                        return np.empty(0, np.uint8), BAD_WIDTH
                else:
                    v = 1
                    left = nb
                    if left == 0:
                        m = v + _TREE - 1
                        state = 8
                        slot = c + 1
                    else:
                        state = 7
            elif state == 7:
                v = (v << 1) | bit
                left -= 1
                if left == 0:
                    m = v + _TREE - 1
                    state = 8
                    slot = c + 1
            else:
                q = -m if bit else m
                break
        zz = (q << 1) ^ (q >> 63)
        if zz > limit:
            return np.empty(0, np.uint8), BAD_WIDTH
        codes[i] = zz
        total += m
    planes = np.empty(n * w, np.uint8)
    _put_planes(planes, 0, codes, n, w)
    return planes, OK


# ---- Huffman code lengths (the host step of the device-side Huffman coder) ---------------
@njit(cache=True, nogil=True)
def huffman_depths(counts: np.ndarray) -> np.ndarray:
    """Unlimited Huffman code lengths of the symbols with counts > 0 (0 elsewhere).

    Two-queue construction over the counts sorted once: leaves and merged nodes each come
    out in non-decreasing weight, so the two smallest are always at the queue heads."""
    used = np.flatnonzero(counts)
    m = used.size
    depth = np.zeros(counts.size, np.int64)
    if m < 2:
        if m == 1:
            depth[used[0]] = 1
        return depth
    order = used[np.argsort(counts[used], kind="mergesort")]
    w = np.empty(2 * m - 1, np.int64)
    parent = np.zeros(2 * m - 1, np.int64)
    for i in range(m):
        w[i] = counts[order[i]]
    leaf, node, nxt = 0, m, m
    for _ in range(m - 1):
        pick = np.empty(2, np.int64)
        for k in range(2):
            if leaf < m and (node >= nxt or w[leaf] <= w[node]):
                pick[k] = leaf
                leaf += 1
            else:
                pick[k] = node
                node += 1
        w[nxt] = w[pick[0]] + w[pick[1]]
        parent[pick[0]] = nxt
        parent[pick[1]] = nxt
        nxt += 1
    d = np.zeros(2 * m - 1, np.int64)
    for i in range(2 * m - 3, -1, -1):  # the root (last node) has depth 0
        d[i] = d[parent[i]] + 1
    for i in range(m):
        depth[order[i]] = d[i]
    return depth


@njit(cache=True, nogil=True)
def canonical_codes_many(lengths: np.ndarray) -> np.ndarray:
    """(S, 256) code lengths -> (S, 256) canonical codes, bit-reversed (LSB-first streams).

    Codes are handed out in (length, symbol) order, each one more than the last and
    shifted left where the length grows: the canonical assignment (RFC 1951, 3.2.2)."""
    out = np.zeros(lengths.shape, np.int64)
    for s in range(lengths.shape[0]):
        code = 0
        prev = 0
        for ln in range(1, 16):
            for sym in range(lengths.shape[1]):
                if lengths[s, sym] != ln:
                    continue
                code <<= ln - prev
                prev = ln
                r, c = 0, code
                for _ in range(ln):
                    r = (r << 1) | (c & 1)
                    c >>= 1
                out[s, sym] = r
                code += 1
    return out


@njit(cache=True, nogil=True)
def decode_tables(lengths: np.ndarray, codes: np.ndarray, bits: int) -> np.ndarray:
    """(S, 2, 2^bits): the symbol and the code length for every ``bits``-bit window
    (LSB first) of each of S codes: a window starts with exactly one code."""
    out = np.zeros((lengths.shape[0], 2, 1 << bits), np.int64)
    for s in range(lengths.shape[0]):
        for sym in range(lengths.shape[1]):
            ln = lengths[s, sym]
            if ln == 0:
                continue
            for t in range(codes[s, sym], 1 << bits, 1 << ln):
                out[s, 0, t] = sym
                out[s, 1, t] = ln
    return out
