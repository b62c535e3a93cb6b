"""The compiled CPU coder of format 3 (recsz.codecs.blockcpu) writes the plain numpy
reference's bytes (tests/blockref.py) and reads any payload as it does: the same rows, or
PayloadError where it refuses one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.codecs import PayloadError, blockcpu
from recsz.codecs import blockformat as bf
from tests import blockref
from tests.blockref import adversarial

DIMS = [1, 2, 3, 7, 16, 31, 32, 33, 64, 100]


def group(seed: int) -> tuple[bf.Layout, np.ndarray, np.ndarray]:
    """A group of adversarial segments (empty ones too) under bounds from the smallest
    normal float32 to beyond the values."""
    rng = np.random.default_rng(seed)
    dim = int(rng.choice(DIMS))
    segs = tuple(int(n) for n in rng.integers(0, 90, rng.integers(1, 6)) * rng.integers(0, 2, 1))
    ebs = 10.0 ** rng.uniform(-38, 2, len(segs)) if rng.random() < 0.2 else None
    if ebs is None:
        ebs = 10.0 ** rng.uniform(-5, 0, len(segs))
    parts = [adversarial(rng, n, dim, e) for n, e in zip(segs, ebs, strict=True)]
    x = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
    return bf.Layout("hybrid", 0, dim, segs, bool(rng.integers(2))), x, ebs


def same_decode(buf: np.ndarray) -> None:
    """Both coders refuse ``buf``, or both give the same layout, rows and bounds."""
    try:
        want = blockref.decode_group(buf)
    except PayloadError:
        with pytest.raises(PayloadError):
            blockcpu.decode_group(buf)
        return
    lay, y, ebs = blockcpu.decode_group(buf)
    assert lay == want[0]
    assert y.tobytes() == want[1].tobytes()  # NaN payloads and -0.0 too
    assert ebs.tobytes() == want[2].tobytes()


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_compiled_coder_writes_and_reads_the_references_bytes(seed: int) -> None:
    lay, x, ebs = group(seed)
    want = blockref.encode_group(lay, x, ebs)
    got = blockcpu.encode_group(lay, x, ebs)
    assert got == want
    same_decode(np.frombuffer(got, np.uint8))


@pytest.mark.parametrize("dim", [1, 33, 64])
@pytest.mark.parametrize("rows", [0, 1, 31, 32, 33, 64 * 32 + 5])
def test_widths_at_every_boundary(dim: int, rows: int) -> None:
    """Codes of every width 0..14 (and wider: raw), in runs that cross the coder's tiles
    of 64 blocks."""
    k = np.arange(rows * dim, dtype=np.int64)
    q = np.where(k % 2, 1, -1) * ((1 << (k // 7 % 16)) - 1)  # |q| of every bit length
    eb = 2.0**-10
    x = (q * 2 * eb).astype(np.float32).reshape(rows, dim)
    lay = bf.Layout("hybrid", 0, dim, (rows,), False)
    got = blockcpu.encode_group(lay, x, np.array([eb]))
    assert got == blockref.encode_group(lay, x, np.array([eb]))
    _, y, _ = blockcpu.decode_group(np.frombuffer(got, np.uint8))
    assert (np.abs(y.astype(np.float64) - x) <= eb).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.data())
def test_damaged_payloads_read_as_the_reference_reads_them(seed: int, data: st.DataObject) -> None:
    """Flipped bits, cut tails and a recomputed checksum (damage the checksum cannot see):
    refused where the reference refuses, else the reference's rows."""
    lay, x, ebs = group(seed)
    buf = bytearray(blockcpu.encode_group(lay, x, ebs))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    if data.draw(st.booleans()) and len(buf) >= 8 and len(buf) % 4 == 0:
        words = np.frombuffer(bytes(buf[8:]), "<u4")
        buf[4:8] = bf.word_hash(words).to_bytes(4, "little")
    same_decode(np.frombuffer(bytes(buf), np.uint8))
