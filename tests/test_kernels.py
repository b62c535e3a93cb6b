"""The fused CPU kernels of the hybrid codecs (float32/float64 on the CPU): against a plain
torch quantizer (tests/reference.py), under any bound, on malformed planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from recsz.codecs import PayloadError, get_codec, kernels
from recsz.codecs.payload import parse_payload
from tests.reference import dequantize, quantize

PIPELINES = ["hybrid", "quant"]


def power_law_rows(n: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(max(n // 4, 1), d, generator=g, dtype=torch.float64) * 0.02
    ids = (torch.rand(n, generator=g) ** 3 * table.shape[0]).long()
    return table[ids].to(dtype).contiguous()


@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (300, 32), (1024, 64)])
def test_kernels_decode_what_the_plain_quantizer_gives(
    name: str, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    """The fused kernels against quantize/dequantize above (the plain torch reference):
    the same reconstruction, value for value, and the same elements sent exactly; or,
    where the codes would take more bytes than the values (one float32), the values."""
    x = power_law_rows(*shape, seed=shape[0], dtype=dtype)
    eb = 0.03 * float(x.max() - x.min()) or 1e-3
    codes, outliers = quantize(x, eb)
    want = dequantize(codes, eb, dtype)
    want.view(-1)[outliers] = x.view(-1)[outliers]
    codec = get_codec(name)
    payload = codec.encode(x, eb)
    stored = parse_payload(payload)[1][0] == 1  # one section: the values, stored
    assert stored == (shape == (1, 1) and dtype == torch.float32)
    y = codec.decode(payload)
    assert torch.equal(y, x if stored else want)
    assert float((y.double() - x.double()).abs().max()) <= eb


@settings(max_examples=120, deadline=None)
@given(
    a=arrays(
        st.sampled_from(["float32", "float64"]),
        st.tuples(st.integers(1, 40), st.integers(1, 12)),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=32),
    ),
    eb=st.floats(1e-30, 1e10),
    repeat=st.booleans(),
    name=st.sampled_from(PIPELINES),
)
def test_fused_path_bound(a: np.ndarray, eb: float, repeat: bool, name: str) -> None:
    """Any values (NaN, Inf, huge, denormal, repeated rows) under any bound."""
    x = torch.from_numpy(a.copy())
    if repeat:
        x = x[torch.arange(x.shape[0]) % 3].contiguous()
    codec = get_codec(name)
    out = codec.decode(codec.encode(x, eb))
    finite = torch.isfinite(x)
    assert torch.equal(torch.isnan(out), torch.isnan(x))
    assert torch.equal(out[~finite & ~torch.isnan(x)], x[~finite & ~torch.isnan(x)])
    err = (out[finite].double() - x[finite].double()).abs()
    assert err.numel() == 0 or float(err.max()) <= eb


def test_values_exactly_between_two_codes_stay_within_bound() -> None:
    eb = 0.1
    x = (torch.arange(-50, 50, dtype=torch.float32) * 0.2 + 0.1).view(10, 10)
    y = get_codec("hybrid").decode(get_codec("hybrid").encode(x, eb))
    assert float((y.double() - x.double()).abs().max()) <= eb


@pytest.mark.parametrize("status", [kernels.BAD_LITERAL_COUNT, kernels.BAD_REFERENCE])
def test_malformed_planes_are_reported(status: int) -> None:
    out = np.empty((3, 2), np.float32)
    step = np.array([0.1], np.float32)
    if status == kernels.BAD_REFERENCE:
        raw = np.array([0, 2, 1, 0, 0], np.uint8)  # row 1 refers to a 2nd literal: none
        got = kernels.decode_rows(raw, 1, 3, 1, 2, out, step)
    else:
        raw = np.array([0, 0, 0, 1, 1], np.uint8)  # three literal rows, one row of codes
        got = kernels.decode_rows(raw, 1, 3, 1, 2, out, step)
    assert got == status


def test_forged_reference_payload_raises_payload_error() -> None:
    """A well-formed payload whose reference points past the literals (crc recomputed)."""
    from recsz.codecs.stages import pack_planes

    codec = get_codec("hybrid")
    planes = np.array([0, 5, 0, 0, 0, 0, 0], np.uint8)  # refs [0, 5, 0], 4 zero codes
    body_core = pack_planes([(1, 3), (1, 4)], planes.tobytes(), None)
    from recsz.codecs.payload import assemble

    def fields(n: int) -> bytes:
        return codec._header_fields(torch.Size([3, 2]), torch.float32, 0.1, n)

    payload = assemble(fields, [body_core, b"", b""])
    with pytest.raises(PayloadError, match="reference"):
        codec.decode(payload)


def test_power_law_references_are_entropy_coded() -> None:
    from recsz.codecs.payload import split_sections

    x = power_law_rows(4096, 16, seed=3)
    payload = get_codec("hybrid").encode(x, 0.03 * float(x.max() - x.min()))
    core = split_sections(parse_payload(payload)[1], 3)[0]
    # stream table: count 2, (width, varint count) x 2, then stream 0's coder
    o = 1
    for _ in range(2):
        o += 1
        while core[o] & 0x80:
            o += 1
        o += 1
    assert core[o] == 1  # zstd-coded references
