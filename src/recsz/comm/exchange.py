"""Moving bytes between ranks: sizes first, then the payloads, as one all-to-all each.

This layer knows nothing of codecs: it takes one uint8 tensor per destination rank and
returns one per source rank. Payload sizes depend on the data (entropy coding), so the
receiver cannot predict them: a small int64 all-to-all of the sizes goes first (unless the
caller knows them: the casts' sizes follow from the shapes), then ``all_to_all_single``
with split sizes moves the bytes (uint8; gloo rejects int16).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class PendingBytes:
    """Bytes in flight; ``wait()`` returns one tensor per source rank."""

    out: torch.Tensor | None
    recv_sizes: list[int]
    work: object | None = None
    waited_s: float = 0.0
    #: With one rank and no process group: the pieces "sent" to this rank, as they were.
    pieces: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        t = time.perf_counter()
        if self.work is not None:
            self.work.wait()  # type: ignore[attr-defined]
            # Let gloo's work go now: one still held (by an autograd graph's closure) when
            # the interpreter shuts down can abort the process as its tensors are freed.
            self.work = None
        self.waited_s += time.perf_counter() - t
        if self.out is None:  # one rank: joined only for a caller that reads the bytes
            assert self.pieces is not None
            self.out = torch.cat(self.pieces) if len(self.pieces) != 1 else self.pieces[0]
        return list(torch.split(self.out, self.recv_sizes))


def start_all_to_all_bytes(
    send: list[list[torch.Tensor]],
    world: int,
    group: dist.ProcessGroup | None = None,
    recv_sizes: list[int] | None = None,
) -> PendingBytes:
    """Exchange sizes (blocking), then start the byte all-to-all (async) over ``group``
    (default: the world). ``send[r]`` holds the pieces for rank r, joined into one buffer.
    ``recv_sizes``: what each rank sends here, where the caller knows it (every rank must
    then know it): no sizes are exchanged.

    With ``world == 1`` and no process group, the only destination is this rank, and
    the bytes are handed back as they are: the same code path runs in one process.
    """
    if len(send) != world:
        raise ValueError(f"need one buffer per rank ({world}), got {len(send)}")
    sizes_l = [sum(int(p.numel()) for p in pieces) for pieces in send]
    if world == 1 and not dist.is_initialized():
        return PendingBytes(None, sizes_l, pieces=[p.view(-1) for p in send[0]])
    flat = [p.view(-1) for pieces in send for p in pieces]
    inp = torch.cat(flat) if len(flat) != 1 else flat[0]
    size_s = 0.0
    if recv_sizes is None:
        sizes = torch.tensor(sizes_l, dtype=torch.int64)
        recv = torch.empty(world, dtype=torch.int64)
        t = time.perf_counter()
        dist.all_to_all_single(recv, sizes, group=group)
        size_s = time.perf_counter() - t
        recv_sizes = recv.tolist()
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=inp.device)
    work = dist.all_to_all_single(out, inp, recv_sizes, sizes_l, group=group, async_op=True)
    return PendingBytes(out, recv_sizes, work, waited_s=size_s)
