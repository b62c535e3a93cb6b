"""Format 2: payloads whose body a codec makes with torch operations on the tensor's
device (the casts on CUDA), its word hash, and what the quantizing codecs send from a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsz.codecs import PayloadError, get_codec
from recsz.codecs.devbuf import region_hashes, word_hash
from recsz.codecs.payload import DEVICE_FORMAT


def test_word_hash_reference_and_sensitivity() -> None:
    rng = np.random.default_rng(3)
    b = rng.integers(0, 256, 1001, dtype=np.uint8)
    # Reference in numpy uint64 arithmetic (wraps by definition).
    padded = np.concatenate([b, np.zeros(3, np.uint8)]).view("<u4").astype(np.uint64)
    i = np.arange(1, padded.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        wts = (i * np.uint64(2**64 - 7046029254386353131) + np.uint64(0x632BE59BD9B4E019)) | 1
        h = (padded * wts).sum(dtype=np.uint64) + np.uint64(b.size)
    fold = int(h ^ (h >> np.uint64(32))) & 0xFFFFFFFF
    t = torch.from_numpy(b)
    got = word_hash(t)
    assert int.from_bytes(got.numpy().tobytes(), "little") == fold
    # The byte-wise form used for batches computes the same sums.
    buf = torch.cat([torch.zeros(8, dtype=torch.uint8), t, torch.zeros(8, dtype=torch.uint8), t])
    seg = region_hashes(buf, [8, 16 + t.numel()], [8 + t.numel(), buf.numel()])
    assert torch.equal(seg[0], got) and torch.equal(seg[1], got)
    for pos in (0, 500, 1000):
        for bit in range(8):
            c = b.copy()
            c[pos] ^= 1 << bit
            assert not torch.equal(word_hash(torch.from_numpy(c)), got)
    assert not torch.equal(word_hash(t[:-1]), got)


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
    ys = gpu.decode_batch(gpu.encode_batch([x.cuda(), x[:5].cuda()], [1e-3, 1e-2]))
    assert torch.equal(torch.nan_to_num(ys[0].cpu()), torch.nan_to_num(y.cpu()))
    t = p.clone()
    t[t.numel() // 2] ^= 4
    with pytest.raises(PayloadError):
        gpu.decode(t)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "fp8", "int8"])
def test_baselines_device_path_decodes_as_the_host_path(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Baselines whose body is torch operations run on the device (CUDA) without host
    copies: forced here on the CPU, their format-2 payloads decode to exactly what the
    host path decodes to, in batches of mixed shapes, and damage is rejected."""
    host = get_codec(name)
    dev = get_codec(name)
    monkeypatch.setattr(dev, "_device_path", lambda x: True)
    g = torch.Generator().manual_seed(11)
    xs = [_hard_input(), torch.zeros(0, 24), torch.randn(33, 8, generator=g).double()]
    ps = dev.encode_batch(xs, [None] * 3)
    assert all(int(p[3]) == DEVICE_FORMAT for p in ps)
    for x, p, y in zip(xs, ps, dev.decode_batch(ps), strict=True):
        ref = host.decode(host.encode(x))
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(ref))
        assert torch.equal(y.isnan(), x.isnan())
        assert torch.equal(torch.nan_to_num(host.decode(p)), torch.nan_to_num(y))  # format 2 too
    t = ps[0].clone()
    t[t.numel() // 2] ^= 1
    with pytest.raises(PayloadError):
        host.decode(t)
    with pytest.raises(PayloadError):
        host.decode_batch([ps[2], ps[0][:-2]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "fp8", "int8"])
def test_baselines_stay_on_cuda(name: str) -> None:
    c = get_codec(name)
    x = _hard_input()
    p = c.encode(x.cuda())
    assert p.is_cuda and int(p[3]) == DEVICE_FORMAT
    y = c.decode(p)
    assert y.is_cuda
    assert torch.equal(torch.nan_to_num(y.cpu()), torch.nan_to_num(c.decode(c.encode(x))))
