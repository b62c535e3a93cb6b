"""Format 4 (the casts' bodies made on a device, no host sync) and what every codec sends
from a GPU: run here on CPU tensors with the device path forced, the same code and bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.codecs import Codec, PayloadError, decode_payload, get_codec
from recsz.codecs.base import saturating_cast
from recsz.codecs.payload import CAST_FORMAT, FORMAT_VERSION

CASTS = ["none", "fp16", "bf16"]


def _hard_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(500, 24, generator=g) * 0.05
    x[::4] = x[1]  # popular rows: the refs stream
    x[3, 2], x[4, 1], x[6, 0] = float("nan"), float("inf"), 1e30
    return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_payload_matches_the_cpu_one(dtype: torch.dtype) -> None:
    """On a GPU the hybrid codec writes the bytes the CPU writes for the same format:
    format 3 for float32 (the CPU's ``coder="blocks"``), format 1 for the other dtypes
    (coded on the host); both decode to the same values."""
    x = _hard_input().to(dtype)
    blocks = dtype == torch.float32
    gpu = get_codec("hybrid")
    cpu = get_codec("hybrid", coder="blocks" if blocks else "auto")
    p = gpu.encode(x.cuda(), 1e-3)
    assert p.is_cuda and int(p[3]) == (3 if blocks else 1)
    assert torch.equal(p.cpu(), cpu.encode(x, 1e-3))
    y = gpu.decode(p)
    assert y.is_cuda
    assert torch.equal(torch.nan_to_num(y.cpu()), torch.nan_to_num(cpu.decode(p.cpu())))
    t = p.clone()
    t[t.numel() // 2] ^= 4
    with pytest.raises(PayloadError):
        gpu.decode(t)


def on_device(name: str, monkeypatch: pytest.MonkeyPatch) -> Codec:
    """The codec as it behaves on a GPU, run on the CPU."""
    c = get_codec(name)
    monkeypatch.setattr(c, "segments_on", lambda device: c.cast_width(torch.float32) is not None)
    return c


@pytest.mark.parametrize("name", [*CASTS, "fp8", "int8"])
def test_device_path_decodes_as_the_host_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Casts that keep NaN/Inf in their bodies write format 4; the others code on the host
    (format 1). Either way the values are the host path's, NaN/Inf exact."""
    host, dev = get_codec(name), on_device(name, monkeypatch)
    g = torch.Generator().manual_seed(11)
    xs = [_hard_input(), torch.zeros(0, 24), torch.randn(33, 8, generator=g)]
    ps = [dev.encode(x) for x in xs]
    fmt = CAST_FORMAT if name in CASTS else FORMAT_VERSION
    assert all(int(p[3]) == fmt for p in ps)
    for x, p, y in zip(xs, ps, [dev.decode(p) for p in ps], strict=True):
        ref = host.decode(host.encode(x))
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(ref))
        assert torch.equal(y.isnan(), x.isnan()) and torch.equal(y[x.isinf()], x[x.isinf()])
        assert torch.equal(torch.nan_to_num(decode_payload(p)), torch.nan_to_num(y))


@pytest.mark.parametrize("name", CASTS)
def test_groups_of_tables_round_trip_and_damage_is_rejected(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = on_device(name, monkeypatch)
    x = _hard_input()
    groups = [(x[:300], [100, 200]), (x[300:], [150, 50]), (x[:0], [])]
    payloads, used = c.encode_segments(groups, None)
    assert used.tolist() == [p.numel() for p in payloads]
    got = c.decode_segments(payloads, [[100, 200], [150, 50], []], 24)
    for (rows, _), y in zip(groups, got, strict=True):
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(get_codec(name).decode(
            get_codec(name).encode(rows))))  # fmt: skip
    p = payloads[0]
    for at in range(0, p.numel(), max(1, p.numel() // 37)):
        bad = p.clone()
        bad[at] ^= 1 << (at % 8)
        with pytest.raises(PayloadError):
            c.decode_segments([bad], [[100, 200]], 24)
        with pytest.raises(PayloadError):
            c.decode(bad)
    with pytest.raises(PayloadError):
        c.decode_segments([p[:-4]], [[100, 200]], 24)
    with pytest.raises(PayloadError, match="made by codec"):
        get_codec("bf16" if name != "bf16" else "fp16").decode(p)


def test_saturating_cast_keeps_infinities_and_nan() -> None:
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e6, -1e6, 1.5])
    y = saturating_cast(x, torch.float16)
    assert y[0] == float("inf") and y[1] == -float("inf") and bool(y[2].isnan())
    assert y[3:].tolist() == [65504.0, -65504.0, 1.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", [*CASTS, "fp8", "int8"])
def test_baselines_on_cuda(name: str) -> None:
    """Casts stay on the GPU (format 4, the CPU's bytes); fp8/int8 code on the host."""
    c = get_codec(name)
    x = _hard_input()
    p = c.encode(x.cuda())
    assert p.is_cuda and int(p[3]) == (CAST_FORMAT if name in CASTS else FORMAT_VERSION)
    y = c.decode(p)
    assert y.is_cuda
    assert torch.equal(torch.nan_to_num(y.cpu()), torch.nan_to_num(c.decode(p.cpu())))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_the_span_sum_kernel_equals_the_torch_checksum(lens: list[int], seed: int) -> None:
    """Format 4's checksum on a GPU (one Triton launch, run here under the interpreter)
    gives the torch sums, spans longer than a program and empty ones included."""
    import triton

    from recsz.codecs import blockplan as bp
    from recsz.codecs.blockkernels import word_sum_kernel

    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (sum(lens) + 7,), dtype=torch.int64, generator=g)
    words = words.to(torch.int32)
    first = torch.tensor([3 + sum(lens[:i]) for i in range(len(lens))])
    n = torch.tensor(lens)
    want = bp.span_sums(words, first, n, max(lens))  # the torch path on the CPU
    got = torch.zeros(len(lens), dtype=torch.int32)
    if max(lens):
        grid = (triton.cdiv(max(lens), bp.SUM_CHUNK), len(lens))
        word_sum_kernel[grid](words, first, n, got, CHUNK=bp.SUM_CHUNK)
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)
