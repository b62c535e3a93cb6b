"""TorchRec's row-wise output dist through our codecs: a reduce-scatter of partial sums.

A row-wise table's rows are split over the ranks, so every rank looks up the whole global
batch in its shard and holds partial sums of every feature; TorchRec reduce-scatters them
to the samples' ranks (``RwPooledEmbeddingDist``) and all-gathers the gradients back: per
rank, world-size times the bytes of a table-wise all-to-all.

:class:`CompressedReduceScatterDist` sends each sample owner only the partial sums of the
bags that hold ids of this rank's shard (a bag with none sums to zero here: nothing to
send), with one bit a (sample, feature) saying which; each feature's rows travel under its
bound / world, so that the decoded sum of the partials stays within the bound of the exact
sum; the owner adds them up. The backward sends each rank back only the gradient rows of
the bags it filled: a rank's update reads no other (an empty bag touches no row), so this
is exact, and with one id a sample a rank gets 1 / world of the rows. Which bags hold ids
comes from the lengths of the lookup's input, which the sharder's hook hands over
(:attr:`seen`); without them every bag counts as filled.

Bags of one content (:mod:`recsz.torchrec.rows`): the sample owner emptied every bag but
the first of each before TorchRec's input dist, so no rank fills a repeat; the owner copies
the first bag's summed row to the others forward, and adds their gradients onto it
backward (a table's update reads only that sum).

Mean pooling: TorchRec divides the summed rows by each bag's id count (weighted bags: its
weight sum) after this dist, so the bound holds on the sums; an output's error is the
bound over that divisor, larger than the bound where a weighted bag's weights sum below 1.
A module with such a table merges no bags (:meth:`recsz.torchrec.sharded
.CompressedShardedEBC.input_dist`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from recsz.comm.exchange import PendingBytes
from recsz.torchrec.dist import CompressedPooledEmbeddingDist, Context
from recsz.torchrec.rows import Pick


def _bit_weights(device: torch.device) -> torch.Tensor:
    """The weights of a packed byte's bits, made once a device."""
    return _weights(str(device))


@functools.lru_cache(maxsize=8)
def _weights(device: str) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def _check(data: torch.Tensor) -> torch.Tensor:
    """A checksum of bytes: the sum of byte i times 2i + 1, modulo 2^31 (int64, 0-d)."""
    i = torch.arange(data.numel(), device=data.device)
    return (data.long() * (2 * i + 1)).sum() & 0x7FFFFFFF


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as bytes, eight entries a byte (flattened, zero-padded), and the
    bytes' checksum in 4 more (little-endian)."""
    flat = mask.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    data = (flat.view(-1, 8) * _bit_weights(flat.device)).sum(1, dtype=torch.uint8)
    check = (_check(data) >> torch.arange(0, 32, 8, device=data.device)) & 0xFF
    return torch.cat([data, check.to(torch.uint8)])


def unpack_bits(part: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_bits`' bytes back as a boolean tensor of ``shape``, and whether their
    checksum holds (a 0-d tensor, where the bytes are: read it with something else)."""
    n = shape[0] * shape[1]
    if part.numel() != -(-n // 8) + 4:
        raise ValueError(f"{part.numel()} bytes of row bits, expected {-(-n // 8) + 4} for {shape}")
    data, sent = part[:-4], part[-4:].long()
    ok = _check(data) == (sent << torch.arange(0, 32, 8, device=part.device)).sum()
    bits = (data.unsqueeze(1) & _bit_weights(data.device)) != 0
    return bits.reshape(-1)[:n].view(shape), ok


class CompressedReduceScatterDist(CompressedPooledEmbeddingDist):
    """Drop-in for TorchRec's ``RwPooledEmbeddingDist`` (see the module's text)."""

    summed = True

    def _layout(self, inner: Any) -> tuple[list[tuple[int, ...]], list[list[int]]]:
        dims = tuple(inner._embedding_dims)
        return [dims] * self.world, [list(range(len(dims)))] * self.world

    def _context(self, data: torch.Tensor, at: list[int], sharding_ctx: Any) -> Context:
        """This rank's filled bags (those holding ids of its shard; every bag where the
        lookup's ids are missing), by sample owner: the rows it sends each (``mine``, also
        the rows it takes back) and their bits (``bits``, framed ahead)."""
        n, f = data.shape[0], len(self.dims[self.rank])
        filled = self._filled(n, data.device)
        if filled is None:
            filled = torch.ones(n, f, dtype=torch.bool, device=data.device)
        masks = [filled[at[r] : at[r + 1]] for r in range(self.world)]
        ctx = {"mine": Pick.of(masks)[0], "bits": [[pack_bits(m)] for m in masks]}
        merge = getattr(sharding_ctx, "recsz_merge", None)
        if merge is not None:  # each column of my samples' block: its content's first row
            cols = [i for i, d in enumerate(self.dims[self.rank]) for _ in range(d)]
            ctx["firsts"] = merge[2].to(data.device)[:, self._index(cols, data.device)]
        return ctx

    def finish_forward(
        self, pending: PendingBytes, per_rank: list[int], hold: bool, ctx: Context
    ) -> torch.Tensor:
        """The sum of every rank's partials of my samples; which bags each filled is kept
        (``theirs``) for the backward."""
        n, f = per_rank[self.rank], len(self.dims[self.rank])

        def theirs(ahead: list[torch.Tensor]) -> list[Pick]:
            got = []
            for s, part in enumerate(ahead):
                try:
                    got.append(unpack_bits(part, (n, f)))
                except ValueError as e:
                    raise ValueError(f"{self.who}: fwd payloads: rank {s}: {e}") from e
            picks, ok = Pick.of([m for m, _ in got], torch.stack([k for _, k in got]))
            if bad := [s for s, k in enumerate(ok) if not k]:
                raise ValueError(f"{self.who}: fwd payloads: row bits of rank(s) {bad} damaged")
            ctx["theirs"] = picks
            return picks

        rows = [n] * self.world
        got = torch.stack(self._receive(self.fwd, pending, rows, self.dims, hold, theirs)).sum(0)
        return got.gather(0, ctx["firsts"]) if "firsts" in ctx else got

    def start_backward(self, grad: torch.Tensor, step: int, ctx: Context) -> PendingBytes:
        """(local batch, all dims) gradient: to each rank, the rows of the bags it filled."""
        grad = self._divided(grad)
        block = (grad, self.dims[self.rank], self.keys[self.rank])  # bounds: each bag's
        sent = block
        if "firsts" in ctx:  # a content's gradients, summed on its first bag
            sent = (torch.zeros_like(grad).scatter_add_(0, ctx["firsts"], grad), *block[1:])
        blocks = [sent] * self.world
        ebs = self._bounds(self.bwd, step, *block, True)
        return self._send(self.bwd, step, blocks, ebs, True, picks=ctx["theirs"])

    def finish_backward(
        self, pending: PendingBytes, per_rank: list[int], ctx: Context
    ) -> torch.Tensor:
        """(global batch, my dims): each source's rows of the bags I filled, zero elsewhere."""
        dims = [self.dims[self.rank]] * self.world
        got = self._receive(self.bwd, pending, per_rank, dims, picks=ctx["mine"])
        return torch.cat(got)
