"""A backward that sends now and receives later, so a gradient's bytes fly while the rest
of the backward pass runs.

An exchange hands autograd what it received (computed from its own source tensor,
detached). :func:`tie_backward` ties the two: when the backward pass reaches the received
tensor's gradient, ``start`` codes and sends it at once; at the end of the pass a callback
(the autograd engine's ``queue_callback``, as DDP's reducer finishes its own all-reduce)
calls ``finish`` to receive the source's gradient and runs the source's own backward with
it (the tables' fused update). Between the two, autograd goes on with what needs no
embedding gradient: in DLRM the bottom MLP's backward and DDP's all-reduce, which the
received tensor was made after, so the engine reaches it first.

Where the source's backward reaches parameters that DDP reduces (TorchRec's feature
processors: their position weights are the lookup's per-id weights), it must run within the
pass, before DDP's reducer finishes (its own callback, queued earlier, would otherwise miss
their gradients): ``defer=False`` then sends, waits and hands the source its gradient at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def tie_backward(
    received: torch.Tensor,
    source: torch.Tensor,
    start: Callable[[torch.Tensor], T],
    finish: Callable[[T], torch.Tensor],
    defer: bool = True,
) -> torch.Tensor:
    """``received`` as a tensor of the autograd graph whose gradient ``g`` is sent by
    ``start(g)`` (-> what is in flight) and arrives as ``finish(in_flight)``, the gradient of
    ``source``, at the end of the backward pass (``defer=False``: at once, within it). A
    source that needs no gradient (frozen tables, evaluation) leaves ``received`` as it is."""
    if not source.requires_grad:
        return received
    # What ties ``received`` into autograd where it defers: not ``source``, so that
    # backward reaches the source only through the callback. ``received`` is handed over
    # beside the inputs and detached (the same memory, no view): an input returned as it
    # is, or a view, would be an output that may not be changed in place, as TorchRec's
    # feature-processed bags do (their DDP sync adds to it).
    tied = received.new_empty(0).requires_grad_() if defer else source
    out: torch.Tensor = _Tied.apply(tied, (received.detach(), source, start, finish, defer))
    return out


class _Tied(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tied: torch.Tensor, hooks: Any) -> torch.Tensor:
        received, *ctx.hooks = hooks
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        source, start, finish, defer = ctx.hooks
        in_flight = start(grad)
        if not defer:  # ``tied`` is the source
            return finish(in_flight), None

        def done() -> None:
            torch.autograd.backward(source, finish(in_flight))

        torch.autograd.Variable._execution_engine.queue_callback(done)
        return None, None
