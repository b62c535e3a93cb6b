"""How autograd drives the embedding exchange, overlapping its bytes with computation.

Forward: :meth:`EmbeddingExchange.start_forward` returns a :class:`Pending` whose bytes
fly while the bottom MLP runs; ``wait()`` receives them and ties them into autograd.
Backward: the embeddings' gradient is coded and sent as soon as autograd reaches it, and
received in a callback at the end of the backward pass, so the bytes fly while the bottom
MLP's backward and DDP's all-reduce run; the callback then runs the tables' own backward
(their fused update) with what arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from recsz.comm.embedding import EmbeddingExchange, Sent


@dataclass
class Pending:
    """Forward all-to-all in flight; ``wait()`` gives (b, T, D) tied into autograd."""

    ex: EmbeddingExchange
    pooled: torch.Tensor
    sent: Sent
    step: int
    ids: torch.Tensor

    def wait(self) -> torch.Tensor:
        received = self.ex.finish_forward(self.sent, self.ids, self.pooled.shape[2])
        if not self.pooled.requires_grad:  # frozen tables: no gradient to send back
            return received
        return _ExchangeGrad.apply(_ANCHOR.detach().requires_grad_(), received, self)


#: What ties the received embeddings into autograd: not pooled itself, so that backward
#: reaches the tables only through the gradients' exchange.
_ANCHOR = torch.empty(0)


class _ExchangeGrad(torch.autograd.Function):
    """Identity on the received embeddings forward; backward sends their gradient and
    queues its receipt (and the tables' backward) for the end of the backward pass."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, received: torch.Tensor, p: Pending) -> torch.Tensor:
        ctx.p = p
        if p.ex.mask_backward:
            ctx.save_for_backward(received != 0)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        p = ctx.p
        if p.ex.mask_backward:  # DCT-MP: only the entries the forward delivered
            (kept,) = ctx.saved_tensors
            grad = grad * kept
        sent = p.ex.start_backward(grad, p.step, p.ids)

        def finish() -> None:
            torch.autograd.backward(p.pooled, p.ex.finish_backward(sent, p.ids, p.pooled))

        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return None, None, None
