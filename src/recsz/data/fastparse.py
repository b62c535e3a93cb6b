"""Criteo lines parsed in compiled code (numba): the lines of a buffer in one pass.

:func:`recsz.data.criteo.parse_line` is the definition; this is its fast path for the
lines every Criteo file is made of: 40 fields, a label ``0`` or ``1`` (or 39, no label:
the test layout), counts of an optional ``-`` and at most 18 digits, categories of 1 to 8
hexadecimal digits, any of the 39 feature fields empty, ``\\n`` or ``\\r\\n`` at the end.
Such a line gives the numbers ``parse_line`` gives (a test compares them on the real
samples and on generated lines); any other line (stripped trailing fields, blank, signs,
spaces, non-ASCII bytes, fields too long, ...) is left to ``parse_line``, which pads it or
names what is wrong with it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

N_DENSE = 13
N_CAT = 26
_TAB, _NL, _CR, _MINUS = 9, 10, 13, 45


def parse_lines(
    buf: np.ndarray, sizes: np.ndarray, labeled: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The lines of ``buf`` (uint8; ``\\n`` ends each, the last may lack it): labels (n,)
    float32, dense (n, 13) float32, ids (n, 26) int64, ``ok`` (n,) bool (False: a line
    this path leaves to ``parse_line``; its numbers are not set) and the lines' starts
    (n + 1,) int64 (the last: ``len(buf)``). ``sizes``: the 26 tables' rows, int64;
    ``labeled`` False: Criteo's test layout (no label field; the labels NaN)."""
    n = int(np.count_nonzero(buf == _NL)) + int(len(buf) > 0 and buf[-1] != _NL)
    labels = np.empty(n, np.float32)
    dense = np.empty((n, N_DENSE), np.float32)
    ids = np.empty((n, N_CAT), np.int64)
    ok = np.empty(n, np.bool_)
    starts = np.empty(n + 1, np.int64)
    _parse(buf, sizes, labeled, labels, dense, ids, ok, starts)
    return labels, dense, ids, ok, starts


@njit(cache=True, nogil=True)
def _parse(buf, sizes, labeled, labels, dense, ids, ok, starts):
    size = len(buf)
    i = 0
    k = 0
    while i < size:
        end = i
        while end < size and buf[end] != _NL:
            end += 1
        starts[k] = i
        ok[k] = _line(buf, i, end, sizes, labeled, labels, dense, ids, k)
        k += 1
        i = end + 1
    starts[k] = size


@njit(cache=True, nogil=True)
def _line(buf, pos, end, sizes, labeled, labels, dense, ids, k):
    if end > pos and buf[end - 1] == _CR:
        end -= 1
    if not labeled:
        labels[k] = np.nan
    elif end - pos < 2 or (buf[pos] != 48 and buf[pos] != 49) or buf[pos + 1] != _TAB:
        return False
    else:
        labels[k] = buf[pos] - 48
        pos += 2
    for j in range(N_DENSE):  # an optional '-', at most 18 digits, then a tab
        neg = pos < end and buf[pos] == _MINUS
        if neg:
            pos += 1
        v = 0
        digits = 0
        while pos < end and buf[pos] != _TAB:
            c = buf[pos]
            if c < 48 or c > 57 or digits == 18:
                return False
            v = v * 10 + (c - 48)
            digits += 1
            pos += 1
        if (neg and digits == 0) or pos >= end:
            return False  # a bare '-', or the line ends before its categories
        dense[k, j] = np.float32(np.log1p(np.float64(v))) if v > 0 and not neg else 0.0
        pos += 1
    for j in range(N_CAT):  # 0 to 8 hexadecimal digits, then a tab (the last: the end)
        h = np.uint64(0)
        digits = 0
        while pos < end and buf[pos] != _TAB:
            c = buf[pos]
            if 48 <= c <= 57:
                d = c - 48
            elif 97 <= c <= 102:
                d = c - 87
            elif 65 <= c <= 70:
                d = c - 55
            else:
                return False
            if digits == 8:
                return False
            h = h * np.uint64(16) + np.uint64(d)
            digits += 1
            pos += 1
        if j < N_CAT - 1:
            if pos >= end:
                return False  # fewer fields: parse_line pads them
            pos += 1
        elif pos != end:
            return False
        if digits == 0:
            ids[k, j] = 0
        else:
            ids[k, j] = 1 + np.int64(_mix32(h) % np.uint64(sizes[j] - 1))
    return True


@njit(cache=True, nogil=True)
def _mix32(h):
    """:func:`recsz.data.criteo._mix32` (murmur3's fmix32) on a uint64 holding 32 bits."""
    m = np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & m
    h ^= h >> np.uint64(16)
    return h
