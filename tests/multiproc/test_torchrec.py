"""recsz.torchrec on two gloo ranks (CPU): TorchRec's DMP with our sharder against stock DMP.

One spawn runs every case (TorchRec takes seconds to import); each rank writes what it
saw, and the assertions run here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.devicepath import DEVICE_PATH_ON_CPU
from tests.multiproc.spawned import AUTO, codec_path, damaged_step, sgd_ebc, spawned, trained

pytestmark = pytest.mark.slow
torchrec = pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")

WORLD, B, STEPS, EB = 2, 64, 4, 1e-3
# name: (rows, dim, plan); dims 8 and 16 on one rank: two widths in one payload; two
# row-wise tables of both widths (a reduce-scatter of partial sums).
TABLES = {
    "t0": (50, 8, ("tw", 0)),
    "t1": (40, 8, ("tw", 1)),
    "t2": (30, 16, ("tw", 0)),
    "t3": (60, 16, ("cw", [0, 1])),
    "t4": (20, 16, ("twcw", [0, 1])),
    "t5": (70, 8, ("rw", None)),
    "t6": (45, 16, ("rw", None)),
}


def _model(seed: int) -> torch.nn.Module:
    return sgd_ebc(TABLES, seed)


class _Net(torch.nn.Module):
    """An EBC, a dense layer on its output (DMP wraps it in DDP) and a loss, as TorchRec's
    training pipeline expects a model."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.top = torch.nn.Linear(sum(d for _, d, _ in TABLES.values()), 1)

    def forward(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.ebc(batch.kjt).values()
        loss = (y * batch.w).sum() + self.top(y).square().mean()
        return loss, loss.detach()


def _dmp(sharder: object, plan_of: dict, net: bool = False) -> torch.nn.Module:
    """The test's EBC (or a :class:`_Net` of it) sharded by ``sharder`` as ``plan_of`` says."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        grid_shard,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    def table_column_wise(ranks: list[int]) -> object:
        """column_wise's placement, as TorchRec's table-column-wise sharding (no helper of
        its own: it is column-wise within a host, and 2 local ranks are one host)."""
        gen = column_wise(ranks=ranks)
        return lambda *a, **kw: dataclasses.replace(
            gen(*a, **kw), sharding_type="table_column_wise"
        )

    make = {"tw": lambda a: table_wise(rank=a), "cw": lambda a: column_wise(ranks=a),
            "twcw": table_column_wise, "rw": lambda a: row_wise(),
            "grid": lambda a: grid_shard(host_indexes=[0])}  # fmt: skip
    ebc = _model(0)
    per_param = {n: make[k](a) for n, (k, a) in plan_of.items()}
    plan = construct_module_sharding_plan(
        ebc, per_param, sharder=sharder, local_size=WORLD, world_size=WORLD, device_type="cpu"
    )
    model = _Net(ebc) if net else ebc
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc" if net else "": plan}),
        sharders=[sharder],
    )


#: ids a bag: (fewest, most) of each table; the others 1-3
BAGS = {"t0": (1, 1), "t1": (0, 1), "t3": (1, 1), "t5": (1, 1)}


def _batch(step: int, rank: int) -> tuple[object, torch.Tensor]:
    """This rank's local batch (one-hot t0, t3 and t5, t1 0-1 ids a bag, the others 1-3) and
    the loss weights of its outputs."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    few, most = zip(*(BAGS.get(n, (1, 3)) for n in TABLES), strict=True)
    low, high = torch.tensor(few).repeat_interleave(B), torch.tensor(most).repeat_interleave(B)
    lengths = (low + torch.rand(len(TABLES) * B, generator=g) * (high - low + 1)).int()
    rows = [r for r, _, _ in TABLES.values()]
    values = torch.cat(
        [
            torch.randint(0, rows[t], (int(n),), generator=g)
            for t, ln in enumerate(lengths.view(len(TABLES), B))
            for n in ln
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in TABLES], values=values, lengths=lengths
    )
    return kjt, torch.randn(B, sum(d for _, d, _ in TABLES.values()), generator=g)


def _train(
    model: torch.nn.Module, rank: int, steps: int = STEPS, start: int = 0
) -> list[torch.Tensor]:
    return trained(model, lambda step: _batch(step, rank), range(start, start + steps))


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import recsz.torchrec as rt

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    plan_of = {n: p for n, (_, _, p) in TABLES.items()}
    res: dict[str, object] = {}
    res["stock"] = _train(_dmp(EmbeddingBagCollectionSharder(), plan_of), rank)
    lossless = rt.CompressedEBCSharder(fwd_codec="none", bwd_codec="zstd", eb_policy="none")
    import recsz.torchrec.rowwise as rowwise

    # the row-wise dist's merges, as they happen (each feature's contents), and what its
    # backward takes its bounds from: t5's columns (its first 8), a row a bag
    Dist, context_of, bounds_of, merged, zero = rowwise.CompressedReduceScatterDist, [], [], [], []
    context_of.append(Dist._context)
    Dist._context = lambda self, data, at, sctx: (
        (  # type: ignore[method-assign]
            merged.append(sctx.recsz_merge[1]) if sctx.recsz_merge is not None else None
        )
        or context_of[0](self, data, at, sctx)
    )
    bounds_of.append(Dist._bounds)
    Dist._bounds = (
        lambda self, d, step, x, *a: (
            (  # type: ignore[method-assign]
                zero.append(int((x[:, :8] == 0).all(1).sum())) if d.name == "bwd" else None
            )
            or bounds_of[0](self, d, step, x, *a)
        )
    )
    res["lossless"] = _train(_dmp(lossless, plan_of), rank)
    Dist._context, Dist._bounds = context_of[0], bounds_of[0]
    res["rw_contents"] = [m.tolist() for m in merged]  # a step's contents per RW feature
    res["rw_bound_zero_rows"] = zero
    res["dists"] = len(lossless.dists)  # one per sharding type: TW, CW, TWCW, RW
    rw = [d for d in lossless.dists if isinstance(d, rt.CompressedReduceScatterDist)]
    res["rw_bytes"] = [(d.raw["fwd"], d.wire["fwd"], d.raw["bwd"], d.wire["bwd"]) for d in rw]
    tw = [d for d in lossless.dists if d not in rw]
    res["tw_bytes"] = (
        [sum(d.raw[k] for d in tw) for k in ("fwd", "bwd")],
        [sum(d.wire[k] for d in tw) for k in ("fwd", "bwd")],
    )
    lossy = rt.CompressedEBCSharder(fwd_codec="hybrid", bwd_codec="hybrid", eb_policy="fixed",
                                    fwd_eb=EB, bwd_eb=EB, eb_mode="abs",
                                    check_bounds=True)  # fmt: skip
    model = _dmp(lossy, plan_of)
    on_device = os.environ.get(DEVICE_PATH_ON_CPU) == "1"
    res["lossy"] = _train(model, rank, 2 if on_device else STEPS)  # (Triton's interpreter)
    res["bytes"] = rt.comm_bytes(model)
    with torch.no_grad():  # evaluation: neither counted nor fed to the policies
        model(_batch(0, rank)[0]).wait()
    after = rt.comm_bytes(model)
    res["eval_counted"] = [after[k] != res["bytes"][k] for k in ("raw", "wire")]
    if not on_device:  # a DMP user's own profile of a step names recsz's stages in it
        from torch.profiler import profile

        with profile() as prof:
            _train(model, rank, 1, start=STEPS)
        res["ranges"] = sorted({e.key for e in prof.key_averages() if e.key.startswith("recsz")})
    res["variable_batch"] = _variable_batch(lossy.dists[0])
    auto = rt.CompressedEBCSharder(**AUTO)
    model = _dmp(auto, plan_of)
    res["auto"] = _train(model, rank)
    res["auto_bytes"] = rt.comm_bytes(model)
    import recsz.torchrec.sharder as sharder_module

    # a sharding we do not carry (TorchRec 1.8 has none left: grid stands in for one)
    carried = sharder_module.COMPRESSED.pop("grid_shard")
    try:
        _dmp(lossless, {**plan_of, "t1": ("grid", None)})
    except ValueError as e:
        res["grid_error"] = str(e)
    finally:
        sharder_module.COMPRESSED["grid_shard"] = carried
    res["pipeline"] = _pipeline(rank, plan_of)
    counted = None
    if on_device:
        res["reads"], counted = _our_host_reads(rank, plan_of)
    res["damaged"] = _damaged_forward(rank, plan_of, counted)
    res["dense"] = _dense(rank, plan_of)
    res["feature_processed"] = _feature_processed(rank, plan_of)
    res["managed_collision"] = _managed_collision(rank)
    res["two_modules"] = _two_modules(rank, plan_of)
    if os.environ.get(DEVICE_PATH_ON_CPU) != "1":  # the same state on both paths
        res["resumed"] = _resumed(rank, plan_of, Path(out) / "dcp")
    torch.save(res, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _our_host_reads(rank: int, plan_of: dict) -> tuple[list[tuple[int, str]], torch.nn.Module]:
    """Steps 2-3 of our sharder on the GPU's path: the host reads recsz makes (what a GPU
    would wait for; TorchRec's own input dist is not counted), and where; and the model."""
    import recsz.torchrec as rt
    from recsz.policy import base
    from tests.hostreads import counting, mark

    base._abs_checks["left"] = 0  # the first slices' bound checks (tested elsewhere)
    sharder = rt.CompressedEBCSharder(fwd_codec="hybrid", bwd_codec="hybrid", eb_policy="fixed",
                                      fwd_eb=EB, bwd_eb=EB, eb_mode="abs")  # fmt: skip
    got = []
    with counting([]) as c:
        model = _dmp(sharder, plan_of)
        for step in range(4):
            kjt, w = _batch(step, rank)
            mark([kjt.values(), kjt.lengths(), w])
            y = model(kjt).wait().values()
            (y * w).sum().backward()
            got.append(c.ours_after_input_dist())
    return got[2:], model


def _damaged_forward(rank: int, plan_of: dict, model: torch.nn.Module | None) -> tuple[str, str]:
    """A step's forward payloads (after step 0 of a model of our sharder, hybrid both ways,
    or ``model``, such a model trained further), every one received on both ranks, with a
    byte flipped: (where the error came: "forward" or "backward", its message)."""
    import recsz.torchrec as rt

    if model is None:
        sharder = rt.CompressedEBCSharder(fwd_codec="hybrid", bwd_codec="hybrid",
                                          eb_policy="fixed", fwd_eb=EB, bwd_eb=EB,
                                          eb_mode="abs")  # fmt: skip
        model = _dmp(sharder, plan_of)
        _train(model, rank, 1)
    kjt, w = _batch(1, rank)
    return damaged_step(
        rank, lambda: model(kjt).wait().values(), lambda y: (y * w).sum().backward()
    )


def _resumed(rank: int, plan_of: dict, dcp_dir: Path) -> dict[str, object]:
    """The dual policy (a probe window at step 2, its classes after it, the bound decaying
    over the 4 steps) trained 4 steps at once, and 2 + 2 through ``dmp.state_dict()`` into
    a fresh DMP; the same from a checkpoint without our state (as stock DMP writes one),
    and from another rank's (as a checkpointer keeping one copy of non-tensors loads it);
    and through torch.distributed.checkpoint, which does."""
    import torch.distributed.checkpoint as dcp

    import recsz.torchrec as rt

    def make() -> rt.CompressedEBCSharder:
        return rt.CompressedEBCSharder(eb_policy="dual", hindex_probe_steps=1, hindex_every=2,
                                       decay_t=4)  # fmt: skip

    def resumed(
        saved: dict | None, plan: dict = plan_of
    ) -> tuple[list[torch.Tensor], list[str], list[int]]:
        sharder = make()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _dmp(sharder, plan)  # (which says nothing of recsz's state)
            if saved is None:  # from the DCP checkpoint
                saved = model.state_dict()
                dcp.load(saved, checkpoint_id=str(dcp_dir))
            model.load_state_dict(saved)
        said = [str(w.message) for w in caught if "recsz" in str(w.message)]
        steps = [d.step for d in sharder.dists]
        return _train(model, rank, 2, start=2), said, steps

    out: dict[str, object] = {"straight": _train(_dmp(make(), plan_of), rank)}
    half = _dmp(make(), plan_of)
    _train(half, rank, 2)
    saved = half.state_dict()
    (key,) = [k for k in saved if k.endswith("_extra_state")]
    out["resumed"] = resumed(saved)
    out["afresh"] = resumed({k: v for k, v in saved.items() if k != key})
    other = {**json.loads(saved[key]), "rank": 1 - rank}
    out["other"] = resumed({**saved, key: json.dumps(other).encode()})
    dcp.save(saved, checkpoint_id=str(dcp_dir))
    out["dcp"] = resumed(None)
    # the same checkpoint under another plan (t0 and t1 trade ranks: DCP reshards them)
    out["replanned"] = resumed(None, {**plan_of, "t0": ("tw", 1), "t1": ("tw", 0)})
    # a stock DMP's DCP checkpoint taken up by ours (lossless): the tables from it, our state
    # afresh; DCP refuses a key the checkpoint lacks unless told a partial load is fine
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    stock, stock_dir = _dmp(EmbeddingBagCollectionSharder(), plan_of), str(dcp_dir) + "_stock"
    _train(stock, rank, 2)
    dcp.save(stock.state_dict(), checkpoint_id=stock_dir)
    out["stock_next"] = _train(stock, rank, 2, start=2)
    ours = _dmp(rt.CompressedEBCSharder(fwd_codec="none", bwd_codec="zstd", eb_policy="none"),
                plan_of)  # fmt: skip
    saved = ours.state_dict()
    try:
        dcp.load(saved, checkpoint_id=stock_dir)
    except dcp.CheckpointException as e:  # (every rank's)
        out["strict_load"] = str(e)
    dcp.load(saved, checkpoint_id=stock_dir, planner=DefaultLoadPlanner(allow_partial_load=True))
    ours.load_state_dict(saved)
    out["from_stock"] = _train(ours, rank, 2, start=2)

    # compress="auto": the switch (its batches, way, trials) goes through the checkpoint too
    def auto() -> rt.CompressedEBCSharder:  # a trial over batches 0-5, the next at 10
        lossless = {"fwd_codec": "zstd", "bwd_codec": "zstd", "eb_policy": "none"}
        return rt.CompressedEBCSharder(
            **lossless, compress="auto", compress_trial=1, compress_every=10
        )

    first = _dmp(auto(), plan_of)
    _train(first, rank, 8)
    again = _dmp(auto(), plan_of)
    again.load_state_dict(first.state_dict())
    out["switch"] = [
        (
            [m.recsz_batches for m in model.modules() if hasattr(m, "recsz_batches")],
            rt.switches(model)[0].state(),
        )
        for model in (first, again)
    ]
    return out


def _feature_processed(rank: int, plan_of: dict) -> dict[str, list[torch.Tensor]]:
    """The test's tables with TorchRec's position weights (a FeatureProcessedEBC) under the
    sharders of ``recsz.torchrec.sharders()`` (its FP-EBC sharder wraps ours) and stock's:
    their outputs over the steps, and how many compressed dists ours made."""
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    import recsz.torchrec as rt

    tw = [n for n, (kind, _) in plan_of.items() if kind == "tw"]
    out: dict[str, list[torch.Tensor]] = {}
    lossless = [s for s in rt.sharders(fwd_codec="none", bwd_codec="zstd", eb_policy="none")
                if isinstance(s, FeatureProcessedEmbeddingBagCollectionSharder)]  # fmt: skip
    for name, sharder in (("stock", FeatureProcessedEmbeddingBagCollectionSharder()),
                          ("ours", lossless[0])):  # fmt: skip
        ebc = sgd_ebc({n: TABLES[n] for n in tw}, 0, weighted=True)
        processors = PositionWeightedModuleCollection({f"f_{n}": 3 for n in tw})
        torch.manual_seed(1)
        for p in processors.parameters():
            torch.nn.init.uniform_(p, 0.5, 1.5)
        fp = FeatureProcessedEmbeddingBagCollection(ebc, processors)
        per_param = {n: table_wise(rank=plan_of[n][1]) for n in tw}
        plan = construct_module_sharding_plan(
            fp, per_param, sharder=sharder, local_size=WORLD, world_size=WORLD, device_type="cpu"
        )
        model = DistributedModelParallel(
            fp, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
        )
        outs = []
        for step in range(STEPS):
            kjt, _ = _batch(step, rank)
            kjt = kjt.permute([list(TABLES).index(n) for n in tw])
            y = model(kjt).wait().values()
            outs.append(y.detach().clone())
            y.square().sum().backward()
        out[name] = outs
    out["dists"] = [len(lossless[0]._ebc_sharder.dists)]
    return out


def _managed_collision(rank: int) -> dict[str, object]:
    """The row-wise tables behind TorchRec's managed collision (a ManagedCollision-EBC: its
    collection remaps raw ids to rows after its own input dist; TorchRec shards it row-wise
    only) under stock DMP's sharder and ``recsz.torchrec.sharders()``'s, lossless and with
    ``compress="auto"``: outputs over the steps, our bytes and switch."""
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder as MCSharder,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    import recsz.torchrec as rt

    rw = [n for n, (_, _, (kind, _)) in TABLES.items() if kind == "rw"]
    lossless = {"fwd_codec": "none", "bwd_codec": "zstd", "eb_policy": "none"}
    out: dict[str, object] = {}
    for name, sharder in (
        ("stock", MCSharder()),
        *((k, next(s for s in rt.sharders(**kw) if isinstance(s, MCSharder)))
          for k, kw in (("ours", lossless), ("auto", AUTO))),
    ):  # fmt: skip
        ebc = sgd_ebc({n: TABLES[n] for n in rw}, 0)
        configs = ebc.embedding_bag_configs()
        collisions = ManagedCollisionCollection(
            {c.name: MCHManagedCollisionModule(
                zch_size=c.num_embeddings, device=torch.device("cpu"), input_hash_size=1000,
                eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=2)
             for c in configs},
            configs,
        )  # fmt: skip
        mc = ManagedCollisionEmbeddingBagCollection(ebc, collisions, return_remapped_features=False)
        plan = construct_module_sharding_plan(
            mc, {n: row_wise() for n in rw}, sharder=sharder, local_size=WORLD,
            world_size=WORLD, device_type="cpu",
        )  # fmt: skip
        model = DistributedModelParallel(
            mc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
        )
        outs = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            values = torch.randint(0, 1000, (len(rw) * B,), generator=g) % (200 + 100 * step)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f_{n}" for n in rw], values=values, lengths=torch.ones_like(values)
            )
            pooled, _ = model(kjt)
            y = pooled.wait().values() if hasattr(pooled, "wait") else pooled.values()
            outs.append(y.detach().clone())
            y.square().sum().backward()
        out[name] = outs
        if name != "stock":
            out[f"{name}_bytes"] = rt.comm_bytes(model)
    return out


class _Two(torch.nn.Module):
    """Two sharded modules in one model: an EBC and a feature-processed one; the loss and
    the outputs of a :class:`_TwoBatch`, as TorchRec's training pipeline takes a model."""

    def __init__(self, ebc: torch.nn.Module, fp: torch.nn.Module) -> None:
        super().__init__()
        self.ebc, self.fp = ebc, fp

    def forward(self, batch: _TwoBatch) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([self.ebc(batch.a).values(), self.fp(batch.b).values()], dim=1)
        return y.square().sum(), y.detach().clone()


def _two_modules(rank: int, plan_of: dict) -> dict[str, object]:
    """A model of two sharded modules (the row-wise tables in an EBC, the table-wise ones in
    a position-weighted FeatureProcessedEBC) under stock DMP's sharders and
    ``recsz.torchrec.sharders(compress="auto")``: the outputs over the steps, our switches'
    states, the way each module's batches went (True: plain), and the position weights'
    gradients (DDP's parameters: their exchange must end before DDP's does)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as EBCSharder
    from torchrec.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder as FPSharder,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        get_default_sharders,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    import recsz.torchrec as rt
    from recsz.torchrec.sharded import CompressedShardedEBC

    tw = [n for n, (kind, _) in plan_of.items() if kind == "tw"]
    rw = [n for n, (kind, _) in plan_of.items() if kind == "rw"]
    rw_at, tw_at = ([list(TABLES).index(n) for n in names] for names in (rw, tw))
    out: dict[str, object] = {}
    for pipelined, name in itertools.product((False, True), ("stock", "auto")):
        sharders = rt.sharders(**AUTO) if name == "auto" else get_default_sharders()
        ebc = sgd_ebc({n: TABLES[n] for n in rw}, 0)
        torch.manual_seed(1)
        processors = PositionWeightedModuleCollection({f"f_{n}": 3 for n in tw})
        fp = FeatureProcessedEmbeddingBagCollection(
            sgd_ebc({n: TABLES[n] for n in tw}, 1, weighted=True), processors
        )
        of = {c: next(s for s in sharders if isinstance(s, c)) for c in (EBCSharder, FPSharder)}
        plans = {
            "ebc": construct_module_sharding_plan(
                ebc, {n: row_wise() for n in rw}, sharder=of[EBCSharder],
                local_size=WORLD, world_size=WORLD, device_type="cpu"),
            "fp": construct_module_sharding_plan(
                fp, {n: table_wise(rank=plan_of[n][1]) for n in tw},
                sharder=of[FPSharder], local_size=WORLD,
                world_size=WORLD, device_type="cpu"),
        }  # fmt: skip
        model = DistributedModelParallel(
            _Two(ebc, fp), device=torch.device("cpu"), plan=ShardingPlan(plans), sharders=sharders
        )
        modules = [m for m in model.modules() if isinstance(m, CompressedShardedEBC)]
        batches = [_TwoBatch(kjt.permute(rw_at), kjt.permute(tw_at))
                   for kjt, _ in (_batch(step, rank) for step in range(STEPS))]  # fmt: skip
        outs, ways = [], []
        if pipelined:  # the dense hook too: the position weights are DDP's parameters
            hook = rt.dense_comm(model, "eb", dp_codec="zstd") if name == "auto" else None
            opt = torch.optim.SGD(processors.parameters(), lr=0.0)
            pipe, left = TrainPipelineSparseDist(model, opt, torch.device("cpu")), iter(batches)
            for _ in range(STEPS):
                outs.append(pipe.progress(left))
                ways.append([m.recsz_sent_plain for m in modules])
            if hook is not None:
                ways.append([hook.plain is not None])
        for batch in batches if not pipelined else []:
            loss, y = model(batch)
            outs.append(y)
            loss.backward()
            ways.append([m.recsz_sent_plain for m in modules])
        key = f"{name}{'_pipelined' if pipelined else ''}"
        out[key] = outs
        # the position weights' gradients (summed over the steps; the pipeline's last step's)
        out[f"{key}_weights"] = [p.grad.clone() for p in processors.parameters()]
        if name == "auto":
            out[f"{key}_ways"] = ways
            out[f"{key}_switches"] = [s.state() for s in rt.switches(model)]
    return out


class _TwoBatch(torchrec.streamable.Pipelineable):
    """The row-wise tables' ids and the table-wise ones', as TorchRec's pipeline takes a
    batch."""

    def __init__(self, a: object, b: object) -> None:
        self.a, self.b = a, b

    def to(self, device: torch.device, non_blocking: bool = False) -> _TwoBatch:
        return self

    def record_stream(self, stream: object) -> None:
        pass


def _dense(rank: int, plan_of: dict) -> dict[str, object]:
    """The dense layer's gradients after a step with DDP's own all-reduce and with
    dense_comm's eb hook under a lossless codec; what a model without DDP gets."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import recsz.torchrec as rt

    out: dict[str, object] = {}
    for mode in ("allreduce", "eb"):
        net = _dmp(EmbeddingBagCollectionSharder(), plan_of, net=True)
        hook = rt.dense_comm(net, "eb", dp_codec="zstd") if mode == "eb" else None
        loss, _ = net(_Batch(*_batch(rank, rank)))  # different data on each rank
        loss.backward()
        out[mode] = [p.grad.clone() for p in net.module.top.parameters()]
        if hook is not None:
            out["sent"] = (hook.bytes_sent, hook.bytes_dense)
    try:
        rt.dense_comm(_dmp(EmbeddingBagCollectionSharder(), plan_of), "bf16")
    except ValueError as e:
        out["no_ddp"] = str(e)
    return out


def _variable_batch(dist: torch.nn.Module) -> tuple[list[object], int]:
    """Variable batch per feature goes to TorchRec's own dist, with one warning."""

    class Ctx:
        variable_batch_per_feature = True

    dist.inner.forward = lambda x, ctx: "torchrec's"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [dist(torch.zeros(2 * B, 8), Ctx()) for _ in range(2)]
    return got, sum("variable batch per feature" in str(w.message) for w in caught)


def _pipeline(rank: int, plan_of: dict) -> dict[str, list[float]]:
    """The losses of a few steps under TorchRec's TrainPipelineSparseDist (the next batch's
    input dist runs before this one's output dist) with stock DMP's sharder and ours."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    import recsz.torchrec as rt

    sharders = {
        "stock": EmbeddingBagCollectionSharder(),
        "lossless": rt.CompressedEBCSharder(fwd_codec="none", bwd_codec="zstd", eb_policy="none"),
        "lossy": rt.CompressedEBCSharder(eb_policy="fixed", fwd_eb=EB, bwd_eb=EB, eb_mode="abs"),
        "auto": rt.CompressedEBCSharder(**AUTO),
    }
    if os.environ.get(DEVICE_PATH_ON_CPU) == "1":  # the lossy codec's pipeline: the host's
        del sharders["lossy"]  # (the same order of dists; half a minute under Triton's interpreter)
    out = {}
    for name, sharder in sharders.items():
        net = _dmp(sharder, plan_of, net=True)
        if name == "auto":  # the dense part's eb hook (lossless) follows each batch's way
            out["auto_ways"] = _ways_logged(net)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        pipe = TrainPipelineSparseDist(net, opt, torch.device("cpu"))
        batches = iter([_Batch(*_batch(s, rank)) for s in range(STEPS)])
        out[name] = [float(pipe.progress(batches)) for _ in range(STEPS)]
    return out


def _ways_logged(net: torch.nn.Module) -> list[list[bool]]:
    """Put dense_comm's eb hook (lossless) on ``net`` and log, as they happen, the ways its
    switch gives batches (True: compressed) and the ways the hook's steps take."""
    import recsz.torchrec as rt

    hook, asked, hooked = rt.dense_comm(net, "eb", dp_codec="zstd"), [], []
    (switch,) = rt.switches(net)
    ask, plain = switch.compress, hook.plain
    assert plain is not None

    def compress(step: int) -> bool:
        asked.append(ask(step))
        return asked[-1]

    def goes_plain() -> bool:
        hooked.append(not plain())
        return not hooked[-1]

    switch.compress, hook.plain = compress, goes_plain  # type: ignore[method-assign]
    return [asked, hooked]


class _Batch(torchrec.streamable.Pipelineable):
    """(kjt, loss weights), as TorchRec's pipeline takes a batch."""

    def __init__(self, kjt: object, w: torch.Tensor) -> None:
        self.kjt, self.w = kjt, w

    def to(self, device: torch.device, non_blocking: bool = False) -> _Batch:
        return self

    def record_stream(self, stream: object) -> None:
        pass


@pytest.fixture(scope="module", params=["host", "device"])
def ranks(request: pytest.FixtureRequest) -> Iterator[list[dict]]:
    """The workers' results, on the codecs' host and device paths (:func:`codec_path`)."""
    with codec_path(request.param):
        yield spawned(_worker, WORLD)


def test_lossless_codecs_give_stock_dmp(ranks: list[dict]) -> None:
    """TW tables of two widths, a CW, a TWCW and two RW tables, several steps of fused SGD:
    the first outputs equal stock DMP's bit for bit (merged bags' rows copied, RW's partial
    sums added as gloo's reduce-scatter adds them), and so do the later ones up to the
    order in which a row's gradients are summed (a merged content's on its sample owner,
    then over ranks by the tables: a few units in the last place)."""
    for res in ranks:
        assert res["dists"] == 4
        assert torch.equal(res["lossless"][0], res["stock"][0])
        for step, (ours, stock) in enumerate(zip(res["lossless"], res["stock"], strict=True)):
            assert (ours - stock).abs().max() < 1e-5, f"step {step}"


def test_table_wise_bags_of_one_content_travel_once(ranks: list[dict]) -> None:
    """One-hot and 0-1-id tables among bags of 1-3 ids: the table-wise dists send a content's
    row once forward and its gradients' sum once back, lossless both ways here (none
    forward: every fp32 byte of what it carries; 0.63-0.79 of the rows' bytes either way
    here; tests/test_torchrec_rows.py checks which rows travel)."""
    for res in ranks:
        raw, wire = res["tw_bytes"]
        assert 0 < wire[0] < 0.85 * raw[0] and 0 < wire[1] < 0.85 * raw[1]


def test_row_wise_sends_only_the_bags_each_rank_filled(ranks: list[dict]) -> None:
    """Forward: a rank's partial sums of bags without ids in its shard (zero) are not sent;
    backward: a rank gets back only the gradient rows of the bags it filled. Here (bags of
    1-3 ids over two shards) about a third of the rows either way, with a lossless forward
    (none: the rows' own bytes) and backward (zstd), and stock DMP's outputs all the same."""
    for res in ranks:
        ((raw_f, wire_f, raw_b, wire_b),) = res["rw_bytes"]
        assert 0.5 * raw_f < wire_f < 0.85 * raw_f
        assert 0 < wire_b < 0.85 * raw_b


def test_row_wise_bags_of_one_content_travel_once(ranks: list[dict]) -> None:
    """The row-wise dist merges too: every step, the one-hot row-wise table t5 had fewer
    contents than the rank's 64 bags (its 70 ids repeat), and stock DMP's outputs all the
    same (the lossless test)."""
    for res in ranks:
        contents = res["rw_contents"]
        assert len(contents) == STEPS and all(0 < t5 < B for t5, _ in contents)
        # the backward's bounds from every bag's gradient, not the contents' sums (whose
        # repeats are zero: a sum's wider range loosened every bound, costing AUC)
        assert res["rw_bound_zero_rows"] == [0] * STEPS


def test_lossy_outputs_within_the_bound_and_bytes_counted(ranks: list[dict]) -> None:
    for res in ranks:
        first = (res["lossy"][0] - res["stock"][0]).abs().max()
        assert 0 < first <= EB  # same weights at step 0: the forward bound
        steps = len(res["lossy"])  # (fewer on the GPU's path: Triton's interpreter)
        later = (res["lossy"][-1] - res["stock"][steps - 1]).abs().max()
        assert later < 0.05  # bounded gradients: the tables stay near stock's
        sent = res["bytes"]
        assert 0.5 < sent["max_err"]["fwd"] <= 1 and 0.5 < sent["max_err"]["bwd"] <= 1
        assert sent["raw"]["fwd"] > 2 * sent["wire"]["fwd"] > 0
        assert sent["raw"]["bwd"] > 2 * sent["wire"]["bwd"] > 0
        assert res["eval_counted"] == [False, False]


def test_a_dmp_users_profile_names_recszs_stages(ranks: list[dict]) -> None:
    """torch's profiler over a DMP step with our sharders: our dists' work is marked as
    recsz's trainer marks its exchange's (its encode, with the bounds; the wait for the
    bytes; the decode), each direction, so a DMP user's trace and `recsz train --profile`
    name them alike."""
    if "ranges" not in ranks[0]:
        pytest.skip("the host path's (a step under Triton's interpreter costs a minute)")
    want = {f"recsz.a2a_{d}.{s}" for d in ("fwd", "bwd") for s in ("encode", "wait", "decode")}
    for res in ranks:
        assert want <= set(res["ranges"]), res["ranges"]


def test_compress_auto_hands_its_plain_steps_to_torchrec(ranks: list[dict]) -> None:
    """compress="auto" with lossless codecs: the trial's steps alternate between our dists
    (bags merged) and TorchRec's (every bag), and the outputs stay stock DMP's; our
    counters hold the compressed steps only, the switch counts both."""
    for res in ranks:
        for step, (ours, stock) in enumerate(zip(res["auto"], res["stock"], strict=True)):
            assert (ours - stock).abs().max() < 1e-5, f"step {step}"
        [switch] = res["auto_bytes"]["compress"].values()
        assert switch["mode"] == "auto" and switch["steps"] == {"compressed": 2, "plain": 2}
        assert switch["trials"] == []  # (the trial ends at step 6, after these)
        raw, wire = res["auto_bytes"]["raw"], res["auto_bytes"]["wire"]
        assert 0 < wire["fwd"] <= raw["fwd"] and 0 < wire["bwd"] < raw["bwd"]


def test_variable_batch_per_feature_falls_back_with_one_warning(ranks: list[dict]) -> None:
    for res in ranks:
        assert res["variable_batch"] == (["torchrec's", "torchrec's"], 1)


def test_a_damaged_forward_payload_is_named_before_its_backward_leaves(
    ranks: list[dict],
) -> None:
    """On the host path the decode names it at once; on the GPU's path its checks ride on
    the backward's read of lengths, which raises before any byte made from it is sent."""
    device = "reads" in ranks[0]
    for rank, res in enumerate(ranks):
        where, msg = res["damaged"]
        assert where == ("backward" if device else "forward"), (where, msg)
        assert f"rank {rank}: fwd payloads" in msg, msg


def test_a_sharding_we_do_not_carry_is_refused_naming_the_table(ranks: list[dict]) -> None:
    """(Table-row-wise and grid tables: tests/multiproc/test_torchrec_twrw.py, four ranks.)"""
    for res in ranks:
        assert "tables t1 are sharded grid_shard" in res["grid_error"]


def test_train_pipeline_sparse_dist_gives_stock_losses(ranks: list[dict]) -> None:
    """Under TorchRec's pipeline each batch's ids reach its own output dist (merged bags
    made from the next batch's ids would change the losses): lossless codecs give stock
    DMP's losses, a lossy one losses near them; with ``compress="auto"`` the dense hook
    takes the way of the batch whose gradients it carries (the switch is a batch ahead)."""
    for res in ranks:
        asked, hooked = res["pipeline"].pop("auto_ways")
        assert hooked == asked[:STEPS] and len(set(hooked)) == 2  # each batch its own way
        got = {k: torch.tensor(v) for k, v in res["pipeline"].items()}
        assert len(got["stock"]) == STEPS
        assert torch.allclose(got["lossless"], got["stock"], rtol=1e-5, atol=1e-4)
        assert torch.allclose(got["auto"], got["stock"], rtol=1e-5, atol=1e-4)
        if "lossy" in got:  # on the host's path
            assert torch.allclose(got["lossy"], got["stock"], rtol=1e-2, atol=0.1)


def test_on_the_gpu_path_each_dist_reads_the_host_six_times_a_step_and_the_ids_once(
    ranks: list[dict],
) -> None:
    """What a GPU would wait for in our dists (counted on the CPU, tests/hostreads.py):
    per dist and direction, the payloads' lengths (one read for every width) and the
    received buffers' tables of lengths (one for every source); the checks' verdicts (one
    for every width) of the backward, while the forward's ride on the backward's lengths;
    and how many contents the bags have, both ends' at once (rows.py). The row-wise dist
    reads how many bags it filled for each rank, and how many each rank filled for it. And
    once a step for the sharded module: the ids left after emptying repeated bags (their
    number). Indices are made once: no host values copied to the device."""
    if "reads" not in ranks[0]:
        pytest.skip("the host path: host reads cost nothing there")
    for r in ranks:
        for reads, where in r["reads"]:
            assert reads == 6 * (r["dists"] - 1) + 7 + 1, where  # one row-wise dist
            assert "read_sizes" in where  # the lengths' read, with the verdicts along
            assert "rowwise.py" in where  # the filled bags' counts
            assert "dist.py" in where and "_context" in where  # the contents' counts
            assert "rows.py" in where and "merged" in where  # the ids kept


def test_the_readme_example_runs_as_written() -> None:
    """examples/torchrec_dlrm.py under torchrun, as the README shows it (fewer steps)."""
    root = Path(__file__).parents[2]
    example = str(root / "examples" / "torchrec_dlrm.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", example, "--steps", "3", "--batch-size", "64"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step    0  loss" in p.stdout and "fwd: " in p.stdout and "bwd: " in p.stdout
    assert "mlp: " in p.stdout  # dense_comm's counters


def test_feature_processed_bags_go_through_our_dists_as_stock(ranks: list[dict]) -> None:
    """TorchRec's position-weighted bags (FeatureProcessedEmbeddingBagCollection, the
    sharder ``recsz.torchrec.sharders()`` gives it wrapping ours): lossless codecs give stock
    DMP's outputs over several steps (bags of one content merge: the same ids in the same
    positions weigh the same)."""
    for res in ranks:
        got = res["feature_processed"]
        assert got["dists"] == [1]
        assert torch.equal(got["ours"][0], got["stock"][0])
        for ours, stock in zip(got["ours"], got["stock"], strict=True):
            # (a content's weighted gradients summed before the update: a few ulps apart)
            assert torch.allclose(ours, stock, rtol=1e-5, atol=1e-5)


def test_managed_collision_tables_go_through_our_dists_as_stock(ranks: list[dict]) -> None:
    """A ManagedCollision-EBC (ids remapped to rows by TorchRec's collection, evicting by
    LFU every 2 steps) under ``recsz.torchrec.sharders()``: lossless codecs give stock DMP's
    outputs (no bag merges: a merged bag's ids would leave the collection's counts), the
    bytes go through our dists, and ``compress="auto"``'s switch takes both ways."""
    for res in ranks:
        got = res["managed_collision"]
        for way in ("ours", "auto"):
            for step, (ours, stock) in enumerate(zip(got[way], got["stock"], strict=True)):
                assert torch.allclose(ours, stock, rtol=1e-5, atol=1e-6), (way, step)
        sent = got["ours_bytes"]
        assert min(sent[k][d] for k in ("raw", "wire") for d in ("fwd", "bwd")) > 0
        (switch,) = got["auto_bytes"]["compress"].values()
        assert switch["steps"]["compressed"] > 0 and switch["steps"]["plain"] > 0


def test_a_models_sharded_modules_share_one_switch(ranks: list[dict]) -> None:
    """An EBC and a feature-processed EBC in one model under ``recsz.torchrec.sharders(
    compress="auto")``: one switch, asked once a batch (its trial's 2 + 2 steps), each batch
    one way in both modules (both ways taken), and stock DMP's outputs and position weights'
    gradients (lossless codecs; DDP reduces those within the backward pass); the same under
    TorchRec's pipeline with our dense hook on DDP."""
    for res, key in itertools.product(ranks, ("auto", "auto_pipelined")):
        got = res["two_modules"]
        stock = key.replace("auto", "stock")
        for ours, theirs in zip(got[f"{key}_weights"], got[f"{stock}_weights"], strict=True):
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), key
        for step, (ours, theirs) in enumerate(zip(got[key], got[stock], strict=True)):
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (key, step)
        (switch,) = got[f"{key}_switches"]
        assert switch["steps"] == {"compressed": 2, "plain": 2}, key
        ways = got[f"{key}_ways"][:STEPS]
        assert [len(set(w)) for w in ways] == [1] * STEPS and len(ways[0]) == 2
        assert [w[0] for w in ways] == [False, True, False, True]
    assert got["auto_pipelined_ways"][STEPS] == [True]  # the dense hook asks the switch


def test_dense_comm_puts_our_hook_on_dmps_ddp(ranks: list[dict]) -> None:
    """recsz.torchrec.dense_comm's eb hook under a lossless codec gives the dense layer the
    gradients DDP's all-reduce gives it (ranks on different data), its bytes counted; a
    DMP without a dense part is refused saying so."""
    for res in ranks:
        d = res["dense"]
        for ours, ddp in zip(d["eb"], d["allreduce"], strict=True):
            assert torch.allclose(ours, ddp, rtol=1e-6, atol=1e-7)
        assert d["sent"][0] > 0 and d["sent"][1] > 0
        assert "holds 0" in d["no_ddp"]


def test_options_the_sharder_does_not_use_are_refused_by_name() -> None:
    """`recsz train` options that no dist reads (id-aware traffic, the MLP hooks, ...) are an
    error, not silently dropped; the ones it reads pass."""
    import recsz.torchrec as rt

    with pytest.raises(ValueError, match="does not use dp_comm, id_dedup"):
        rt.CompressedEBCSharder(id_dedup=True, dp_comm="eb")
    sharder = rt.CompressedEBCSharder(fwd_eb=0.01, decay_t=100, check_bounds=True)
    assert sharder.config.fwd_eb == 0.01 and sharder.config.check_bounds
    # the sequence sharder's own default (the gradients' bounds), which an argument beats
    pooled, sequence = rt.CompressedEBCSharder(), rt.CompressedECSharder()
    assert sequence.config.bwd_class_eb == "0.000333,0.001,0.00167"
    assert sequence.config.class_eb("bwd")["base"] == pooled.config.class_eb("bwd")["base"] / 10
    assert sequence.config.fwd_class_eb == pooled.config.fwd_class_eb
    given = rt.CompressedECSharder(bwd_class_eb="0.01,0.02,0.03", fwd_codec="none")
    assert given.config.bwd_class_eb == "0.01,0.02,0.03" and given.config.fwd_codec == "none"
    with pytest.raises(
        ValueError, match=re.escape("does not use id_dedup (options of `recsz train`)")
    ):
        rt.dense_comm(torch.nn.Linear(1, 1), "eb", id_dedup=True)
    with pytest.raises(ValueError, match=re.escape("does not use dp_bound (not options")):
        rt.dense_comm(torch.nn.Linear(1, 1), "eb", dp_bound=0.1)
    with pytest.raises(ValueError, match="--dp-comm 'zip' is not one of"):
        rt.dense_comm(torch.nn.Linear(1, 1), "zip")


@given(
    rows=st.integers(0, 40),
    features=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_row_bits_round_trip_and_a_damaged_byte_is_caught(
    rows: int, features: int, seed: int
) -> None:
    """The row-wise dist's bits of filled bags (pack_bits / unpack_bits) come back as they
    went, and a flipped byte anywhere fails their checksum or their size."""
    from recsz.torchrec.rowwise import pack_bits, unpack_bits

    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, features, generator=g) < 0.5
    packed = pack_bits(mask)
    back, ok = unpack_bits(packed, (rows, features))
    assert torch.equal(back, mask) and bool(ok)
    at = int(torch.randint(0, packed.numel(), (1,), generator=g))
    bad = packed.clone()
    bad[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
    assert not bool(unpack_bits(bad, (rows, features))[1])
    with pytest.raises(ValueError, match="bytes of row bits"):
        unpack_bits(packed[:-1], (rows, features))


def test_a_feature_that_also_feeds_another_sharding_keeps_its_bags() -> None:
    """A feature of a table-wise table that also feeds a row-wise or data-parallel table
    must reach that table whole: the module then merges no bags (the layout says None);
    otherwise the other shardings' features keep every bag and the table-wise ones' rows
    are found by name, duplicates (column-wise shards) included."""
    from types import SimpleNamespace

    from recsz.torchrec.rows import merge_layout

    def module(*shardings: list[str]) -> list[object]:
        """Sharding 0 table-wise (merged), the others not."""
        return [
            SimpleNamespace(feature_names=lambda n=n: n, recsz_merged=i == 0)
            for i, n in enumerate(shardings)
        ]

    keys = ("a", "b", "c")
    cpu = torch.device("cpu")
    shared = module(["a", "b"], ["b"])  # sharding 1 (not merged) also reads b
    assert merge_layout(shared, keys, cpu) is None
    apart = module(["a", "a", "c"], ["b"])
    layout = merge_layout(apart, keys, cpu)
    assert layout is not None
    assert layout["kept"].tolist() == [False, True, False]
    assert layout["rows"][0].tolist() == [0, 0, 2]


@pytest.mark.parametrize(
    "blob",
    [b"not json", b'{"recsz": 99}', b'{"recsz": 1, "rank": 0}',
     b'{"recsz": 1, "rank": 0, "dists": [3]}', b'{"recsz": 1, "rank": 0, "dists": [{}]}',
     b'{"recsz": 1, "rank": 3, "dists": [], "switch": 3}'],
)  # fmt: skip
def test_a_damaged_sharder_state_is_refused_naming_the_rank(blob: bytes) -> None:
    """What is not the sharder's state (not JSON, another version, no dists, a dist without
    its step, a switch that is not an object) is a ValueError naming the rank, whatever plan
    it meets."""
    from recsz.torchrec import state

    with pytest.raises(ValueError, match=r"recsz: rank 3: the checkpoint's (sharder|switch) state"):
        state.load([], blob, 3)


def test_a_checkpoint_carries_the_sharders_state(ranks: list[dict]) -> None:
    """``dmp.state_dict()`` holds the dists' steps and bound policies: 2 + 2 steps through it
    equal 4 at once, bit for bit; without it (a stock checkpoint) the run differs and says
    so; another rank's restores the steps alone, and says so, as does a checkpoint under
    another sharding plan. A stock DMP's torch.distributed.checkpoint, loaded partially,
    continues as stock DMP would. ``compress="auto"``'s switch goes through it too."""
    if "resumed" not in ranks[0]:
        pytest.skip("run on the host path (the dists' state is the same on both)")
    for r in ranks:
        got = r["resumed"]
        straight = got["straight"][2:]
        outs, said, steps = got["resumed"]
        assert all(torch.equal(a, b) for a, b in zip(straight, outs, strict=True))
        assert said == [] and steps == [2] * len(steps)  # as loaded
        outs, said, steps = got["afresh"]
        assert not all(torch.equal(a, b) for a, b in zip(straight, outs, strict=True))
        assert len(said) == 1 and "holds no sharder state" in said[0] and steps[0] == 0
        outs, said, steps = got["other"]
        assert len(said) == 1 and "sharder state: the step counts are restored" in said[0]
        assert steps == [2] * len(steps)
    # torch.distributed.checkpoint keeps rank 0's blob: rank 0 whole, rank 1 the steps
    for rank, r in enumerate(ranks):
        outs, said, steps = r["resumed"]["dcp"]
        assert steps == [2] * len(steps) and len(said) == rank
        assert not rank or "loads rank 0's sharder state" in said[0]
        # another plan: every rank restores the steps alone (rank 0's own state would give
        # the classes of tables it no longer holds) and says so
        outs, said, steps = r["resumed"]["replanned"]
        assert steps == [2] * len(steps) and len(outs) == 2
        assert len(said) == 1 and "the sharding plan changed since the checkpoint" in said[0]
        # stock DMP's DCP checkpoint: a partial load (as the README says) continues as stock
        got = r["resumed"]
        assert "Missing key in checkpoint state_dict" in got["strict_load"]
        assert "_extra_state" in got["strict_load"]
        for ours, stock in zip(got["from_stock"], got["stock_next"], strict=True):
            assert torch.allclose(ours, stock, rtol=1e-5, atol=1e-6)
        # compress="auto": a fresh DMP loaded from one that trained 8 batches has its
        # batches, trials, way and counts (so no trial of its own at its first batch)
        (batches, state), (batches_again, state_again) = got["switch"]
        assert batches == batches_again == [8] and state_again == state
        assert len(state["trials"]) == 1 and sum(state["steps"].values()) == 8
