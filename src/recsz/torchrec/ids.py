"""TorchRec's input dist with the ids and bag lengths bit-packed: lossless, fewer bytes.

TorchRec's input dist (``KJTAllToAll``) sends each destination the bag lengths and the ids
of its features as they are, int32 or int64. After the pooled embeddings are compressed
these ids are most of what is left on the link (MLPerf's multi-hot bags: 214 ids a
sample). A feature's ids lie in ``[lo, hi]``, a table's rows, so each needs
``bits(hi - lo)`` bits (frame of reference, then bit packing): a table of 50k rows 16 bits
where int32 spends 32, a table of 40M rows 26 bits where int64 spends 64; a length needs
``bits(longest bag)``.

TorchRec's all-to-all sends what its input KJT's ``dist_tensors`` gives, sized by
``dist_splits``, and builds the received KJT with ``type(input).dist_init`` (both its
eager ``KJTAllToAll`` and the pipeline's fused-splits forward do), so
:class:`PackedIdsKJT`, a KJT whose three methods pack and unpack, is all it takes: the
sharder's forward pre-hook on each sharding's ``KJTAllToAll`` (:class:`IdsPacker`) hands it
the KJT as this class. What travels, per destination: a byte buffer (for each of its
features: the lengths' segment, then the ids' segment, each bit-packed and zero-padded to a
multiple of 4 bytes) and a table of int64: the dtypes, then 6 per feature (``META``). The
receiver reads the
tables at once (one host read), checks every feature's checksum and lengths in a second,
and unpacks (the bytes, their order and the KJT built are TorchRec's: lossless, tested
against TorchRec's own all-to-all). Weighted features and a variable batch per feature
travel as TorchRec sends them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from recsz.codecs import blockplan as bp
from recsz.codecs.checks import verdict
from recsz.codecs.payload import PayloadError

#: A feature's row of the table sent beside the bytes: the ids' offset (lo), their width in
#: bits and count, the lengths' width and count (the batch), the checksum of the feature's
#: bytes (as formats 3 and 4 sum words). Each destination's table starts with the dtypes
#: (bit 0: ids int64, bit 1: lengths int64).
META = ("lo", "width", "count", "lengths_width", "rows", "checksum")
_M = len(META)
_RAW = 64  # ids whose range does not fit a shifted 8-byte window go as their 8 bytes
_WINDOW = 56  # the widest packed field that one 8-byte window holds at any bit offset


def _seg_bytes(n: Any, w: Any) -> Any:
    """Bytes of a segment of ``n`` values ``w`` bits wide, zero-padded to a multiple of 4
    (tensors or numpy arrays alike)."""
    return ((n * w + 7) // 8 + 3) // 4 * 4


def _widths(span: torch.Tensor) -> torch.Tensor:
    """Bits of the offsets 0..span (0: one value), on the device; wider than a window
    (or a span past int64, which wraps negative): 64, the values' 8 bytes as they are."""
    bits = (span.unsqueeze(1) >> torch.arange(64, device=span.device)).ne(0).sum(1)
    return torch.where((bits > _WINDOW) | (span < 0), _RAW, bits)


def _spans(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each feature row's first byte, its lengths' bytes (its ids follow them) and all its
    bytes, on the device, from a table (features, ``_M``)."""
    lb = _seg_bytes(m[:, 4], m[:, 3])
    kb = lb + _seg_bytes(m[:, 2], m[:, 1])
    return torch.cumsum(kb, 0) - kb, lb, kb


def _segments(
    at: torch.Tensor, n: torch.Tensor, lo: torch.Tensor, w: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per value of segments (first byte ``at``, ``n`` values of ``w`` bits, offset ``lo``),
    ``total`` in all: its bit position, width mask, offset, and segment."""
    seg = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n, output_size=total)
    j = torch.arange(total, device=n.device) - (torch.cumsum(n, 0) - n)[seg]
    bit = at[seg] * 8 + j * w[seg]
    ones = torch.ones_like(w)
    mask = torch.where(w >= _RAW, -ones, torch.bitwise_left_shift(ones, w.clamp(max=62)) - 1)
    return bit, mask[seg], lo[seg], seg


def pack(q: torch.Tensor, bit: torch.Tensor, nbytes: int, widest: int) -> torch.Tensor:
    """``nbytes`` bytes holding each value of ``q`` (non-negative offsets, or raw 8-byte
    values) at bit ``bit`` (little endian; fields do not overlap: their bytes add up)."""
    out = torch.zeros(nbytes + 8, dtype=torch.int64, device=q.device)  # 8: the windows' slack
    word, first = q << (bit % 8), bit // 8
    for t in range(min(8, -(-(widest + 7) // 8))):
        out.index_add_(0, first + t, (word >> (8 * t)) & 0xFF)
    return out[:nbytes].to(torch.uint8)


def unpack(buf: torch.Tensor, bit: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fields at ``bit`` of ``buf`` (int64; ``mask``: each one's width)."""
    ints = torch.cat([buf, buf.new_zeros(8)]).to(torch.int64)
    first = bit // 8
    word = ints[first]
    for t in range(1, 8):
        word = word | (ints[first + t] << (8 * t))
    return (word >> (bit % 8)) & mask


def _sums(buf: torch.Tensor, at: torch.Tensor, nbytes: torch.Tensor, longest: int) -> torch.Tensor:
    """Each span's checksum (formats 3 and 4's: its words, weighted)."""
    return bp.span_sums(buf.view(torch.int32), at // 4, nbytes // 4, longest // 4)


class PackedIdsKJT(KeyedJaggedTensor):
    """A KeyedJaggedTensor whose all-to-all sends bit-packed lengths and ids (module
    docstring). Made by :meth:`of`; the received KJT is TorchRec's own class."""

    recsz_counter: dict[str, int] | None = None
    recsz_rank = 0

    @classmethod
    def of(
        cls, kjt: KeyedJaggedTensor, counter: dict[str, int] | None = None, rank: int = 0
    ) -> Any:
        """``kjt`` as this class (the same tensors), or None where TorchRec's own sending
        is kept (weights, a variable batch per feature). ``counter``: bytes ``raw`` (as
        TorchRec sends them) and ``wire`` (packed) that left ``rank`` for others add up there."""
        if kjt.weights_or_none() is not None or kjt.variable_stride_per_key():
            return None
        out = cls(
            keys=kjt.keys(),
            values=kjt.values(),
            lengths=kjt.lengths(),
            offsets=kjt.offsets_or_none(),
            stride=kjt.stride(),
        )
        out.recsz_counter, out.recsz_rank = counter, rank
        return out

    def dist_labels(self) -> list[str]:
        return ["recsz_ids", "recsz_ids_meta"]

    def dist_splits(self, key_splits: list[int]) -> list[list[int]]:
        sizes = self._packed(tuple(key_splits))[2]
        return [sizes, [1 + k * _M for k in key_splits]]

    def dist_tensors(self) -> list[torch.Tensor]:
        return list(self._packed(None)[:2])

    def _packed(
        self, key_splits: tuple[int, ...] | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(bytes, table, bytes per destination), made once: one host read (the table)."""
        cached = self.__dict__.get("_recsz_packed")
        if cached is not None:
            return cached
        assert key_splits is not None, "dist_splits comes first"
        f, rows, dev = len(self.keys()), self.stride(), self.device()
        lengths, values = self.lengths(), self.values()
        lens = lengths.view(f, rows).to(torch.int64)
        ids = values.to(torch.int64)
        count = lens.sum(1)
        key_of = torch.repeat_interleave(
            torch.arange(f, device=dev), count, output_size=ids.numel()
        )
        big = torch.iinfo(torch.int64)
        lo = torch.full((f,), big.max, device=dev).scatter_reduce(0, key_of, ids, "amin")
        hi = torch.full((f,), big.min, device=dev).scatter_reduce(0, key_of, ids, "amax")
        lo, hi = torch.where(count > 0, lo, 0), torch.where(count > 0, hi, 0)
        width = _widths(hi - lo)
        lo = torch.where(width == _RAW, 0, lo)
        longest = lens.amax(1) if rows else torch.zeros_like(count)
        dtypes = int(values.dtype == torch.int64) | 2 * int(lengths.dtype == torch.int64)
        m = torch.stack(
            [lo, width, count, _widths(longest), torch.full_like(count, rows),
             torch.zeros_like(count)], 1
        )  # fmt: skip
        table = np.array(m.tolist(), dtype=np.int64).reshape(f, _M)  # the one host read
        lb = _seg_bytes(table[:, 4], table[:, 3])
        kb = lb + _seg_bytes(table[:, 2], table[:, 1])
        ends = np.cumsum(kb)
        at, lb_t, kb_t = _spans(m)
        n_l, n_v = f * rows, ids.numel()
        # every feature's lengths, then its ids, one after another (the bytes' order)
        pieces = [x for k, v in enumerate(ids.split(table[:, 2].tolist())) for x in (lens[k], v)]
        q = torch.cat([ids.new_zeros(0), *pieces])
        segs = torch.stack([at, at + lb_t], 1).reshape(-1)
        n = torch.stack([torch.full_like(count, rows), count], 1).reshape(-1)
        w = torch.stack([m[:, 3], width], 1).reshape(-1)
        off = torch.stack([torch.zeros_like(lo), lo], 1).reshape(-1)
        bit, _, base, _ = _segments(segs, n, off, w, n_l + n_v)
        total = int(ends[-1]) if f else 0
        widest = int(table[:, [1, 3]].max()) if f else 0
        buf = pack(q - base, bit, total, widest)
        m[:, 5] = _sums(buf, at, kb_t, int(kb.max()) if f else 0)
        cuts = np.concatenate([[0], np.cumsum(key_splits)])
        sizes = [int(kb[cuts[r] : cuts[r + 1]].sum()) for r in range(len(key_splits))]
        if self.recsz_counter is not None:
            each = values.element_size() * table[:, 2] + lengths.element_size() * rows
            for r in range(len(key_splits)):
                if r != self.recsz_rank:
                    ks = slice(cuts[r], cuts[r + 1])
                    self.recsz_counter["raw"] += int(each[ks].sum())
                    self.recsz_counter["wire"] += sizes[r] + 8 + _M * 8 * (cuts[r + 1] - cuts[r])
        head = torch.full((1,), dtypes, dtype=torch.int64, device=dev)
        tables = [
            torch.cat([head, m[cuts[r] : cuts[r + 1]].reshape(-1)]) for r in range(len(sizes))
        ]
        self.__dict__["_recsz_packed"] = (buf, torch.cat(tables), sizes)
        return self.__dict__["_recsz_packed"]

    @staticmethod
    def dist_init(
        keys: list[str],
        tensors: list[torch.Tensor],
        variable_stride_per_key: bool,
        num_workers: int,
        recat: torch.Tensor | None,
        stride_per_rank: list[int] | None,
        stagger: int = 1,
    ) -> KeyedJaggedTensor:
        buf, meta = tensors
        assert stride_per_rank is not None and not variable_stride_per_key
        f = len(keys)
        if meta.numel() != num_workers * (1 + f * _M):
            raise PayloadError(
                f"ids: a table of {meta.numel()} words received, {num_workers} ranks x "
                f"{f} features expected"
            )
        m = meta.view(num_workers, 1 + f * _M)[:, 1:].reshape(-1, _M)
        whole = np.array(meta.tolist(), dtype=np.int64).reshape(num_workers, -1)  # one read
        table, dtypes = whole[:, 1:].reshape(-1, _M), set(whole[:, 0].tolist())
        if len(dtypes) != 1 or not dtypes <= {0, 1, 2, 3}:
            raise PayloadError(f"ids: dtypes {sorted(dtypes)} from the {num_workers} ranks")

        def where(i: int) -> str:
            return f"ids from rank {i // f}, feature {keys[i % f]}"

        for i, (_, w, n, lw, rows, _) in enumerate(table.tolist()):
            if not all(0 <= x <= _WINDOW or x == _RAW for x in (w, lw)) or n < 0:
                raise PayloadError(f"{where(i)}: widths {w}, {lw} or count {n} impossible")
            if rows != stride_per_rank[i // f]:
                raise PayloadError(
                    f"{where(i)}: {rows} bags, TorchRec says {stride_per_rank[i // f]}"
                )
        lb = _seg_bytes(table[:, 4], table[:, 3])
        kb = lb + _seg_bytes(table[:, 2], table[:, 1])
        if int(kb.sum()) != buf.numel():
            raise PayloadError(f"ids: {buf.numel()} bytes received, the tables say {int(kb.sum())}")
        at, lb_t, kb_t = _spans(m)
        n_l, n_v = int(table[:, 4].sum()), int(table[:, 2].sum())
        bit, mask, _, key = _segments(at, m[:, 4], torch.zeros_like(at), m[:, 3], n_l)
        lengths = unpack(buf, bit, mask)
        bit, mask, lo, _ = _segments(at + lb_t, m[:, 2], m[:, 0], m[:, 1], n_v)
        values = unpack(buf, bit, mask) + lo
        sums = _sums(buf, at, kb_t, int(kb.max()) if f else 0)
        summed = torch.zeros_like(m[:, 2]).index_add_(0, key, lengths)
        ok = (sums == m[:, 5]) & (summed == m[:, 2])
        verdict(ok, lambda i: f"{where(i)}: damaged (checksum or lengths)")
        code = dtypes.pop()
        lengths = lengths.to(torch.int64 if code & 2 else torch.int32)
        values = values.to(torch.int64 if code & 1 else torch.int32)
        return KeyedJaggedTensor.dist_init(
            keys, [lengths, values], False, num_workers, recat, stride_per_rank, stagger
        )


class IdsPacker:
    """A forward pre-hook for TorchRec's ``KJTAllToAll``: the KJT it sends as a
    :class:`PackedIdsKJT`, the bytes of training steps counted in ``raw`` and ``wire``."""

    def __init__(self) -> None:
        self.counter = {"raw": 0, "wire": 0}

    def __call__(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if module._pg.size() == 1:
            return None
        # counted in training only (evaluation runs under no_grad, which the all-to-all's
        # own no_grad hides from the KJT)
        counter = self.counter if torch.is_grad_enabled() else None
        packed = PackedIdsKJT.of(args[0], counter, module._pg.rank())
        return None if packed is None else (packed, *args[1:])
