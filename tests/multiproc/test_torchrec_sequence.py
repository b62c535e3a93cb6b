"""An EmbeddingCollection (sequence embeddings: a row an id) under our sharder on two gloo
ranks against stock DMP: table-wise, column-wise and row-wise tables, lossless and lossy,
uneven batches, ``compress="auto"``, ``TrainPipelineSparseDist``, a checkpoint's state; on
the codecs' host path and on the GPU's (here on the CPU), where the host reads are
counted."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.devicepath import DEVICE_PATH_ON_CPU
from tests.multiproc.spawned import (
    AUTO,
    codec_path,
    damaged_step,
    spawned,
    straight_and_resumed,
)

pytestmark = pytest.mark.slow
torchrec = pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")

WORLD, B, STEPS, EB, DIM = 2, 8, 3, 1e-3, 8
# name: (rows, plan): two table-wise tables on rank 0 and one on rank 1, one column-wise
# over both ranks (4 columns each), one row-wise; ids from few rows, so that they repeat
TABLES = {
    "a": (12, ("tw", 0)),
    "b": (30, ("tw", 1)),
    "c": (9, ("tw", 0)),
    "d": (20, ("cw", [0, 1])),
    "e": (40, ("rw", None)),
}
FEATURES = [f"f_{n}" for n in TABLES]


def _ec(seed: int = 0) -> torch.nn.Module:
    """The test's EmbeddingCollection, drawn from ``seed``, under fused SGD (lr 0.5)."""
    from torchrec import EmbeddingCollection
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(seed)
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
            for n, (r, _) in TABLES.items()
        ]
    )
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": 0.5})
    return ec


def _plan(module: torch.nn.Module, per_param: dict, sharder: object) -> object:
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    return construct_module_sharding_plan(
        module, per_param, sharder=sharder, local_size=WORLD, world_size=WORLD, device_type="cpu"
    )


def _ec_plan(ec: torch.nn.Module, sharder: object) -> object:
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    make = {"tw": lambda a: table_wise(rank=a), "cw": lambda a: column_wise(ranks=a),
            "rw": lambda a: row_wise()}  # fmt: skip
    return _plan(ec, {n: make[k](a) for n, (_, (k, a)) in TABLES.items()}, sharder)


def _dmp(sharder: object, seed: int = 0) -> torch.nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    ec = _ec(seed)
    plan = ShardingPlan({"": _ec_plan(ec, sharder)})
    return DistributedModelParallel(ec, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def _batch(step: int, rank: int, uneven: bool = False) -> object:
    """This rank's batch: 0-4 ids a sample and feature (``uneven``: rank r has B + 3r
    samples)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    b = B + 3 * rank if uneven else B
    lengths = torch.randint(0, 5, (len(TABLES) * b,), generator=g)
    high = torch.tensor([r for r, _ in TABLES.values()]).repeat_interleave(b)
    values = (torch.rand(int(lengths.sum()), generator=g) * high.repeat_interleave(lengths)).long()
    return KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths.int())


def _train(
    model: torch.nn.Module, rank: int, steps: int = STEPS, start: int = 0, uneven: bool = False
) -> list[torch.Tensor]:
    """Each step's rows (every feature's, in order), after which a weighted sum of them is
    differentiated (the fused update)."""
    outs = []
    for step in range(start, start + steps):
        got = model(_batch(step, rank, uneven))
        y = torch.cat([got[f].values() for f in FEATURES])
        outs.append(y.detach().clone())
        g = torch.Generator().manual_seed(7 + step + 100 * rank)
        (y * torch.randn(y.shape, generator=g)).sum().backward()
    return outs


class _Both(torch.nn.Module):
    """An EmbeddingBagCollection (one table, ``p``) and the test's EmbeddingCollection."""

    def __init__(self, ebc: torch.nn.Module, ec: torch.nn.Module) -> None:
        super().__init__()
        self.ebc, self.ec = ebc, ec

    def forward(self, pooled: object, seq: object) -> tuple[torch.Tensor, dict]:
        return self.ebc(pooled).values(), self.ec(seq)


def _both(listed: list) -> torch.nn.Module:
    """:class:`_Both` under DMP with ``listed`` sharders: ``p`` table-wise on rank 1."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder as ECSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as EBCSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import table_wise
    from torchrec.distributed.types import ShardingPlan

    from tests.multiproc.spawned import sgd_ebc

    ebc, ec = sgd_ebc({"p": (20, DIM)}, 3), _ec()
    of = {c: next(s for s in listed if isinstance(s, c)) for c in (EBCSharder, ECSharder)}
    plans = {
        "ebc": _plan(ebc, {"p": table_wise(rank=1)}, of[EBCSharder]),
        "ec": _ec_plan(ec, of[ECSharder]),
    }
    return DistributedModelParallel(
        _Both(ebc, ec), device=torch.device("cpu"), plan=ShardingPlan(plans), sharders=listed
    )


def _train_both(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    """Each step's pooled rows and sequence rows, flat, after which a weighted sum of both
    is differentiated."""
    from torchrec import KeyedJaggedTensor

    outs = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(500 + step + 10 * rank)
        ids = torch.randint(0, 20, (B,), generator=g)
        one = torch.ones(B, dtype=torch.int32)
        pooled = KeyedJaggedTensor.from_lengths_sync(keys=["f_p"], values=ids, lengths=one)
        y, seq = model(pooled, _batch(step, rank))
        rows = torch.cat([seq[f].values() for f in FEATURES])
        outs.append(torch.cat([y.reshape(-1), rows.reshape(-1)]).detach().clone())
        w = torch.Generator().manual_seed(9 + step)
        loss = (y * torch.randn(y.shape, generator=w)).sum()
        (loss + (rows * torch.randn(rows.shape, generator=w)).sum()).backward()
    return outs


class _Net(torch.nn.Module):
    """The EmbeddingCollection with a loss, as TorchRec's pipeline runs a model."""

    def __init__(self, ec: torch.nn.Module) -> None:
        super().__init__()
        self.ec = ec

    def forward(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.ec(batch.kjt)
        y = torch.cat([got[f].values() for f in FEATURES])
        return (y * torch.randn(y.shape, generator=batch.g)).sum(), y.detach().clone()


class _Batch(torchrec.streamable.Pipelineable):
    """A step's ids and the seed of its loss weights, as TorchRec's pipeline takes a batch."""

    def __init__(self, step: int, rank: int) -> None:
        self.kjt = _batch(step, rank)
        self.g = torch.Generator().manual_seed(7 + step + 100 * rank)

    def to(self, device: torch.device, non_blocking: bool = False) -> _Batch:
        return self

    def record_stream(self, stream: object) -> None:
        pass


def _pipelined(sharder: object, rank: int) -> list[torch.Tensor]:
    """:func:`_train`'s steps under TorchRec's ``TrainPipelineSparseDist`` (the next
    batch's input dist before this one's lookup and output dist): each step's rows."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingPlan

    ec = _ec()
    plan = ShardingPlan({"ec": _ec_plan(ec, sharder)})
    net = DistributedModelParallel(
        _Net(ec), device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # (the EC's is fused)
    pipe = TrainPipelineSparseDist(net, opt, torch.device("cpu"))
    batches = iter([_Batch(step, rank) for step in range(STEPS)])
    return [pipe.progress(batches) for _ in range(STEPS)]


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    import recsz.torchrec as rt

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    res: dict[str, object] = {"stock": _train(_dmp(EmbeddingCollectionSharder()), rank)}
    lossless = rt.CompressedECSharder(fwd_codec="none", bwd_codec="zstd", eb_policy="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _dmp(lossless)
    res["warned"] = [str(w.message) for w in caught if "recsz" in str(w.message)]
    res["lossless"] = _train(model, rank)
    res["lossless_bytes"] = rt.comm_bytes(model)
    res["kinds"] = sorted(f"{type(d).__name__} {d.dims}" for d in lossless.dists)
    res["stock_uneven"] = _train(_dmp(EmbeddingCollectionSharder()), rank, uneven=True)
    res["lossless_uneven"] = _train(_dmp(lossless), rank, uneven=True)
    res["pipelined"] = _pipelined(lossless, rank)
    res["pipelined_auto"] = _pipelined(rt.CompressedECSharder(**AUTO), rank)
    auto = _dmp(rt.CompressedECSharder(**AUTO))  # steps 0 and 2 ours, 1 TorchRec's
    res["auto"] = _train(auto, rank)
    res["auto_steps"] = [s["steps"] for s in rt.comm_bytes(auto)["compress"].values()]
    lossy = rt.CompressedECSharder(fwd_eb=EB, bwd_eb=EB, eb_mode="abs", eb_policy="fixed",
                                   check_bounds=True)  # fmt: skip
    model = _dmp(lossy)
    res["lossy"] = _train(model, rank)
    res["bytes"] = rt.comm_bytes(model)
    res["damaged"] = _damaged(model, rank)
    device = os.environ.get(DEVICE_PATH_ON_CPU) == "1"
    if device:
        res["reads"] = _our_host_reads(rank)
    # an EBC and an EC in one model under sharders(): one switch, lossless = stock
    from torchrec.distributed.sharding_plan import get_default_sharders

    for name, listed in (("both_stock", get_default_sharders()), ("both", rt.sharders(**AUTO))):
        model = _both(listed)
        res[name] = _train_both(model, rank)
    res["both_switches"] = [s.state()["steps"] for s in rt.switches(model)]

    if not device:  # (the same state on both paths)
        # the dual policy's state (steps, classes) through dmp.state_dict(): 2 + 2 steps = 4
        def make() -> torch.nn.Module:
            return _dmp(rt.CompressedECSharder(hindex_probe_steps=1, hindex_every=2, decay_t=4))

        res["straight"], res["resumed"] = straight_and_resumed(
            make, lambda model, steps, start: _train(model, rank, steps, start)
        )
    torch.save(res, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _damaged(model: torch.nn.Module, rank: int) -> tuple[str, str]:
    """A step of ``model`` whose forward payloads come with a byte flipped (where the
    error came, its message)."""

    def forward() -> torch.Tensor:
        got = model(_batch(STEPS, rank))
        return torch.cat([got[f].values() for f in FEATURES])

    return damaged_step(rank, forward, lambda y: y.sum().backward())


def _our_host_reads(rank: int) -> list[tuple[int, str]]:
    """Steps 2-3 of the lossy sharder on the GPU's path: the host reads recsz makes (what a
    GPU would wait for; TorchRec's own input dist is not counted), and where."""
    import recsz.torchrec as rt
    from recsz.policy import base
    from tests.hostreads import counting, mark

    base._abs_checks["left"] = 0  # the first slices' bound checks (tested elsewhere)
    sharder = rt.CompressedECSharder(fwd_eb=EB, bwd_eb=EB, eb_mode="abs", eb_policy="fixed")
    got = []
    with counting([]) as c:
        model = _dmp(sharder)
        for step in range(4):
            kjt = _batch(step, rank)
            mark([kjt.values(), kjt.lengths()])
            got_rows = model(kjt)
            y = torch.cat([got_rows[f].values() for f in FEATURES])
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(step))
            (y * w).sum().backward()
            got.append(c.ours_after_input_dist())
    return got[2:]


@pytest.fixture(scope="module", params=["host", "device"])
def ranks(request: pytest.FixtureRequest) -> Iterator[list[dict]]:
    """The workers' results, on the codecs' host and device paths (:func:`codec_path`)."""
    with codec_path(request.param):
        yield spawned(_worker, WORLD)


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {step}"


def test_lossless_codecs_give_stock_dmp_bit_for_bit(ranks: list[dict]) -> None:
    """Table-wise, column-wise and row-wise sequence tables, 3 steps of fused SGD: each
    step's rows equal stock DMP's bit for bit (the gradients went back right: the later
    steps read the updated rows), with uneven batches (rank r: B + 3r samples), and under
    ``compress="auto"`` (a step TorchRec's between ours). (TorchRec's ``use_index_dedup``
    does not run on the CPU, stock or ours: its fbgemm op has no CPU kernel.)"""
    for res in ranks:
        assert res["kinds"] == [
            "CompressedSequenceEmbeddingDist [(4,), (4,)]",  # d's columns
            "CompressedSequenceEmbeddingDist [(8, 8), (8,)]",  # a, c | b
            "CompressedSequenceEmbeddingDist [(8,), (8,)]",  # e's shards
        ]
        _same(res["lossless"], res["stock"])
        _same(res["lossless_uneven"], res["stock_uneven"])
        _same(res["pipelined"], res["stock"])  # under TrainPipelineSparseDist
        _same(res["pipelined_auto"], res["stock"])  # (its switch asked a batch ahead)
        _same(res["auto"], res["stock"])
        assert res["auto_steps"] == [{"compressed": 2, "plain": 1}]
        # an EBC and an EC in one model under sharders(): lossless = stock, one switch
        _same(res["both"], res["both_stock"])
        assert res["both_switches"] == [{"compressed": 2, "plain": 1}]
        assert res["warned"] == []  # (TorchRec's sharded EC loads the unsharded state)
        sent = res["lossless_bytes"]
        assert sent["raw"]["fwd"] > 0 and sent["raw"]["bwd"] > 0


def test_lossy_rows_within_the_bound_and_fewer_bytes(ranks: list[dict]) -> None:
    """The default codec (hybrid) under an absolute bound: the first step's rows (same
    weights) within it of stock's, every payload checked before it left, fewer bytes than
    the fp32 rows."""
    for res in ranks:
        first = (res["lossy"][0] - res["stock"][0]).abs().max()
        assert 0 < first <= EB
        assert (res["lossy"][-1] - res["stock"][-1]).abs().max() < 0.05
        sent = res["bytes"]
        assert 0.5 < sent["max_err"]["fwd"] <= 1 and 0.5 < sent["max_err"]["bwd"] <= 1
        assert sent["raw"]["fwd"] > 1.5 * sent["wire"]["fwd"] > 0  # (tiny steps: headers)


def test_a_checkpoint_carries_the_sequence_dists_state(ranks: list[dict]) -> None:
    """The dual policy for 4 steps at once, and 2 + 2 through ``dmp.state_dict()`` into a
    fresh DMP: the same rows, bit for bit."""
    if "straight" not in ranks[0]:
        pytest.skip("the device path: the dists' state is the host path's")
    for res in ranks:
        _same(res["resumed"], res["straight"])


def test_on_the_gpu_path_each_dist_reads_the_host_six_times_a_step(ranks: list[dict]) -> None:
    """What a GPU would wait for in our sequence dists (counted on the CPU,
    tests/hostreads.py), per dist and step: how many rows each (feature, destination)
    has (the lookup's split), the payloads' lengths and the received buffers' tables of
    lengths each way (the forward's with the row counts framed ahead of its payloads),
    and the checks' verdicts (the backward's; the forward's ride on its lengths). Indices
    are made once or uploaded: no host values copied to the device."""
    if "reads" not in ranks[0]:
        pytest.skip("the host path: host reads cost nothing there")
    for r in ranks:
        assert len(r["reads"]) == 2
        for reads, where in r["reads"]:
            assert reads == 6 * 3, where  # three dists: table-wise, column-wise, row-wise
            for site in ("_counts", "read_all"):
                assert site in where, where
            assert where.count("read_sizes") == 2 and where.count("unframe_all") == 2, where
            assert "read_counts" not in where and "device=) at sequence.py" not in where, where


def test_a_damaged_payload_is_named_before_its_gradients_leave(ranks: list[dict]) -> None:
    """A forward payload with a byte flipped: on the host path the decode names its rank
    at once; on the GPU's path its checks ride on the backward's read of lengths, which
    raises before any byte made from it is sent."""
    for rank, res in enumerate(ranks):
        where, msg = res["damaged"]
        assert where == ("backward" if "reads" in res else "forward"), (where, msg)
        assert f"rank {rank}: fwd payloads" in msg, msg
        if "reads" not in res:  # (the GPU's checks tell which slice, not which source)
            assert "from ranks [0, 1]: payload" in msg and "checksum" in msg, msg
            assert f"payload {1 - rank}" in msg, msg


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=6), st.data())
def test_segments_take_and_place_rows_back(counts: list[int], data: st.DataObject) -> None:
    """A block's features one above another: any subset of them taken and placed back
    lands where it was, the rest untouched."""
    from recsz.torchrec.sequence import Segments

    x = torch.randn(sum(counts), 3)
    some = st.sets(st.sampled_from(range(len(counts)))) if counts else st.just(set())
    fs = sorted(data.draw(some))
    rows, sizes = Segments(counts).taken(x, fs, [], 3)
    assert sizes == [counts[f] for f in fs] and rows.shape == (sum(sizes), 3)
    out = torch.zeros_like(x)
    Segments(counts).place(out, rows, fs, [], 3)
    at = [0, *torch.tensor(counts).cumsum(0).tolist()] if counts else [0]
    for f in range(len(counts)):
        want = x[at[f] : at[f + 1]] if f in fs else torch.zeros(counts[f], 3)
        assert torch.equal(out[at[f] : at[f + 1]], want)


def test_damaged_row_counts_are_refused_naming_the_rank() -> None:
    """Counts framed ahead of a payload that are short, negative or do not add up to the
    rows the source sent: a ValueError naming the source, not rows in the wrong places."""
    from recsz.torchrec.sequence import counts_part, read_counts

    good = counts_part([2, 3], torch.device("cpu"))
    assert [s.counts for s in read_counts([good, good], [2, 2], [5, 5])] == [[2, 3], [2, 3]]
    with pytest.raises(ValueError, match="rank 1: 8 bytes of row counts, expected 16"):
        read_counts([good, good[:8]], [2, 2], [5, 5])
    with pytest.raises(ValueError, match=r"rank 0: row counts .* do not add up to its 6 rows"):
        read_counts([good, good], [2, 2], [6, 5])
    bad = counts_part([7, -2], torch.device("cpu"))
    with pytest.raises(ValueError, match="rank 1: row counts"):
        read_counts([good, bad], [2, 2], [5, 5])
