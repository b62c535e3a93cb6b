"""Table-row-wise tables under our sharder on four gloo ranks as two hosts of two: TorchRec's
reduce-scatter within a host, our compressed all-to-all between hosts, against stock DMP."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from recsz.devicepath import DEVICE_PATH_ON_CPU
from tests.multiproc.spawned import (
    AUTO,
    codec_path,
    sgd_ebc,
    spawned,
    straight_and_resumed,
    trained,
)

pytestmark = pytest.mark.slow
torchrec = pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")

WORLD, LOCAL, B, STEPS, EB = 4, 2, 16, 3, 1e-3
# name: (rows, dim, plan): two table-row-wise tables, one on each host, of two widths (a:
# one-hot over 10 ids, so that a rank's 16 bags repeat; b: 0-3 ids a bag), a grid one (its
# 256 columns over both hosts, in TorchRec's blocks of 128, each half row-wise within its
# host) and a table-wise one
TABLES = {
    "a": (10, 8, ("twrw", 0)),
    "b": (30, 16, ("twrw", 1)),
    "d": (24, 256, ("grid", [0, 1])),
    "c": (20, 8, ("tw", 3)),
}


def _dmp(sharder: object, seed: int = 0) -> torch.nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        grid_shard,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    ebc = sgd_ebc(TABLES, seed)
    make = {
        "twrw": lambda a: table_row_wise(host_index=a),
        "grid": lambda a: grid_shard(host_indexes=a),
        "tw": lambda a: table_wise(rank=a),
    }
    per_param = {n: make[k](a) for n, (_, _, (k, a)) in TABLES.items()}
    plan = construct_module_sharding_plan(
        ebc, per_param, sharder=sharder, local_size=LOCAL, world_size=WORLD, device_type="cpu"
    )
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _batch(step: int, rank: int, uneven: bool) -> tuple[object, torch.Tensor]:
    """This rank's batch (bags of 0-3 ids; ``uneven``: rank r has B + r samples) and the
    loss weights of its outputs."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    b = B + rank if uneven else B
    lengths = torch.randint(0, 4, (len(TABLES) * b,), generator=g)
    lengths[:b] = 1  # a: one-hot
    rows = torch.tensor([r for r, _, _ in TABLES.values()]).repeat_interleave(b)
    high = rows.repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * high).long()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in TABLES], values=values, lengths=lengths.int()
    )
    return kjt, torch.randn(b, sum(d for _, d, _ in TABLES.values()), generator=g)


def _train(
    model: torch.nn.Module, rank: int, steps: int = STEPS, start: int = 0
) -> list[torch.Tensor]:
    return trained(model, lambda step: _batch(step, rank, False), range(start, start + steps))


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import recsz.torchrec as rt

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)  # two hosts of two ranks
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    res: dict[str, object] = {"stock": _train(_dmp(EmbeddingBagCollectionSharder()), rank)}
    lossless = rt.CompressedEBCSharder(fwd_codec="none", bwd_codec="zstd", eb_policy="none")
    res["lossless"] = _train(_dmp(lossless), rank)
    auto = _dmp(rt.CompressedEBCSharder(**AUTO))  # steps 0 and 2 ours, 1 TorchRec's
    res["auto"] = _train(auto, rank)
    res["auto_steps"] = [s["steps"] for s in rt.comm_bytes(auto)["compress"].values()]
    res["kinds"] = sorted(type(d).__name__ for d in lossless.dists)
    res["dims"] = sorted(str(d.dims) for d in lossless.dists)
    cross = [d for d in lossless.dists if d.dims == [(8,), (16,)]]  # the twrw tables a, b
    res["cross_bytes"] = [(d.raw["fwd"], d.wire["fwd"], d.raw["bwd"], d.wire["bwd"]) for d in cross]
    res["between"] = {str(d.dims): (d.wire["fwd"], d.between["fwd"]) for d in lossless.dists}
    # Uneven batches: forward only (TorchRec's all-gather of uneven blocks, the reduce-
    # scatter's backward, fails on gloo, stock DMP's alike)
    for name, sharder in (("stock_uneven", EmbeddingBagCollectionSharder()),
                          ("lossless_uneven", lossless)):  # fmt: skip
        model = _dmp(sharder)
        with torch.no_grad():
            res[name] = [model(_batch(s, rank, True)[0]).wait().values() for s in range(2)]
    lossy = rt.CompressedEBCSharder(fwd_codec="hybrid", bwd_codec="hybrid", eb_policy="fixed",
                                    fwd_eb=EB, bwd_eb=EB, eb_mode="abs",
                                    check_bounds=True)  # fmt: skip
    model = _dmp(lossy)
    res["lossy"] = _train(model, rank)
    res["bytes"] = rt.comm_bytes(model)
    every = rt.CompressedEBCSharder(fwd_codec="hybrid", bwd_codec="hybrid", eb_policy="fixed",
                                    fwd_eb=EB, bwd_eb=EB, eb_mode="abs",
                                    compress_scope="all")  # fmt: skip
    res["lossy_all"] = _train(_dmp(every), rank, 1)

    # the dual policy's state (steps, classes) through dmp.state_dict(): 2 + 2 steps = 4
    def make() -> torch.nn.Module:
        return _dmp(rt.CompressedEBCSharder(eb_policy="dual", hindex_probe_steps=1,
                                            hindex_every=2, decay_t=4))  # fmt: skip

    if os.environ.get(DEVICE_PATH_ON_CPU) != "1":  # the same state on both paths
        res["straight"], res["resumed"] = straight_and_resumed(
            make, lambda model, steps, start: _train(model, rank, steps, start)
        )
    # the ids the lookup took, lost: refused before any byte leaves, on every rank alike
    forward = rt.CompressedTwRwDist.forward

    def forgetful(self: rt.CompressedTwRwDist, *a: object) -> object:
        self.seen.clear()
        return forward(self, *a)

    rt.CompressedTwRwDist.forward = forgetful  # type: ignore[method-assign]
    try:
        _train(_dmp(lossless), rank, 1)
    except ValueError as e:
        res["no_ids"] = str(e)
    finally:
        rt.CompressedTwRwDist.forward = forward  # type: ignore[method-assign]
    torch.save(res, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=["host", "device"])
def ranks(request: pytest.FixtureRequest) -> Iterator[list[dict]]:
    """The workers' results, on the codecs' host and device paths (:func:`codec_path`)."""
    with codec_path(request.param):
        yield spawned(_worker, WORLD)


def test_lossless_codecs_give_stock_dmp(ranks: list[dict]) -> None:
    """Two table-row-wise tables (hosts 0 and 1), a grid one and a table-wise one, several steps of
    fused SGD: our dists (the cross-host all-to-all of each, a table-wise one) give stock
    DMP's outputs, the first bit for bit; with uneven batches (rank r: B + r samples) the
    forward's outputs, bit for bit."""
    for res in ranks:
        assert res["kinds"] == ["CompressedPooledEmbeddingDist"] * 3
        # table-wise c on rank 3; between the 2 hosts: a | b (twrw), d's column halves (grid)
        assert res["dims"] == [
            "[(), (), (), (8,)]",
            "[(128,), (128,)]",
            "[(8,), (16,)]",
        ]
        assert torch.equal(res["lossless"][0], res["stock"][0])
        for step, (a, b) in enumerate(zip(res["lossless"], res["stock"], strict=True)):
            assert (a - b).abs().max() < 1e-5, f"step {step}"
        for a, b in zip(res["lossless_uneven"], res["stock_uneven"], strict=True):
            assert torch.equal(a, b)
        # compress="auto": a step in TorchRec's dists between ours
        assert res["auto_steps"] == [{"compressed": 2, "plain": 1}]
        for step, (a, b) in enumerate(zip(res["auto"], res["stock"], strict=True)):
            assert (a - b).abs().max() < 1e-5, f"step {step}"


def test_only_the_cross_host_hop_is_ours_and_a_content_crosses_once(ranks: list[dict]) -> None:
    """Each rank's table-row-wise dist sends the other host its reduced rows for that host's
    local rank's samples (B a step, its host's table's width: 8 on host 0, 16 on host 1)
    and gets their gradients back (sending the other host's width); the reduce-scatter
    within the host stays TorchRec's. Of those rows, one a content crosses, and none for an
    empty bag: the one-hot table a (10 ids for 16 bags) sends at most 10 / 16 of its rows'
    fp32 bytes, lossless, the other (0-3 ids a bag) fewer than all, and stock DMP's outputs
    all the same (the lossless test)."""
    for rank, res in enumerate(ranks):
        ((raw_f, wire_f, raw_b, _),) = res["cross_bytes"]
        mine, other = (8, 16) if rank < LOCAL else (16, 8)
        assert (raw_f, raw_b) == (STEPS * B * mine * 4, STEPS * B * other * 4)
        assert 0 < wire_f < (10 / 16 if rank < LOCAL else 0.95) * raw_f + 500


def test_lossy_outputs_within_the_bound(ranks: list[dict]) -> None:
    for res in ranks:
        first = (res["lossy"][0] - res["stock"][0]).abs().max()
        assert 0 < first <= EB  # same weights at step 0: the forward bound
        assert (res["lossy"][-1] - res["stock"][-1]).abs().max() < 0.05
        sent = res["bytes"]
        assert 0.5 < sent["max_err"]["fwd"] <= 1 and 0.5 < sent["max_err"]["bwd"] <= 1
        assert sent["raw"]["fwd"] > 2 * sent["wire"]["fwd"] > 0
        assert 0 < sent["between"]["fwd"] <= sent["wire"]["fwd"]


def test_the_bytes_between_hosts_are_counted_apart(ranks: list[dict]) -> None:
    """The table-row-wise and grid dists run between hosts only: all their bytes cross;
    the table-wise one's (c, on rank 3) to rank 2 stay within host 1."""
    for rank, res in enumerate(ranks):
        for dims, (wire, between) in res["between"].items():
            if dims == "[(), (), (), (8,)]" and rank == 3:
                assert 0 < between < wire
            elif dims != "[(), (), (), (8,)]":
                assert 0 < between == wire


def test_a_table_wise_tables_rows_stay_exact_within_its_host(ranks: list[dict]) -> None:
    """Table c (table-wise, on rank 3, host 1) under the default ``compress_scope`` (auto:
    between hosts, as here): its pooled rows reach ranks 2 and 3 exact, ranks 0 and 1 within
    the bound; under ``compress_scope="all"`` every rank's within the bound, none exact."""
    c = slice(8 + 16 + 256, 8 + 16 + 256 + 8)  # the outputs: a, b, d, c side by side
    for rank, res in enumerate(ranks):
        stock, scoped, every = (res[k][0][:, c] for k in ("stock", "lossy", "lossy_all"))
        assert torch.equal(scoped, stock) == (rank >= LOCAL)
        assert (scoped - stock).abs().max() <= EB and (every - stock).abs().max() <= EB
        assert not torch.equal(every, stock)


def test_a_checkpoint_carries_the_cross_host_dists_state(ranks: list[dict]) -> None:
    """The dual policy (a probe window at step 2, the bound decaying over 4 steps) for 4
    steps at once, and 2 + 2 through ``dmp.state_dict()`` into a fresh DMP: the same
    outputs, bit for bit (the table-row-wise dist's state rides with the table-wise one's)."""
    if "resumed" not in ranks[0]:
        pytest.skip("run on the host path (the dists' state is the same on both)")
    for res in ranks:
        for a, b in zip(res["resumed"], res["straight"], strict=True):
            assert torch.equal(a, b)


def test_merged_bags_without_the_lookups_ids_are_refused_naming_the_rank(
    ranks: list[dict],
) -> None:
    """The sample owners emptied their repeated bags; without the lookup's ids the dist
    could not say which rows to send (sending all would leave the repeats zero): an error
    naming the rank, not a silent wrong answer."""
    for rank, res in enumerate(ranks):
        assert f"rank {rank}: the lookup's ids of this step are missing" in res["no_ids"]
