"""The hybrid codec's stages, each on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from recsz.codecs import PayloadError, kernels
from recsz.codecs.stages import magicless_zstd, pack_planes, unpack_planes
from tests.reference import dequantize, quantize


def pack_streams(streams: list[np.ndarray], cctx: object) -> bytes:
    """Non-negative int streams at their narrowest widths, as pack_planes takes them."""
    dims, planes = [], []
    for z in streams:
        w = kernels.width(int(z.max()) if z.size else 0)
        dims.append((w, int(z.size)))
        planes.append(z.astype(f"<u{w}").view(np.uint8).reshape(z.size, w).T.tobytes())
    return pack_planes(dims, b"".join(planes), cctx)  # type: ignore[arg-type]


def unpack_streams(buf: np.ndarray, *args: object) -> list[np.ndarray]:
    dims, raw = unpack_planes(buf, *args)  # type: ignore[arg-type]
    out, p = [], 0
    for w, n in dims:
        planes = np.ascontiguousarray(raw[p : p + w * n].reshape(w, n).T)
        out.append(planes.view(f"<u{w}").reshape(n).astype(np.int64))
        p += w * n
    return out


@settings(max_examples=80, deadline=None)
@given(
    a=arrays(
        "float32",
        st.tuples(st.integers(1, 30), st.integers(1, 20)),
        elements=st.floats(-1e5, 1e5, width=32),
    ),
    eb=st.floats(1e-8, 10.0),
)
def test_quantize_reconstruction_within_bound_or_outlier(a: np.ndarray, eb: float) -> None:
    x = torch.from_numpy(a.copy())
    codes, out = quantize(x, eb)
    y = dequantize(codes, eb, x.dtype)
    err = (y.double() - x.double()).abs().view(-1)
    ok = torch.ones_like(err, dtype=torch.bool)
    ok[out] = False
    assert bool((err[ok] <= eb).all())
    assert bool((codes.view(-1)[out] == 0).all())


def test_quantize_flags_codes_beyond_float32_integers() -> None:
    x = torch.tensor([[1e9, 0.5]])
    codes, out = quantize(x, 1e-3)  # 1e9 / 2e-3 > 2^24
    assert out.tolist() == [0] and codes[0, 0] == 0


@pytest.mark.parametrize("entropy", [False, True])
def test_pack_streams_roundtrip_and_widths(entropy: bool) -> None:
    cctx, dctx = magicless_zstd(1)
    streams = [
        np.array([0, 1, 255]),
        np.array([70000, 3]),
        np.zeros(0, dtype=np.int64),
        np.array([2**33]),
    ]
    buf = np.frombuffer(pack_streams(streams, cctx if entropy else None), np.uint8)
    back = unpack_streams(buf, 10, dctx)
    assert [b.tolist() for b in back] == [s.tolist() for s in streams]


_CCTX, _DCTX = magicless_zstd(1)


@settings(max_examples=60, deadline=None)
@given(
    streams=st.lists(
        st.lists(st.integers(0, 2**40), max_size=40).map(lambda v: np.array(v, np.int64)),
        min_size=1,
        max_size=3,
    ),
    entropy=st.booleans(),
    cut=st.integers(1, 10_000),
)
def test_streams_roundtrip_and_any_truncation_is_refused(
    streams: list[np.ndarray], entropy: bool, cut: int
) -> None:
    """Any streams come back exactly; a block cut short anywhere raises PayloadError
    (never a wrong answer)."""
    buf = np.frombuffer(pack_streams(streams, _CCTX if entropy else None), np.uint8)
    back = unpack_streams(buf, 64, _DCTX)
    assert [b.tolist() for b in back] == [s.tolist() for s in streams]
    with pytest.raises(PayloadError):
        unpack_streams(buf[: max(0, buf.size - cut)], 64, _DCTX)


def test_unpack_streams_rejects_corruption_and_retired_modes() -> None:
    cctx, dctx = magicless_zstd(1)
    buf = np.frombuffer(pack_streams([np.arange(100) % 7], cctx), np.uint8)
    with pytest.raises(PayloadError):
        unpack_streams(buf[:-3], 100, dctx)
    with pytest.raises(PayloadError, match="count"):
        unpack_streams(buf, 10, dctx)
    old = buf.copy()
    old[3] = 2  # the first stream's coder: the retired range coder
    with pytest.raises(PayloadError, match="unknown integer stream coder 2"):
        unpack_streams(old, 100, dctx)
