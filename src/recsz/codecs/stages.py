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
#: Coders of an integer stream: its raw byte planes, or zstd over them (Huffman-coded
#: literals). (Retired: 2, the range coder of row references, 0.15% fewer bytes on id-aware
#: traffic for 4-7% more codec time; 3, hybrid-ac's arithmetic coder; 4, the torch-op
#: Huffman coder of format 2. Until the ninth session a block began with a mode byte, which
#: could say "all raw"; every block is now streams coded one by one.)
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
    laid out byte plane by byte plane, (width, count) in ``dims``), each entropy-coded on
    its own when a (magicless) ``cctx`` is given and that makes it smaller, raw otherwise.

    Byte planes put the (mostly zero) high bytes together, which is what lets an entropy
    coder (zstd's Huffman/FSE stage) spend close to the codes' entropy. Layout: u8 count,
    (u8 width, varint n) per stream, then per stream (u8 coder, varint length, bytes).
    """
    out = bytearray([len(dims)])
    for w, n in dims:
        out.append(w)
        out += uvarint(n)
    buf, p = np.frombuffer(data, np.uint8), 0
    for w, n in dims:
        planes = buf[p : p + w * n]
        p += w * n
        best, coder = planes.tobytes(), PLANES
        if n and cctx is not None:
            z = cctx.compress(planes.data)
            if len(z) < len(best):
                best, coder = z, ZSTD_PLANES
        out.append(coder)
        out += uvarint(len(best))
        out += best
    return bytes(out)


def unpack_planes(
    buf: np.ndarray, max_elems: int, magicless: zstandard.ZstdDecompressor
) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The (width, count) of each stream and their byte planes, entropy-decoded, checked."""
    if buf.size < 1:
        raise PayloadError("truncated integer streams")
    o, dims = 1, []
    for _ in range(int(buf[0])):
        if o >= buf.size:
            raise PayloadError("truncated integer stream table")
        w = int(buf[o])
        n, o = read_uvarint(buf, o + 1)
        if w not in (1, 2, 4, 8) or n > max_elems:
            raise PayloadError(f"bad integer stream header (width {w}, count {n})")
        dims.append((w, n))
    parts: list[np.ndarray] = []
    for w, n in dims:
        if o >= buf.size:
            raise PayloadError("truncated integer stream")
        coder = int(buf[o])
        ln, o = read_uvarint(buf, o + 1)
        if o + ln > buf.size:
            raise PayloadError("integer stream runs past the end of its block")
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
            raise PayloadError(f"unknown integer stream coder {coder}")
        if part.size != w * n:
            raise PayloadError(f"stream holds {part.size} bytes, expected {w * n}")
        parts.append(part)
    if o != buf.size:
        raise PayloadError(f"{buf.size - o} stray bytes after the integer streams")
    return dims, np.concatenate(parts) if len(parts) != 1 else parts[0]
