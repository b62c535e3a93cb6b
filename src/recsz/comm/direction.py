"""One direction of an exchange: its codec and bound policy, and what the two say of a
step's payloads before any byte moves (the tables' bounds; the sizes, where the shapes
alone set them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsz.codecs import Codec
from recsz.policy import BoundPolicy


@dataclass(frozen=True)
class Direction:
    """One direction of the exchange: "fwd" or "bwd", its codec and its bound policy."""

    name: str
    codec: Codec
    policy: BoundPolicy

    def bounds(
        self, step: int, tables: list[int], values: torch.Tensor, observe: bool
    ) -> torch.Tensor | None:
        """The tables' bounds for ``step``, one tensor, from their values (``values[j]``:
        all of table ``tables[j]`` that is sent), computed where the values are (on a GPU:
        no host sync); None for a codec that takes none. ``observe``: a training step, which
        adaptive policies probe first (in their windows only)."""
        if not self.codec.error_bounded:
            return None
        if observe:
            self.policy.observe(tables, step, values)
        ebs = self.policy.bounds(tables, step, values)
        if ebs is None:
            raise ValueError(
                f"{self.name} codec {self.codec.codec_id!r} needs an error bound policy "
                "(--eb-policy)"
            )
        return ebs

    def sized_by_shapes(self, like: torch.Tensor) -> bool:
        """Whether the codec's payloads for rows like ``like``'s (width, dtype, device) have
        sizes their shapes set (the casts: :meth:`Codec.group_nbytes`), not their values."""
        return self.codec.group_nbytes(0, like.shape[-1], like.dtype, like.device) is not None

    def known_sizes(
        self,
        like: torch.Tensor,
        sent: list[torch.Tensor],
        rows_out: list[int | None],
        rows_in: list[int | None],
    ) -> list[int] | None:
        """The sizes of the payloads coming in, where the codec's follow from the shapes
        (the casts: :meth:`Codec.group_nbytes`), so that no sizes need exchanging; None
        where the values set them. ``rows_in[s]``: the rows source s sends (rows of
        ``like``'s width, dtype and device; None: it sends an empty payload). ``sent``, the
        payloads going out (``rows_out`` rows each), are checked against the same rule
        first: a codec that broke it would leave a peer waiting for bytes that never come."""
        dim, dtype, dev = like.shape[1], like.dtype, like.device

        def size(rows: int | None) -> int | None:
            return 0 if rows is None else self.codec.group_nbytes(rows, dim, dtype, dev)

        if not self.sized_by_shapes(like):
            return None
        got = [int(p.numel()) for p in sent]
        if got != [size(n) for n in rows_out]:
            raise RuntimeError(
                f"{self.name} codec {self.codec.codec_id!r} made payloads of {got} bytes, "
                f"not the {[size(n) for n in rows_out]} their shapes set (group_nbytes)"
            )
        return [int(size(n) or 0) for n in rows_in]

    def worst_error(
        self,
        sent: list[tuple[int, torch.Tensor, list[int]]],
        payloads: list[torch.Tensor],
        ebs: torch.Tensor,
    ) -> float:
        """Decode the payloads about to be sent (``--check-bounds``), made of ``sent``
        (each one's destination, rows, and rows of each table, whose bounds ``ebs`` holds
        in order) and assert every finite row within its bound; the largest error / bound."""
        dim = sent[0][1].shape[1]
        got = self.codec.decode_segments(payloads, [sizes for _, _, sizes in sent], dim)
        k, worst = 0, 0.0
        for (peer, rows, sizes), y in zip(sent, got, strict=True):
            at = torch.tensor(sizes, device=ebs.device)
            eb = torch.repeat_interleave(ebs[k : k + len(sizes)], at).to(y.device)
            k += len(sizes)
            fin = torch.isfinite(rows).all(1)
            err, eb = (y.double() - rows.double()).abs().amax(1)[fin], eb[fin]
            if bool((err > eb).any()):  # compared as they are: a quotient could round to 1
                raise AssertionError(f"{self.name} to rank {peer}: an error exceeds its bound")
            worst = max(worst, float((err / eb).max()) if err.numel() else 0.0)
        return worst
