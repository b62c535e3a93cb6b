"""The shared codec battery: every registered codec must pass every check here.

Modelled on numcodecs' tests/common.py: round trip, the bound for bounded codecs,
bit-exactness for lossless ones, config round trip, golden payloads that must keep
decoding, and corrupted or foreign bytes rejected with PayloadError.
"""

from __future__ import annotations

from pathlib import Path

import torch

from recsz.codecs import Codec, PayloadError, decode_payload, get_codec

FIXTURES = Path(__file__).parent / "fixtures"


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
    return p


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
