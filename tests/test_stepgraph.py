"""--cuda-graph: the whole step replayed as a CUDA graph.

CPU: what may replay (the policies' keys), what the flag refuses, and the bookkeeping around
the graphs with a stand-in graph that reruns what it captured. CUDA: real graphs against
eager steps of the same model (gpu_check.sh runs these)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from recsz import stepgraph
from recsz.comm.stats import CommStats, GroupsSent
from recsz.config import TrainConfig, parse_train_args
from recsz.data.source import Batch
from recsz.policy import base
from recsz.policy.adaptive import DualBound
from recsz.policy.base import BoundPolicy, FixedBound
from recsz.policy.dct import DCTThreshold
from tests.common import trainer_parts

CLASSES = {"tight": 0.01, "base": 0.03, "loose": 0.05}


def test_policies_key_the_steps_whose_bounds_the_host_decides() -> None:
    x = torch.randn(2, 8, 4)
    assert BoundPolicy().graph_key(5) == FixedBound(0.03).graph_key(5) == ()
    assert DCTThreshold(0.1, 10).graph_key(5) is None  # thresholds read on the host
    p = DualBound(2, CLASSES, probe_steps=2, every=10, decay_t=100)
    keys = []
    for step in range(14):
        keys.append(p.graph_key(step))
        p.observe([0, 1], step, x)
        p.bounds([0, 1], step, x)
    # Probing (steps 0-1, 10-11) and classifying what was probed (2, 12): eagerly.
    assert [k is None for k in keys] == [True] * 3 + [False] * 7 + [True] * 3 + [False]
    assert keys[3] == keys[9] == (((0, p.class_of(0)), (1, p.class_of(1))), p.multiplier(3))
    assert keys[13] != keys[9]  # the decay multiplier moved on (step 10 of 100)


def test_absolute_bounds_run_eagerly_while_checked_on_the_host(monkeypatch) -> None:
    monkeypatch.setitem(base._abs_checks, "left", 3)
    p = FixedBound(0.1, "abs")
    assert p.graph_key(0) is None
    p.bounds([0, 1, 2], 0, torch.randn(3, 8))  # three slices checked: the last ones
    assert p.graph_key(1) == () == FixedBound(0.1).graph_key(0)


def test_the_flag_names_everything_it_cannot_replay() -> None:
    with pytest.raises(ValueError) as e:
        TrainConfig(cuda_graph=True, fwd_codec="zstd", check_bounds=True)
    msg = str(e.value)
    for what in ("--device cpu", "--id-dedup", "--bwd-coalesce", "--check-bounds", "zstd"):
        assert what in msg
    with pytest.raises(ValueError) as e:
        parse_train_args(
            ["--cuda-graph", "--no-id-dedup", "--no-bwd-coalesce", "--fwd-codec", "hybrid",
             "--bwd-codec", "fp16", "--tt-tables", "2", "--nproc", "2", "--batch-size", "64"]
        )  # fmt: skip
    msg = str(e.value)
    assert "--tt-tables" in msg and "--nproc 2" in msg
    assert "hybrid" not in msg and "fp16" not in msg  # codes on the GPU, no host sync
    assert "--dense-optimizer" not in msg  # SGD's step captures
    with pytest.raises(ValueError, match="--dense-optimizer adagrad"):
        TrainConfig(cuda_graph=True, preset="dcnv2")  # torch's Adagrad is not capturable
    with pytest.raises(ValueError, match="--fwd-codec dct"):
        TrainConfig(cuda_graph=True, fwd_codec="dct", bwd_codec="dct-mask")


class StandInGraph:
    """torch.cuda.CUDAGraph on the CPU: a replay reruns what was captured, writing the same
    memory (``inside``: the step then writes the graph's tensors). A real capture runs the
    step's Python once but no kernel, and a real replay counts nothing on the host: the
    rerun's counts are dropped."""

    stats: CommStats
    inside = False

    def replay(self) -> None:
        with self.stats.held():  # dropped
            self._run()

    def _run(self) -> None:
        StandInGraph.inside = True
        try:
            self.fn()
        finally:
            StandInGraph.inside = False


def stand_in_graphs(
    monkeypatch: pytest.MonkeyPatch, stats: CommStats, state: list[torch.Tensor] = ()
) -> None:
    """Graphs stood in for; ``state``: what the step writes (kept as it was by the
    capture, which runs the step's Python, its host-side counts included, but no kernel)."""

    def record(graph: Any, fn: Any, stream: Any) -> torch.Tensor:
        out = torch.zeros(())  # the graph's output memory
        graph.fn = lambda: out.copy_(fn())
        before = [t.clone() for t in state]
        graph._run()
        for t, b in zip(state, before, strict=True):
            t.copy_(b)
        return out

    monkeypatch.setattr(StandInGraph, "stats", stats, raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(stepgraph, "record", record)
    monkeypatch.setattr(stepgraph.StepGraphs, "_on_side_stream", lambda self, fn: fn())


def test_graphs_replay_the_steps_they_may_and_count_each_replay(monkeypatch) -> None:
    stats = CommStats()
    stand_in_graphs(monkeypatch, stats)
    graph_memory = torch.zeros(1, dtype=torch.int64)
    ran: list[int] = []

    def step(batch: Batch, k: int) -> torch.Tensor:
        ran.append(k)
        used = graph_memory if StandInGraph.inside else torch.zeros(1, dtype=torch.int64)
        used.fill_(int(batch.labels.sum()))  # the payloads' lengths
        stats.count_groups(GroupsSent("fwd", [([0], [1])], 4, used, None, [True]))
        return batch.dense.sum()

    keys = {0: None, 1: "a", 2: "a", 3: "a", 4: "a", 5: None, 6: "b", 7: "a", 8: "b", 9: "b"}
    graphs = stepgraph.StepGraphs(step, keys.__getitem__, stats, warm=1, keep=1)
    losses, want = [], []
    for k in range(10):
        b = Batch(torch.full((2, 3), float(k)), torch.zeros(2, 4, dtype=torch.int64),
                  torch.full((2,), float(k + 1)))  # fmt: skip
        losses.append(graphs(b, k))
        want.append(6.0 * k)
    assert [float(x) for x in losses] == want  # each replay saw its own batch, kept apart
    # Eager: 0, 1 (a's warm-up), 5, 6 (b's); a captured at 2 and replayed at 2, 3, 4, 7;
    # b captured at 8 (a dropped: keep=1) and replayed at 8, 9. Replays rerun the
    # captured step (2 or 8) on the inputs copied in.
    assert graphs.replays == 6 and list(graphs.graphs) == [("b", 2)]  # (key, batch size)
    assert ran == [0, 1, 2, 2, 2, 2, 5, 6, 2, 8, 8, 8]
    stats.settle()
    assert stats.sent["fwd"] == sum(2 * (k + 1) for k in range(10))  # every step counted once


def steps_eager_and_graphed(
    codec: str, device: str, steps: int, stand_in: pytest.MonkeyPatch | None = None
) -> tuple[Any, ...]:
    """The same model trained ``steps`` steps eagerly and through graphs (``stand_in``:
    stand-in ones): (eager parts, its losses, graphed parts, their losses, the StepGraphs)."""
    from recsz.data.source import make_source
    from recsz.model import get_preset
    from recsz.step import train_step

    src = make_source("synthetic", get_preset("tiny").model.table_sizes, 0)
    batches = [src.train_batch(k, 256).to(torch.device(device)) for k in range(steps)]
    (eager, ranks), (parts, _) = trainer_parts(codec, device), trainer_parts(codec, device)
    eager_losses = torch.stack([train_step(eager, b, k, ranks) for k, b in enumerate(batches)])
    if stand_in is not None:
        state = [*parts.sparse.state_dict().values(), *parts.dense.state_dict().values()]
        tensors = [t for t in state if isinstance(t, torch.Tensor)]
        stand_in_graphs(stand_in, parts.exchange.stats, tensors)
    graphs = stepgraph.graphed(lambda b, k: train_step(parts, b, k, ranks), parts.exchange, 1)
    losses, sync_free = [], 0
    for k, b in enumerate(batches):
        check = device == "cuda" and (graphs.key(k), len(b)) in graphs.graphs  # a replay
        if check:
            sync_free += 1
            torch.cuda.synchronize()
            with warnings.catch_warnings():  # "a prototype feature", on every use
                warnings.simplefilter("ignore", UserWarning)
                torch.cuda.set_sync_debug_mode("error")
        try:
            losses.append(graphs(b, k))
        finally:
            if check:
                torch.cuda.set_sync_debug_mode("default")
    assert sync_free >= 4 or device != "cuda"  # replays ran under the sync check
    return eager, eager_losses, parts, torch.stack(losses), graphs


def assert_same_training(eager: Any, parts: Any, **tol: float) -> None:
    for a, b in zip(eager.sparse.parameters(), parts.sparse.parameters(), strict=True):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(eager.dense.parameters(), parts.dense.parameters(), strict=True):
        torch.testing.assert_close(a, b, **tol)
    pols = zip(eager.exchange.policies.values(), parts.exchange.policies.values(), strict=True)
    for a, b in pols:
        if tol:  # within a tolerance the probes' counts may differ, not the classes they give
            assert getattr(a, "classes", None) == getattr(b, "classes", None)
        else:
            assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("codec", ["hybrid", "fp16", "none"])
def test_replaying_the_captured_step_trains_as_eager_steps(codec: str, monkeypatch) -> None:
    """The keys hold every host-side decision of an allowed step: a stand-in graph that
    reruns the captured step (its step number, its policies' decisions) on each step's
    batch trains the trainer's model exactly as eager steps do, through probe windows,
    classifications and decays (those steps eagerly). Where the shapes set the payloads'
    sizes (a stand-in cannot rewrite a hybrid payload's length as a replay does), every
    step's bytes are counted as eagerly."""
    eager, eager_losses, parts, losses, graphs = steps_eager_and_graphed(
        codec, "cpu", 30, monkeypatch
    )
    keys = 2 if codec == "hybrid" else 1  # unbounded codecs: no policy, one key
    assert graphs.replays >= 6 and len(graphs.seen) >= keys
    assert torch.equal(losses, eager_losses)
    assert_same_training(eager, parts)
    if codec != "hybrid":
        a, b = eager.exchange.stats, parts.exchange.stats
        a.settle(), b.settle()
        assert (a.raw, a.sent, a.wire) == (b.raw, b.sent, b.wire) and a.sent["bwd"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore::UserWarning")  # what capturing says is not a failure
@pytest.mark.parametrize("codec", ["none", "hybrid"])
def test_cuda_graphed_steps_train_as_the_eager_ones(codec: str) -> None:
    """Real CUDA graphs: 30 steps (probe windows, classifications and decays eagerly, the
    rest replayed) against the same 30 eagerly: the same losses, tables, MLPs, policy
    classes and bytes (within float atomics' orders: the GPU's gradient sums are not
    bitwise repeatable, eager or not); replays without a host sync."""
    eager, eager_losses, parts, losses, graphs = steps_eager_and_graphed(codec, "cuda", 30)
    assert graphs.replays >= 6
    tol = {"rtol": 1e-3, "atol": 1e-4}
    torch.testing.assert_close(losses, eager_losses, **tol)
    assert_same_training(eager, parts, **tol)
    a, b = eager.exchange.stats, parts.exchange.stats
    a.settle(), b.settle()
    assert a.raw == b.raw and a.sent["bwd"] > 0  # every step counted, once
    for d in ("fwd", "bwd"):
        assert b.sent[d] == pytest.approx(a.sent[d], rel=1e-3)
