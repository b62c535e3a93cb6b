"""The shared codec battery: every registered codec must pass every check here.

Modelled on numcodecs' tests/common.py: round trip, the bound for bounded codecs,
bit-exactness for lossless ones, config round trip, golden payloads that must keep
decoding, and corrupted or foreign bytes rejected with PayloadError.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsz.codecs import Codec, PayloadError, decode_payload, get_codec
from recsz.codecs.payload import BLOCK_FORMAT, version_of

FIXTURES = Path(__file__).parent / "fixtures"
#: A format-1 header's bytes at most, for the shapes tests use (prefix, codec id, config,
#: shape, bound, section table).
STORED_HEADER_BYTES = 64


def check_roundtrip(codec: Codec, x: torch.Tensor, eb: float) -> torch.Tensor:
    """Encode/decode; assert shape, dtype, device, NaN/Inf and the codec's accuracy promise."""
    p = codec.encode(x, eb)
    assert p.dtype == torch.uint8 and p.dim() == 1
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    y2 = decode_payload(p)  # by header alone
    torch.testing.assert_close(y, y2, rtol=0, atol=0, equal_nan=True)
    nonfinite = ~torch.isfinite(x)
    if nonfinite.any():
        assert torch.equal(torch.isnan(y), torch.isnan(x))
        inf = torch.isinf(x)
        assert torch.equal(y[inf], x[inf])
    fin = ~nonfinite
    if codec.lossless:
        assert torch.equal(y[fin], x[fin])
    elif codec.error_bounded:
        err = (y[fin].double() - x[fin].double()).abs()
        if err.numel():
            assert float(err.max()) <= eb, f"{codec.codec_id}: error {float(err.max())} > {eb}"
        oversized = oversized_payload(codec, x, p)
        assert oversized is None, oversized
    return p


def oversized_payload(codec: Codec, x: torch.Tensor, p: torch.Tensor) -> str | None:
    """However tight the bound, a bounded codec's payload holds at most the values stored
    and a header (format 3: and a width nibble a block of 32 values, its raw blocks
    holding the values); not promised by a threshold, DCT's: what it drops stays dropped,
    whatever the size. None when the payload keeps that."""
    stored = x.numel() * x.element_size() + STORED_HEADER_BYTES
    if version_of(p) == BLOCK_FORMAT:
        stored += 192 + (x.numel() + x.shape[0]) // 32
    if codec.error_bounded and not codec.threshold and p.numel() > stored:
        return f"{p.numel()} payload bytes, more than the {stored} of the values stored"
    return None


def check_config_roundtrip(codec: Codec) -> None:
    cfg = codec.get_config()
    again = type(codec).from_config(cfg)
    assert again == codec and again.get_config() == cfg
    assert get_codec(codec.codec_id, **cfg) == codec


def check_corruption(codec: Codec, x: torch.Tensor, eb: float) -> None:
    """Truncation, bit flips anywhere, and foreign bytes never yield a tensor silently."""
    p = codec.encode(x, eb)
    for cut in (0, 1, 5, p.numel() // 2, p.numel() - 1):
        try:
            codec.decode(p[:cut].clone())
        except PayloadError:
            continue
        raise AssertionError(f"{codec.codec_id}: truncation to {cut} bytes was not detected")
    g = torch.Generator().manual_seed(1)
    for pos in torch.randint(0, p.numel(), (20,), generator=g).tolist():
        q = p.clone()
        q[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        try:
            codec.decode(q)
        except PayloadError:
            continue
        raise AssertionError(f"{codec.codec_id}: bit flip at byte {pos} was not detected")
    foreign = torch.frombuffer(bytearray(b"PK\x03\x04" + bytes(100)), dtype=torch.uint8)
    try:
        codec.decode(foreign)
    except PayloadError:
        pass
    else:
        raise AssertionError("foreign bytes decoded")


def golden_input() -> torch.Tensor:
    """A fixed input for golden payloads: rows repeat, values span signs and scales."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(24, 8, generator=g) * 0.1
    x[5] = x[2]
    x[17] = x[2]
    x[3, 3] = 7.5
    return x


# ---- extreme bounds and values: every codec, every dtype ---------------------------------
BATTERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Bounds at the edges: float32 subnormals, the smallest normal, near float32 overflow.
EDGE_BOUNDS = (1e-45, 1e-42, 1e-39, 1.1754944e-38, 1e-30, 1e-8, 1.0, 1e30, 1e38, 1.7e38, 3.4e38)


def extreme_case(rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    """A random small tensor of a random dtype, with values from subnormal to its largest
    finite magnitude (and some NaN/Inf), and a bound from 1e-45 to 3.4e38."""
    dtype = BATTERY_DTYPES[int(rng.integers(len(BATTERY_DTYPES)))]
    big = float(torch.finfo(dtype).max)
    shape = (int(rng.integers(0, 6)), int(rng.integers(1, 9)))
    scale = 10.0 ** rng.uniform(-45, 39)
    a = np.clip(rng.standard_normal(shape) * scale, -big, big)
    specials = np.array([0.0, -0.0, big, -big, 1e-45, 1e-40, np.nan, np.inf, -np.inf, 1.0])
    mask = rng.random(shape) < 0.2
    a[mask] = rng.choice(specials, size=int(mask.sum()))
    if rng.random() < 0.3:
        eb = float(rng.choice(EDGE_BOUNDS))
    else:
        eb = float(10.0 ** rng.uniform(-45.5, 38.5))
    return torch.from_numpy(a).to(dtype), eb


def bound_violation(codec: Codec, x: torch.Tensor, eb: float) -> str | None:
    """None when ``codec`` keeps its promise on (x, eb) (or refuses the bound stating the
    range it accepts; a bounded codec also its size, :func:`oversized_payload`); otherwise
    what went wrong. Unbounded codecs must keep finite values finite."""
    try:
        p = codec.encode(x, eb)
        y = codec.decode(p)
    except ValueError as e:
        if codec.error_bounded and "accept" in str(e):
            return None
        return f"{type(e).__name__}: {e}"
    fin = torch.isfinite(x)
    inf = torch.isinf(x)
    if not torch.equal(torch.isnan(y), torch.isnan(x)) or not torch.equal(y[inf], x[inf]):
        return "non-finite values changed"
    if codec.error_bounded:
        err = (y[fin].double() - x[fin].double()).abs()
        if err.numel() and not float(err.max()) <= eb:
            return f"error {float(err.max())} > bound {eb}"
        return oversized_payload(codec, x, p)
    elif not bool(torch.isfinite(y[fin]).all()):
        return "finite values decoded as Inf or NaN"
    return None


def run_without_host_sync(step: Callable[[int], None], warm: int = 4) -> None:
    """step(0..warm-1) (kernels compile, caches fill, graphs are captured), then step(warm)
    under torch's sync debug mode "error": any host synchronization raises."""
    import warnings

    for k in range(warm):
        step(k)
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # "a prototype feature" (torch warns on every use)
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        step(warm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def trainer_parts(
    codec: str, device: str, ids: bool = False, extra: tuple[str, ...] = ()
) -> tuple[Any, Any]:
    """The trainer's parts (tiny preset, dual bounds probed over 2 steps every 10, decaying
    every 8 steps; fixed-size traffic, or with ``ids`` id-aware; ``extra`` flags) and its
    ranks, one process."""
    from recsz.config import parse_train_args
    from recsz.ranks import Ranks
    from recsz.step import build_parts

    traffic = [] if ids else ["--no-id-dedup", "--no-bwd-coalesce"]
    argv = ["--preset", "tiny", "--device", device, *traffic,
            "--fwd-codec", codec, "--bwd-codec", codec, "--eb-policy", "dual",
            "--hindex-probe-steps", "2", "--hindex-every", "10", "--decay-t", "80",
            "--emb-optimizer", "rowwise_adagrad", *extra]  # fmt: skip
    cfg = parse_train_args(argv)
    ranks = Ranks.from_env(60.0, device)
    return build_parts(cfg, ranks)[0], ranks


def check_part(source: Any, step: int, n: int, part: Any) -> None:
    """A rank's part of a source's global batch (:class:`recsz.data.source.Part`) holds
    the batch's own values wherever the part names them: every value of its samples, its
    tables' ids of every sample; a source may leave the rest 0, and nothing else."""
    whole, got = source.train_batch(step, n), source.train_batch(step, n, part)
    mine = np.zeros(n, bool)
    mine[part.rows(n)] = True
    named = mine[:, None] | np.isin(np.arange(whole.ids.shape[1]), part.tables)[None, :]
    ids, want = got.ids.numpy(), whole.ids.numpy()
    np.testing.assert_array_equal(ids[named], want[named])
    assert ((ids == want) | (ids == 0))[~named].all()
    for a, b in ((got.dense, whole.dense), (got.labels, whole.labels)):
        assert torch.equal(a[mine], b[mine])
        assert ((a == b) | (a == 0))[~mine].all()
