"""The hybrid codec's last stage on the CPU: integer streams packed as byte planes and
entropy-coded (entropy modes, stream coders); this is where format-1 bytes are made. The
stages before it (quantization, bound check, row deduplication) are fused in the numba
kernels of :mod:`recsz.codecs.kernels`, which tests/test_kernels.py holds to a plain torch
quantizer.
"""

from __future__ import annotations

import numpy as np
import zstandard

from recsz.codecs.payload import PayloadError, read_uvarint, uvarint

# ---- integer packing and entropy coding ------------------------------------------------
#: Entropy modes of an integer-stream block: raw planes, or each stream coded on its own
#: (SPLIT: its own Huffman table). (1, 2: whole-block zstd frames of the first payload
#: generation, retired: payloads never outlive the build that made them.)
RAW, SPLIT = 0, 3
#: Per-stream coders inside a SPLIT block: raw planes or zstd. (Retired: 2, the range coder
#: of row references, 0.15% fewer bytes on id-aware traffic for 4-7% more codec time; 3,
#: hybrid-ac's arithmetic coder; 4, the torch-op Huffman coder of format 2.)
PLANES, ZSTD_PLANES = 0, 1


def magicless_zstd(level: int) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """zstd contexts without the 4-byte frame magic (the block header names the coder)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        level,
        format=zstandard.FORMAT_ZSTD1_MAGICLESS,
        write_content_size=False,
        write_dict_id=False,
    )
    return (
        zstandard.ZstdCompressor(compression_params=params),
        zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS),
    )


def pack_planes(
    dims: list[tuple[int, int]], data: bytes | np.ndarray, cctx: zstandard.ZstdCompressor | None
) -> bytes:
    """Integer streams, given as their byte planes (each stream's ``n`` codes of ``w`` bytes
    laid out byte plane by byte plane, (width, count) in ``dims``), entropy-coded stream by
    stream when a (magicless) ``cctx`` is given, raw otherwise.

    Byte planes put the (mostly zero) high bytes together, which is what lets an entropy
    coder (zstd's Huffman/FSE stage) spend close to the codes' entropy. A stream stays raw
    whenever coding would not make it smaller. Layout: u8 count, (u8 width, varint n) per
    stream, u8 mode, data.
    """
    head = bytearray([len(dims)])
    for w, n in dims:
        head.append(w)
        head += uvarint(n)
    if cctx is None:
        return bytes(head) + bytes([RAW]) + bytes(data)
    return bytes(head) + _pack_split(dims, np.frombuffer(data, np.uint8), cctx)


def _pack_split(
    dims: list[tuple[int, int]], data: np.ndarray, cctx: zstandard.ZstdCompressor
) -> bytes:
    """Each stream as (u8 coder, varint length, bytes), the smallest coding of each."""
    out = bytearray([SPLIT])
    p = 0
    for w, n in dims:
        planes = data[p : p + w * n]
        p += w * n
        best, coder = planes.tobytes(), PLANES
        if n:
            z = cctx.compress(planes.data)
            if len(z) < len(best):
                best, coder = z, ZSTD_PLANES
        out.append(coder)
        out += uvarint(len(best))
        out += best
    return bytes(out)


def _unpack_split(
    buf: np.ndarray,
    o: int,
    dims: list[tuple[int, int]],
    magicless: zstandard.ZstdDecompressor,
) -> np.ndarray:
    parts: list[np.ndarray] = []
    for w, n in dims:
        if o >= buf.size:
            raise PayloadError("truncated stream in a split block")
        coder = int(buf[o])
        ln, o = read_uvarint(buf, o + 1)
        if o + ln > buf.size:
            raise PayloadError("stream runs past the end of a split block")
        chunk = buf[o : o + ln]
        o += ln
        if coder == PLANES:
            part = chunk
        elif coder == ZSTD_PLANES:
            try:
                part = np.frombuffer(
                    magicless.decompress(chunk.data, max_output_size=max(w * n, 1)), np.uint8
                )
            except zstandard.ZstdError as e:
                raise PayloadError(f"entropy-coded stream does not decode: {e}") from None
        else:
            raise PayloadError(f"unknown stream coder {coder} in a split block")
        if part.size != w * n:
            raise PayloadError(f"stream holds {part.size} bytes, expected {w * n}")
        parts.append(part)
    if o != buf.size:
        raise PayloadError(f"{buf.size - o} stray bytes after a split block")
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


def unpack_planes(
    buf: np.ndarray, max_elems: int, magicless: zstandard.ZstdDecompressor
) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The (width, count) of each stream and their byte planes, entropy-decoded, checked."""
    if buf.size < 1:
        raise PayloadError("truncated integer streams")
    count = int(buf[0])
    o = 1
    dims = []
    for _ in range(count):
        if o >= buf.size:
            raise PayloadError("truncated integer stream table")
        w = int(buf[o])
        n, o = read_uvarint(buf, o + 1)
        if w not in (1, 2, 4, 8) or n > max_elems:
            raise PayloadError(f"bad integer stream header (width {w}, count {n})")
        dims.append((w, n))
    if o >= buf.size:
        raise PayloadError("truncated integer stream table")
    mode = int(buf[o])
    if mode == SPLIT:
        return dims, _unpack_split(buf, o + 1, dims, magicless)
    if mode != RAW:
        raise PayloadError(f"unknown integer stream mode {mode}")
    total = sum(w * n for w, n in dims)
    if buf.size - o - 1 != total:
        raise PayloadError(f"integer streams hold {buf.size - o - 1} bytes, expected {total}")
    return dims, buf[o + 1 :]
