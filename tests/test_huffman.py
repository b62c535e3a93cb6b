"""The device-side entropy stage (canonical Huffman in torch ops) and the format-2 payloads
that the quantizing codecs build on CUDA, run here on CPU tensors: the same code and bytes
(``coder="huffman"`` / ``quant+huffman`` take that path on any device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.codecs import PayloadError, get_codec
from recsz.codecs import huffman as H
from recsz.codecs.devbuf import region_hashes, word_hash
from recsz.codecs.payload import DEVICE_FORMAT


def _ints(values: np.ndarray) -> torch.Tensor:
    """Integers as a (n, 1) float64 tensor: under eb = 0.5 their codes are the values, so
    the byte planes the coder sees are exactly the zig-zagged integers."""
    return torch.from_numpy(values.astype(np.float64)).view(-1, 1)


def _roundtrip_ints(values: np.ndarray) -> None:
    c = get_codec("quant+huffman")
    x = _ints(values)
    p = c.encode(x, 0.5)
    assert int(p[3]) == DEVICE_FORMAT
    assert torch.equal(c.decode(p), x)


@settings(max_examples=60, deadline=None)
@given(
    n=st.sampled_from([1, 2, 7, 4095, 4096, 4097, 9000]),
    scale=st.sampled_from([0.0, 0.3, 3.0, 300.0, 1e5]),
    seed=st.integers(0, 2**16),
)
def test_planes_round_trip(n: int, scale: float, seed: int) -> None:
    """Constant, sparse, dense and raw planes, 1-3 bytes wide, across block boundaries."""
    rng = np.random.default_rng(seed)
    _roundtrip_ints(np.round(rng.laplace(0, scale, n)))


def test_code_lengths_are_limited_and_complete() -> None:
    # Fibonacci counts make the deepest possible tree (23 levels unlimited).
    fib = [1, 1]
    while len(fib) < 24:
        fib.append(fib[-1] + fib[-2])
    counts = np.zeros(256, np.int64)
    counts[:24] = fib
    lengths = H.code_lengths(counts)
    assert lengths.max() <= H.MAX_LEN
    assert H._kraft_ok(lengths)
    _roundtrip_ints(np.repeat(np.arange(24), fib))


def test_code_lengths_are_optimal() -> None:
    """The numba two-queue build matches a heap-built Huffman tree's cost."""
    import heapq

    rng = np.random.default_rng(4)
    for _ in range(100):
        c = rng.integers(0, 1000, 256) * (rng.random(256) < rng.random())
        if (c > 0).sum() < 2:
            continue
        heap = [int(v) for v in c if v > 0]
        heapq.heapify(heap)
        cost = 0
        while len(heap) > 1:
            a, b = heapq.heappop(heap), heapq.heappop(heap)
            cost += a + b
            heapq.heappush(heap, a + b)
        depths = H.huffman_depths(c)
        assert int((depths * c).sum()) == cost


def test_huffman_is_near_entropy_on_skewed_data() -> None:
    rng = np.random.default_rng(0)
    v = np.minimum(np.abs(rng.normal(0, 4, 200_000)).astype(np.int64), 127)
    p = get_codec("quant+huffman").encode(_ints(v), 0.5)
    z = 2 * v  # zig-zag of non-negative codes
    freq = np.bincount(z) / z.size
    h = -(freq[freq > 0] * np.log2(freq[freq > 0])).sum()
    assert 8 * p.numel() / v.size < h + 0.1  # Huffman: within p_max + 0.086 bits of it


def test_uniform_bytes_stay_raw_and_constants_cost_nothing() -> None:
    c = get_codec("quant+huffman")
    v = np.random.default_rng(1).integers(0, 128, 50_000)
    assert c.encode(_ints(v), 0.5).numel() < v.size + 80  # raw plane + header
    assert c.encode(_ints(np.full(10_000, 7)), 0.5).numel() < 80


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


@pytest.mark.parametrize("name", ["hybrid", "quant+huffman", "quant", "quant+lz"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_device_format_round_trip_matches_host_path(name: str, dtype: torch.dtype) -> None:
    """Format-2 payloads decode to exactly what the host path decodes to."""
    x = _hard_input().to(dtype)
    dev = get_codec(name, coder="huffman")
    p = dev.encode(x, 1e-3)
    assert int(p[3]) == DEVICE_FORMAT
    y = dev.decode(p)
    ref = get_codec("hybrid").decode(get_codec("hybrid").encode(x, 1e-3))
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.isnan(), x.isnan())
    inf = x.isinf()
    assert torch.equal(y[inf], x[inf])
    fin = x.isfinite()
    assert float((y[fin].double() - x[fin].double()).abs().max()) <= 1e-3
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(ref))


def test_batch_is_the_same_bytes_as_one_by_one() -> None:
    """Grouping never changes a payload: chunks of several shapes, dtypes, bounds, and
    empty ones, encoded together and alone."""
    c = get_codec("hybrid", coder="huffman")
    g = torch.Generator().manual_seed(9)
    xs = [
        _hard_input(),
        torch.zeros(0, 24),
        torch.randn(3000, 24, generator=g) * 0.01,
        torch.randn(7, 24, generator=g).double(),
        torch.randn(40, 8, generator=g).half(),
        torch.full((50, 24), 0.25),
        torch.randn(5000, 24, generator=g) * 300,  # wide codes
    ]
    ebs = [1e-3, 1e-3, 1e-4, 0.02, 1e-2, 1e-3, 1e-3]
    batch = c.encode_batch(xs, ebs)
    for x, e, p in zip(xs, ebs, batch, strict=True):
        assert torch.equal(p, c.encode(x, e))
    ys = c.decode_batch(batch)
    for x, e, y in zip(xs, ebs, ys, strict=True):
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(c.decode(c.encode(x, e))))
        fin = x.isfinite()
        if fin.any():
            assert float((y[fin].double() - x[fin].double()).abs().max()) <= e
    # Host-path codecs batch by looping: the same payloads as encode.
    h = get_codec("hybrid")
    looped = h.encode_batch(xs, ebs)
    assert all(torch.equal(p, h.encode(x, e)) for x, e, p in zip(xs, ebs, looped, strict=True))
    with pytest.raises(ValueError, match="bounds"):
        c.encode_batch(xs, ebs[:-1])


def test_device_format_shapes_and_bounds() -> None:
    c = get_codec("hybrid", coder="huffman")
    for shape in [(0, 8), (5, 0), (1, 1), (1, 64), (5000, 4)]:
        x = torch.rand(shape) * 2 - 1
        y = c.decode(c.encode(x, 0.01))
        assert y.shape == x.shape
        if x.numel():
            assert float((y - x).abs().max()) <= 0.01
    x = torch.full((100, 8), 0.123)
    assert c.encode(x, 1e-4).numel() < 120  # one literal row + references


def test_device_format_rejects_corruption() -> None:
    c = get_codec("hybrid", coder="huffman")
    p = c.encode(_hard_input(), 1e-3)
    for i in range(0, p.numel(), max(1, p.numel() // 97)):
        t = p.clone()
        t[i] ^= 0x10
        with pytest.raises(PayloadError):
            c.decode(t)
    with pytest.raises(PayloadError):
        c.decode(p[:-1])
    with pytest.raises(PayloadError, match="made by codec"):
        get_codec("quant+huffman").decode(p)
    with pytest.raises(PayloadError):
        c.decode_batch([p, p[:-1]])


def test_forged_checksum_still_rejected_by_structure() -> None:
    """A body damaged *and* re-checksummed must fail on structure or decode to the
    right shape: never crash, never index out of bounds."""
    c = get_codec("hybrid", coder="huffman")
    x = _hard_input()
    p = c.encode(x, 1e-3)
    rng = np.random.default_rng(7)
    errors = 0
    for _ in range(300):
        t = p.clone()
        i = int(rng.integers(8, t.numel()))  # headers, stream tables, metadata and data
        t[i] ^= int(rng.integers(1, 256))
        t[4:8] = word_hash(t[8:])
        try:
            y = c.decode(t)
        except PayloadError:
            errors += 1
            continue
        assert y.shape == x.shape
    assert errors > 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_payload_matches_cpu_device_path(dtype: torch.dtype) -> None:
    """On CUDA the hybrid codec stays on the device and writes the bytes that the CPU
    path of the same format writes (format 3 for float32, 2 otherwise); both decode to
    the same values."""
    x = _hard_input().to(dtype)
    blocks = dtype == torch.float32
    gpu = get_codec("hybrid")
    cpu = get_codec("hybrid", coder="blocks" if blocks else "huffman")
    p = gpu.encode(x.cuda(), 1e-3)
    assert p.is_cuda and int(p[3]) == (3 if blocks else DEVICE_FORMAT)
    # The same configuration on both devices writes the same bytes (the header holds it).
    assert torch.equal(cpu.encode(x.cuda(), 1e-3).cpu(), cpu.encode(x, 1e-3))
    if blocks:
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
