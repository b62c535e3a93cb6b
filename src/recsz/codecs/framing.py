"""Several payloads in one buffer, and groups of tables coded as framed chunks.

``frame`` puts byte tensors after a table of their lengths so that ``unframe`` can split
them again. :func:`encode_groups` / :func:`decode_groups` are what a codec without a
group format of its own does with a group of tables (:meth:`Codec.encode_segments`): a
chunk per table under its own bound, framed into one payload per group (a ``joinable``
codec codes a whole group as one chunk, which is the group's payload as it is).
"""

from __future__ import annotations

import itertools
import struct
from typing import TYPE_CHECKING

import numpy as np
import torch

from recsz.codecs.payload import PayloadError, upload

if TYPE_CHECKING:
    from recsz.codecs.base import Codec

_COUNT = struct.Struct("<I")


def frame(parts: list[torch.Tensor]) -> torch.Tensor:
    """Byte tensors preceded by a table of their lengths, as one buffer."""
    lens = [int(p.numel()) for p in parts]
    head = _COUNT.pack(len(parts)) + struct.pack(f"<{len(parts)}Q", *lens)
    dev = parts[0].device if parts else torch.device("cpu")
    head_t = upload(bytearray(head), torch.uint8, dev)
    return torch.cat([head_t, *[p.view(-1).to(dev) for p in parts]])


def unframe(buf: torch.Tensor, expected: int | None, source: str) -> list[torch.Tensor]:
    """Split a framed buffer (``expected`` parts, or as many as it says); ``source``
    names the sender in any error."""
    if expected is not None:
        return unframe_all([buf], [expected], [source])[0]
    raw = buf[: _COUNT.size].cpu().numpy()
    n = _COUNT.unpack_from(raw.data, 0)[0] if raw.size >= _COUNT.size else 0
    return _split(buf, buf[: _COUNT.size + 8 * n].cpu().numpy(), n, source)


def unframe_all(
    bufs: list[torch.Tensor],
    expected: list[int],
    sources: list[str],
    first: list[int] | None = None,
) -> list[list[torch.Tensor]]:
    """:func:`unframe` of each buffer (``expected[i]`` parts, from ``sources[i]``), their
    tables of lengths read to the host at once (on a GPU: one wait, not one a buffer).
    ``first[i]``: buffer i's first part is that many bytes, read along and given on the
    host (a PayloadError where its table says otherwise)."""
    lead = first or [0] * len(bufs)
    spans = [
        min(b.numel(), _COUNT.size + 8 * n + f)
        for b, n, f in zip(bufs, expected, lead, strict=True)
    ]
    heads = [b[:s] for b, s in zip(bufs, spans, strict=True)]
    raw = torch.cat(heads).cpu().numpy() if heads else np.empty(0, np.uint8)
    out, at = [], 0
    for b, s, n, f, src in zip(bufs, spans, expected, lead, sources, strict=True):
        table = _COUNT.size + 8 * n
        parts = _split(b, raw[at : at + min(s, table)], n, src)
        if first is not None:
            if not parts or parts[0].numel() != f:
                got = parts[0].numel() if parts else "no"
                raise PayloadError(f"{src}: its first part is {got} bytes, expected {f}")
            parts[0] = torch.from_numpy(raw[at + table : at + s].copy())
        out.append(parts)
        at += s
    return out


def _split(buf: torch.Tensor, raw: np.ndarray, expected: int, source: str) -> list[torch.Tensor]:
    """``buf``'s parts by its table of lengths, ``raw`` (read on the host)."""
    if raw.size < _COUNT.size:
        raise PayloadError(f"{source}: framed buffer of {raw.size} bytes is truncated")
    (n,) = _COUNT.unpack_from(raw.data, 0)
    if n != expected:
        raise PayloadError(f"{source}: sent {n} chunks, expected {expected} (plans disagree?)")
    if raw.size < _COUNT.size + 8 * n:
        raise PayloadError(f"{source}: framed buffer of {buf.numel()} bytes is truncated")
    lens = struct.unpack_from(f"<{n}Q", raw.data, _COUNT.size)
    o = _COUNT.size + 8 * n
    if o + sum(lens) != buf.numel():
        raise PayloadError(
            f"{source}: chunk lengths do not add up to the {buf.numel()} bytes received"
        )
    out = []
    for ln in lens:
        out.append(buf[o : o + ln])
        o += ln
    return out


def encode_groups(
    codec: Codec, groups: list[tuple[torch.Tensor, list[int]]], ebs: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One framed payload per group and their lengths: a chunk per table (its bound from
    ``ebs``), or per group for a ``joinable`` codec."""
    bounds = ebs.tolist() if ebs is not None else None
    xs: list[torch.Tensor] = []
    per_chunk: list[float | None] = []
    counts, k = [], 0
    for rows, sizes in groups:
        if codec.joinable:
            xs.append(rows.contiguous())
            per_chunk.append(None)
            counts.append(1)
        else:
            xs += list(rows.split(sizes))
            per_chunk += bounds[k : k + len(sizes)] if bounds is not None else [None] * len(sizes)
            counts.append(len(sizes))
        k += len(sizes)
    payloads = [codec.encode(x, e) for x, e in zip(xs, per_chunk, strict=True)]
    if codec.joinable:  # one chunk a group, self-describing: no frame (no copy)
        out = payloads
    else:
        ends = itertools.accumulate(counts)
        out = [frame(payloads[i - n : i]) for n, i in zip(counts, ends, strict=True)]
    return out, torch.tensor([p.numel() for p in out], dtype=torch.int64)


def decode_groups(
    codec: Codec, payloads: list[torch.Tensor], sizes: list[list[int]] | None, dim: int
) -> list[torch.Tensor]:
    """The rows of each framed group payload (checked against ``sizes`` x ``dim`` when
    given)."""
    chunks: list[torch.Tensor] = []
    counts = []
    for i, p in enumerate(payloads):
        n = None if sizes is None else len(sizes[i])
        parts = [p] if codec.joinable else unframe(p, n, f"payload {i}")
        chunks += parts
        counts.append(len(parts))
    decoded = []
    owners = [i for i, n in enumerate(counts) for _ in range(n)]  # each chunk's payload
    for i, c in zip(owners, chunks, strict=True):
        try:
            decoded.append(codec.decode(c))
        except PayloadError as e:
            raise PayloadError(f"payload {i}: {e}") from e
    out, k = [], 0
    for i, n in enumerate(counts):
        mine = decoded[k : k + n]
        k += n
        if sizes is not None and not codec.joinable:
            for t, (y, rows) in enumerate(zip(mine, sizes[i], strict=True)):
                if tuple(y.shape) != (rows, dim):
                    raise PayloadError(
                        f"payload {i}: table {t} of the group decodes to {tuple(y.shape)}, "
                        f"expected {(rows, dim)}"
                    )
        dev = payloads[i].device
        out.append(
            mine[0]
            if len(mine) == 1
            else torch.cat(mine)
            if mine
            else torch.empty(0, dim, device=dev)
        )
    return out
