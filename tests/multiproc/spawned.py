"""Run a worker on gloo ranks (spawned processes) and collect what each saved."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from recsz.devicepath import DEVICE_PATH_ON_CPU

#: lossless codecs, the sharder's compress="auto": its first trial's 6 steps (2 warm-up
#: and 1 timed step each way) alternate, our dists' first (steps 0, 2, 4)
AUTO = {"fwd_codec": "none", "bwd_codec": "zstd", "eb_policy": "none", "compress": "auto",
        "compress_trial": 1, "compress_every": 0}  # fmt: skip


@contextmanager
def codec_path(path: str) -> Iterator[None]:
    """``path`` "device": the codecs' device path (formats 3 and 4, what GPUs send, format
    3 by its Triton kernels under the interpreter), here on the CPU, in the ranks spawned
    inside; "host": the host path."""
    with pytest.MonkeyPatch.context() as mp_env:
        if path == "device":
            mp_env.setenv(DEVICE_PATH_ON_CPU, "1")  # the spawned workers inherit it
        yield


def spawned(worker: Callable[[int, str, str], None], world: int) -> list[dict]:
    """``worker(rank, store, out)`` on ``world`` ranks; what each saved as ``out/rank{r}.pt``."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(worker, args=(store, tmp), nprocs=world, join=True, start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def sgd_ebc(tables: dict[str, tuple], seed: int, weighted: bool = False) -> torch.nn.Module:
    """An EmbeddingBagCollection of ``tables`` (name: (rows, dim, ...)), feature ``f_{name}``
    each, drawn from ``seed``, under SGD fused into the backward (lr 0.5); ``weighted``: its
    bags take per-id weights."""
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
            for n, (r, d, *_) in tables.items()
        ],
        is_weighted=weighted,
    )
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    return ebc


def trained(
    model: torch.nn.Module, batch: Callable[[int], tuple[Any, torch.Tensor]], steps: range
) -> list[torch.Tensor]:
    """Each step's outputs of ``model`` on ``batch(step)`` = (ids, loss weights), after
    which the weighted sum of the outputs is differentiated (the fused update)."""
    outs = []
    for step in steps:
        kjt, w = batch(step)
        y = model(kjt).wait().values()
        outs.append(y.detach().clone())
        (y * w).sum().backward()
    return outs


def straight_and_resumed(
    make: Callable[[], torch.nn.Module],
    train: Callable[[torch.nn.Module, int, int], list[torch.Tensor]],
    steps: int = 4,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs of ``steps`` steps of a model from ``make()`` at once, and of its second
    half from a fresh one loaded with the ``state_dict()`` of one trained the first half
    (``train(model, steps, start)``)."""
    straight = train(make(), steps, 0)
    half = make()
    train(half, steps // 2, 0)
    again = make()
    again.load_state_dict(half.state_dict())
    return straight[steps // 2 :], train(again, steps - steps // 2, steps // 2)


def damaged_step(
    rank: int, forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None]
) -> tuple[str, str]:
    """A step (``backward(forward())``) whose forward payloads, every one received on both
    of two ranks, have a byte flipped: (where the error came: "forward", "backward" or
    "nowhere", its message)."""
    from recsz.comm.exchange import PendingBytes

    real = PendingBytes.wait

    def flipped(self: PendingBytes) -> list[torch.Tensor]:
        bufs = real(self)
        peer = bufs[1 - rank]
        peer[len(peer) // 2] ^= 0x5A
        return bufs

    PendingBytes.wait = flipped  # type: ignore[method-assign]
    try:
        y = forward()
    except ValueError as e:
        return "forward", str(e)
    finally:
        PendingBytes.wait = real  # type: ignore[method-assign]
    try:
        backward(y)
    except ValueError as e:
        return "backward", str(e)
    return "nowhere", ""
