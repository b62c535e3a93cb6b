"""TorchRec's own DistributedModelParallel on our model, data and link: the anchor run.

Launched by ``bench_train.py`` (configs ``trdmp-*``) under torchrun, one process per rank:

    torchrun --nproc-per-node 2 benchmarks/torchrec_dmp.py --precision bf16 --out DIR

Same model shape as the ``bench`` preset (26 tables of dim 64 hashed to 50k rows, bottom
13-512-256-64, top 512-512-256-1, TorchRec's DLRM with its dot interaction, or its
``DLRM_DCN`` with ``--interaction dcn``), same synthetic
data, seed, global batch and steps as our runs; table-wise sharding (planner constrained;
``--sharding rw``: row-wise, every table's rows split over the ranks, its output a
reduce-scatter of partial sums and its backward an all-gather; ``--sharding twrw``:
table-row-wise over ``--hosts`` hosts of world / hosts ranks (``LOCAL_WORLD_SIZE``), each
table's rows split over one host's ranks, tables dealt to the hosts in turn: a
reduce-scatter within the host, then an all-to-all between hosts, which is all our
sharder compresses),
TorchRec's quantized comms (fbgemm ``QuantizedCommCodec``) on the embedding all-to-alls in
both directions (``--precision hybrid``: recsz's sharder instead, ``recsz.torchrec``: the
hybrid codec under dual bounds both ways, bytes counted rather than computed), DDP on the
MLPs, SGD on the dense part and fbgemm's fused row-wise Adagrad
on the tables (TorchRec's CPU embedding kernel; the bench preset's tables take row-wise
Adagrad in our runs too). Writes ``summary.json`` with the keys ``bench_train.py``
reads; ``--eval-every N`` adds the held-out AUC each N steps (``curve``) and
``--target-auc A`` stops at the first that reaches A (``bench_tta.py``). Needs the
``anchors`` extra plus TorchRec itself (``make anchors``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import roc_auc_score

from recsz.comm.dp_hooks import DP_MODES
from recsz.config import TrainConfig
from recsz.data.source import Part, make_source
from recsz.model.config import ModelConfig, dense_optimizer
from recsz.model.multihot import Bags, mlperf_draws, parse_hotness

# Bytes per element on the wire for each precision (MX4: 4-bit values plus one shared
# 8-bit exponent per 32 elements).
_WIRE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "mx4": 0.5 + 1 / 32}
_SHARDINGS = {"tw": "table_wise", "rw": "row_wise", "twrw": "table_row_wise"}


def host_groups(link: str, local: int, hosts: int) -> None:
    """TorchRec's process groups within a host (on the interface ``link``: bench_train.py's
    unshaped address, as NVLink) and between hosts (the world's, shaped), made here as
    TorchRec makes them (``intra_and_cross_node_pg``), which then takes them."""
    import torchrec.distributed.comm as trcomm

    rank = dist.get_rank()
    os.environ["GLOO_SOCKET_IFNAME"] = link  # read as each group is made
    for h in range(hosts):
        group = dist.new_group([h * local + r for r in range(local)])
        if rank // local == h:
            trcomm._INTRA_PG = group
    del os.environ["GLOO_SOCKET_IFNAME"]
    for r in range(local):
        group = dist.new_group([r + h * local for h in range(hosts)])
        if rank % local == r:
            trcomm._CROSS_PG = group


def torchrec_dlrm(
    mcfg: ModelConfig, sharder: Any, sharding: str = "table_wise", hosts: int = 1
) -> Any:
    """TorchRec's DLRM of ``mcfg``'s shape (``DLRM_DCN`` for the dcn interaction; tables
    ``t{i}`` of features ``f{i}``, sum-pooled), drawn from torch's generator, under DMP on
    the process group with every table sharded ``sharding`` (TorchRec's name) under
    ``sharder`` (as on many ranks: fused optimizer); table-row-wise tables dealt to
    ``hosts`` hosts in turn."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=mcfg.emb_dim,
            num_embeddings=rows,
            feature_names=[f"f{i}"],
            pooling=PoolingType.SUM,
        )
        for i, rows in enumerate(mcfg.table_sizes)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    mlps = {
        "embedding_bag_collection": ebc,
        "dense_in_features": mcfg.n_dense,
        "dense_arch_layer_sizes": list(mcfg.bottom_mlp),
        "over_arch_layer_sizes": list(mcfg.top_mlp),
    }
    if mcfg.interaction == "dcn":
        dcn = {"dcn_num_layers": mcfg.dcn_layers, "dcn_low_rank_dim": mcfg.dcn_rank}
        model = DLRM_DCN(**mlps, **dcn)
    else:
        model = DLRM(**mlps)
    world = dist.get_world_size()
    if sharding != "table_wise":  # placed by hand: the planner offers these on GPUs only
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.sharding_plan import (
            construct_module_sharding_plan,
            row_wise,
            table_row_wise,
        )
        from torchrec.distributed.types import ShardingPlan

        fused = EmbeddingComputeKernel.FUSED.value  # the fused optimizer, as the planner's TW

        def twrw(host: int) -> Any:  # (TorchRec's helper takes no compute kernel)
            gen = table_row_wise(host_index=host)
            return lambda *a, **kw: dataclasses.replace(gen(*a, **kw), compute_kernel=fused)

        per_table = {
            t.name: row_wise(compute_kernel=fused) if sharding == "row_wise" else twrw(i % hosts)
            for i, t in enumerate(tables)
        }
        ebc_plan = construct_module_sharding_plan(
            ebc,
            per_table,
            sharder=sharder,
            local_size=world // hosts,
            world_size=world,
            device_type="cpu",
        )
        plan = ShardingPlan({"sparse_arch.embedding_bag_collection": ebc_plan})
    else:
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"),
            constraints={
                t.name: ParameterConstraints(sharding_types=[ShardingType(sharding).value])
                for t in tables
            },
        )
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )


def bag_kjt(bags: Bags, hotness: Sequence[int], one_hot: torch.Tensor) -> Any:
    """The samples' bags (made from their one-hot ids (B, T) as ours are), feature by
    feature: TorchRec's KeyedJaggedTensor of features ``f{i}``."""
    from torchrec import KeyedJaggedTensor

    ids = bags.ids(one_hot.long()).split(list(hotness), dim=1)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(hotness))],
        values=torch.cat([i.reshape(-1) for i in ids]).int(),  # ids < 2^31: as users send them
        lengths=torch.tensor(hotness, dtype=torch.int32).repeat_interleave(one_hot.shape[0]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bf16", choices=[*sorted(_WIRE_BYTES), "hybrid"])
    ap.add_argument(
        "--autocast", action="store_true", help="the dense part under bfloat16 torch.autocast"
    )
    ap.add_argument(
        "--sharding", default="tw", choices=list(_SHARDINGS), help="table-, row-, table-row-wise"
    )
    ap.add_argument("--hosts", type=int, default=2, help="twrw: hosts the ranks form")
    ap.add_argument(
        "--intra",
        default="fp32",
        choices=["fp32", "fp16", "bf16"],
        help="hybrid, twrw: TorchRec's precision for the reduce-scatter within a host",
    )
    ap.add_argument(
        "--dp-comm",
        default="allreduce",
        choices=DP_MODES,
        help="the dense part's DDP hook (recsz.torchrec.dense_comm; allreduce: DDP's own)",
    )
    ap.add_argument(
        "--sharder-opts",
        type=json.loads,
        default={},
        help='hybrid: JSON of the sharder\'s options over eb_policy="dual" (e.g. '
        '\'{"bwd_codec": "none"}\', \'{"decay_c": 1.0}\')',
    )
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic-eval", type=int, default=8192)
    ap.add_argument("--eval-batch-size", type=int, default=4096)
    ap.add_argument(
        "--eval-every", type=int, default=0, help="held-out AUC each N steps too (summary's curve)"
    )
    ap.add_argument(
        "--target-auc", type=float, help="stop at the first evaluation reaching it (recsz's)"
    )
    ap.add_argument("--multi-hot", default="", help="recsz train's --multi-hot: the same bags")
    ap.add_argument(
        "--multi-hot-draws", default="hash", help="recsz train's: the same bags' other ids"
    )
    ap.add_argument("--emb-lr", type=float, help="the tables' learning rate (default: ours)")
    ap.add_argument("--interaction", default="dot", help="recsz train's: dot or dcn (DLRM_DCN)")
    ap.add_argument("--table-rows", help="recsz train's: the tables' rows (default: preset's)")
    ap.add_argument("--dense-features", type=int, help="recsz train's: dense inputs (13)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = world // a.hosts  # ranks a host (TorchRec reads it when it shards)
    if a.sharding == "twrw":
        if a.hosts < 2 or world % a.hosts:
            raise SystemExit(f"--hosts {a.hosts}: need 2 or more hosts dividing {world} ranks")
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
        if link := os.environ.get("RECSZ_HOST_LINK"):
            host_groups(link, local, a.hosts)
    torch.manual_seed(a.seed)
    # our model and defaults where none is given (the preset's; the tables' rate less with bags)
    ours = TrainConfig(preset=a.preset, interaction=a.interaction, multi_hot=a.multi_hot,
                       table_rows=a.table_rows, dense_features=a.dense_features)  # fmt: skip
    mcfg = ours.model()
    n_tables = len(mcfg.table_sizes)
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": a.emb_lr or ours.resolved("emb_lr"),
    }
    import recsz.torchrec  # (imports TorchRec)

    if a.precision == "hybrid":  # recsz's sharder: the hybrid codec, dual bounds both ways
        options = {"eb_policy": "dual", **a.sharder_opts}
        if a.intra != "fp32":  # TorchRec's comms where ours are not (twrw: within a host)
            precision = CommType[a.intra.upper()]
            options["qcomm_codecs_registry"] = get_qcomm_codecs_registry(
                QCommsConfig(forward_precision=precision, backward_precision=precision)
            )
        sharder = recsz.torchrec.CompressedEBCSharder(fused_params=fused, **options)
    else:
        precision = CommType[a.precision.upper()]
        sharder = EmbeddingBagCollectionSharder(
            fused_params=fused,
            qcomm_codecs_registry=get_qcomm_codecs_registry(
                QCommsConfig(forward_precision=precision, backward_precision=precision)
            ),
        )
    dmp = torchrec_dlrm(mcfg, sharder, _SHARDINGS[a.sharding], a.hosts)
    dense_hook = None
    if a.dp_comm != "allreduce":
        dense_hook = recsz.torchrec.dense_comm(dmp, a.dp_comm)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = dense_optimizer(
        ours.resolved("dense_optimizer"), dense_params.values(), ours.resolved("lr")
    )

    src = make_source("synthetic", mcfg.table_sizes, a.seed, n_dense=mcfg.n_dense)
    src.n_eval = a.synthetic_eval  # type: ignore[attr-defined]
    b = a.batch_size // world
    hotness = parse_hotness(a.multi_hot, n_tables) or (1,) * n_tables
    draws = None
    if a.multi_hot_draws == "mlperf":  # MLPerf's reference's bags, as ours then are
        draws = mlperf_draws(mcfg.table_sizes, hotness, range(n_tables))
    bags = Bags(range(n_tables), hotness, mcfg.table_sizes, [0] * n_tables, draws)  # ours

    def evaluate() -> float:
        """The held-out AUC, the same on every rank: each rank scores its part of each
        batch, and every rank gathers them all."""
        preds, labels = [], []
        with torch.no_grad():
            eb = a.eval_batch_size // world * world
            for batch in src.eval_batches(eb):
                n = len(batch) // world * world
                if n == 0:
                    continue
                k = n // world
                mine = batch.slice(rank * k, (rank + 1) * k)
                with torch.autocast("cpu", torch.bfloat16, enabled=a.autocast):
                    logits = dmp(mine.dense, bag_kjt(bags, hotness, mine.ids)).view(-1)
                    p = torch.sigmoid(logits.float())
                gathered = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(gathered, p)
                preds.append(torch.cat(gathered).double().numpy())
                labels.append(batch.labels[:n].double().numpy())
        return float(roc_auc_score(np.concatenate(labels), np.concatenate(preds)))

    def mean_over_ranks(x: float) -> float:
        t = torch.tensor([x])
        dist.all_reduce(t)
        return float(t) / world

    loss_fn = torch.nn.BCEWithLogitsLoss()
    train_s = 0.0
    curve: list[dict[str, float]] = []  # --eval-every: step, training seconds, AUC
    reached = None
    steps = a.steps
    for step in range(a.steps):
        # its own samples only: TorchRec's input dist sends the table owners their ids
        batch = src.train_batch(step, a.batch_size, Part(rank, world, ()))
        mine = batch.slice(rank * b, (rank + 1) * b)
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=a.autocast):
            logits = dmp(mine.dense, bag_kjt(bags, hotness, mine.ids)).view(-1)
        loss = loss_fn(logits.float(), mine.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_s += time.perf_counter() - t0
        done = step + 1
        if a.eval_every and (done % a.eval_every == 0 or done == a.steps):
            auc = evaluate()
            curve.append({"step": done, "train_s": mean_over_ranks(train_s), "auc": auc})
            if a.target_auc is not None and auc >= a.target_auc:
                reached, steps = done, done
                break

    train_s = mean_over_ranks(train_s)
    final_auc = curve[-1]["auc"] if curve else evaluate()
    per_step = a.batch_size * n_tables * mcfg.emb_dim * 4 * 2  # fwd + bwd, fp32
    raw = steps * per_step
    # (pooled: one vector a bag, whatever its ids). Table-row-wise: within each host its
    # ranks' partial sums of the global batch reduce-scattered (each rank sends
    # (local - 1) / local of them, in TorchRec's precision: beside our sharder, which
    # carries only the hop between hosts, --intra's), then (hosts - 1) / hosts of what a
    # rank holds to the other hosts; TorchRec's reduce-scatter takes no FP8 or MX4 (FP16 /
    # BF16 instead).
    theirs = a.intra if a.precision == "hybrid" else a.precision
    intra = raw * (local - 1) * max(_WIRE_BYTES[theirs], 2.0) / 4 if a.sharding == "twrw" else 0

    def fixed(precision: str, steps: int) -> float:
        """Bytes a fixed-size codec sends in ``steps`` steps, all ranks: computed."""
        per_element, share = _WIRE_BYTES[precision], (world - 1) / world
        if a.sharding == "rw":
            # Every rank's partial sums of the global batch go to every other rank, and the
            # gradients back (FP16 / BF16 at the least, as above).
            per_element, share = max(per_element, 2.0), world - 1
        if a.sharding == "twrw":
            share = (a.hosts - 1) / a.hosts
        return steps * per_step / 4 * per_element * share

    switch: dict[str, Any] = {}
    if a.precision == "hybrid":  # counted: payload bytes that left each rank, all ranks
        sent = recsz.torchrec.comm_bytes(dmp)
        counts = torch.tensor([float(sent[k][d]) for k in ("raw", "wire") for d in ("fwd", "bwd")])
        dist.all_reduce(counts)
        raw_f, raw_b, wire_f, wire_b = counts.tolist()
        # compress="auto": the steps sent plain went through TorchRec's fp32 dist
        switch = next(iter(sent["compress"].values()), {})
        plain = switch.get("steps", {}).get("plain", 0)
        raw_p, wire_p = plain * per_step / 2 * (world - 1) / world, fixed("fp32", plain) / 2
        wire = wire_f + wire_b + 2 * wire_p + intra
        ratios = ((raw_f + raw_p) / (wire_f + wire_p), (raw_b + raw_p) / (wire_b + wire_p))
    else:  # fixed-size codecs: computed
        wire = fixed(a.precision, steps) + intra
        ratios = (4 / _WIRE_BYTES[a.precision],) * 2
    if rank == 0:
        nan = float("nan")
        summary = {
            "steps": steps,
            "samples_per_s": steps * a.batch_size / train_s,
            "train_s": train_s,
            "auc": final_auc,
            "curve": curve,
            "reached_target_at": reached,
            "bytes_sent": round(wire),
            "fwd_ratio": ratios[0],
            "bwd_ratio": ratios[1],
            "a2a_fwd_s": nan,
            "a2a_bwd_s": nan,
            "codec_s": nan,
            "allreduce_s": nan if dense_hook is None else dense_hook.seconds,
            "compute_s": nan,
            "bytes_estimated": a.precision != "hybrid",
            "compress": switch,
        }
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of fbgemm's threads


if __name__ == "__main__":
    main()
