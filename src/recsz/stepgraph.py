"""The whole training step replayed as one CUDA graph (``--cuda-graph``).

On one GPU a DLRM step is a few hundred small kernels, and launching them (Python,
autograd, the dispatcher) takes longer than running them: the step is host-bound. A CUDA
graph captured once launches them all at once; each later step copies its batch into
the graph's input tensors and replays it (the whole-network capture of PyTorch's CUDA
graphs notes: forward, backward, the fused table update and the MLPs' optimizer).

A graph replays what the host decided while it was captured, so a step may only replay
a graph whose host-side decisions it shares. Those are the bound policies' (classes,
decay multiplier): each step asks for its *key* (``key(step)``, from
:meth:`BoundPolicy.graph_key`); a step whose key is None (a probe window, a classification
due: the host reads the data) runs eagerly, and each key gets its own graph, captured
after ``warm`` eager steps with it (caches filled, kernels compiled). Shapes must not
change between steps: the trainer allows ``--cuda-graph`` only with fixed-size traffic
(:class:`recsz.config.TrainConfig`).

What the host counts in a step happens once, at capture: the exchange's byte counts
(:class:`CommStats`, held while capturing, whether on the device or set by the shapes on the
host) are counted again after every replay (device tensors copied out of the graph's
memory); its seconds (codec, waits) are not measured under a graph (a replay has no
host-side stages to time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.stats import CommStats, GroupsSent
from recsz.data.source import Batch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: Batch  # the graph's inputs: each step's batch is copied in
    loss: torch.Tensor  # the graph's output
    counted: list[GroupsSent]  # what the captured step counted on the device


class StepGraphs:
    """``step(batch, step) -> loss`` run through CUDA graphs where ``key(step)`` allows.

    Args:
        step: one training step; returns its loss (a device scalar).
        key: the host-side decisions of a step (hashable), or None: run it eagerly.
        stats: the counters whose device counts each replay adds again.
        warm: eager steps with a key before its graph is captured.
        keep: graphs kept (the least recently used goes first).
    """

    def __init__(
        self,
        step: Callable[[Batch, int], torch.Tensor],
        key: Callable[[int], Hashable | None],
        stats: CommStats,
        warm: int = 2,
        keep: int = 2,
    ) -> None:
        self.step, self.key, self.stats = step, key, stats
        self.warm, self.keep = warm, keep
        self.graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self.seen: dict[Hashable, int] = {}
        self.replays = 0
        self.stream: torch.cuda.Stream | None = None  # warm-ups and captures run on it

    def __call__(self, batch: Batch, step: int) -> torch.Tensor:
        decided = self.key(step)
        if decided is None:
            return self.step(batch, step)
        k = (decided, len(batch))  # a batch of another size (an epoch's last) needs its own
        g = self.graphs.get(k)
        if g is None:
            self.seen[k] = self.seen.get(k, 0) + 1
            if self.seen[k] <= self.warm:
                return self._on_side_stream(lambda: self.step(batch, step))
            g = self._capture(k, batch, step)
        self.graphs.move_to_end(k)
        for mine, new in zip(_fields(g.batch), _fields(batch), strict=True):
            mine.copy_(new)
        g.graph.replay()
        self.replays += 1
        for s in g.counted:  # copies: the graph's memory is overwritten by the next replay
            self.stats.count_groups(
                s._replace(used=s.used.clone(), ebs=None if s.ebs is None else s.ebs.clone())
            )
        return g.loss.clone()

    def _on_side_stream(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """fn() on the capturing stream, ordered after and before the current one (cuBLAS
        and the like set themselves up on that stream before a capture, as PyTorch's
        notes on CUDA graphs ask)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = fn()
        main.wait_stream(self.stream)
        return out

    def _capture(self, k: Hashable, batch: Batch, step: int) -> _Captured:
        while len(self.graphs) >= self.keep:
            self.graphs.popitem(last=False)
        static = Batch(*(t.clone() for t in _fields(batch)))
        graph = torch.cuda.CUDAGraph()
        with self.stats.held() as counted:  # host-side counts too
            try:
                loss = self._on_side_stream(
                    lambda: record(graph, lambda: self.step(static, step), self.stream)
                )
            except Exception as e:
                raise RuntimeError(
                    f"--cuda-graph: capturing step {step} failed ({type(e).__name__}: {e}); "
                    "train without --cuda-graph"
                ) from e
        g = _Captured(graph, static, loss, counted)
        self.graphs[k] = g
        return g


def record(
    graph: torch.cuda.CUDAGraph, fn: Callable[[], torch.Tensor], stream: torch.cuda.Stream | None
) -> torch.Tensor:
    """fn()'s device work captured into ``graph`` (not run); its output, to be read after
    each replay. thread_local: the prefetch thread goes on loading batches meanwhile."""
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        return fn()


def graphed(
    step: Callable[[Batch, int], torch.Tensor], exchange: EmbeddingExchange, world: int
) -> StepGraphs:
    """``step`` through CUDA graphs keyed by the exchange's bound policies."""
    if world > 1:
        raise ValueError(f"--cuda-graph runs one process; this job has {world} ranks")
    policies = list(exchange.policies.values())

    def key(k: int) -> Hashable | None:
        keys = [p.graph_key(k) for p in policies]
        return None if any(x is None for x in keys) else tuple(keys)

    return StepGraphs(step, key, exchange.stats)


def _fields(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return b.dense, b.ids, b.labels
