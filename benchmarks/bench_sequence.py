"""Sequence embeddings (TorchRec's EmbeddingCollection) under DMP: stock against our sharder.

A model of user histories: ``--features`` sequence features (``--rows`` ids each, dim
``--dim``), each sample 0 to 2 x ``--mean-len`` ids a feature drawn from a Zipf law (popular
items repeat, as in real histories), mean-pooled into an MLP; labels from hidden per-id
weights, so that the embeddings have something to learn. Table-wise, tables dealt over
the ranks; row-wise Adagrad fused into the backward (TorchRec's); DDP on the MLP. Each
configuration runs under torchrun on 2 gloo ranks, on loopback shaped to each rate (root:
a network namespace, as ``bench_train.py``), the same batches for all:

- ``stock-fp32``: TorchRec's ``EmbeddingCollectionSharder``;
- ``stock-bf16``: with TorchRec's quantized comms (fbgemm's bf16 both ways);
- ``recsz``: ``recsz.torchrec.CompressedECSharder()`` (hybrid both ways, dual bounds);
- ``recsz-auto``: the same with ``compress="auto"`` (plain where that is faster);
- not run by default: ``recsz-lossless`` (our dists, codec ``none``: stock's losses),
  ``recsz-tight`` (bounds a tenth of the defaults), ``recsz-fwd`` (the forward alone
  compressed).

Prints samples/s, bytes on the wire a step (all ranks; stock: the rows that cross ranks at
4 or 2 bytes a value) and the last 5 steps' mean loss; writes JSON and Markdown::

    python benchmarks/bench_sequence.py --rates unshaped,1gbit,200mbit \\
        --json benchmarks/results/session27/sequence.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = ("stock-fp32", "stock-bf16", "recsz", "recsz-auto")


def _batches(args: argparse.Namespace, rank: int, world: int) -> list[tuple]:
    """This rank's batches: (KJT, labels), drawn from the step and rank."""
    import numpy as np
    from torchrec import KeyedJaggedTensor

    keys = [f"s{i}" for i in range(args.features)]
    hidden = np.random.default_rng(0).standard_normal(args.rows).astype(np.float32)
    out = []
    b = args.batch // world
    for step in range(args.steps):
        g = np.random.default_rng(1000 * step + rank)
        lengths = g.integers(0, 2 * args.mean_len + 1, size=args.features * b)
        ids = (g.zipf(args.zipf, size=int(lengths.sum())) - 1) % args.rows
        # label: a sample's mean hidden weight over its first feature's ids, thresholded
        first = np.split(ids[: int(lengths[:b].sum())], np.cumsum(lengths[:b])[:-1])
        score = np.array([hidden[x].mean() if len(x) else 0.0 for x in first])
        labels = torch.tensor(score > 0, dtype=torch.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths).int()
        )
        out.append((kjt, labels))
    return out


class _Net(torch.nn.Module):
    """Mean-pooled sequence features into an MLP (the EC is what DMP shards)."""

    def __init__(self, ec: torch.nn.Module, features: int, dim: int) -> None:
        super().__init__()
        self.ec, self.keys = ec, [f"s{i}" for i in range(features)]
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(features * dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
        )

    def forward(self, kjt: object, b: int) -> torch.Tensor:
        got = self.ec(kjt)
        pooled = []
        for k in self.keys:
            jt = got[k]
            lengths = jt.lengths().long()
            at = torch.repeat_interleave(torch.arange(b), lengths)
            sums = torch.zeros(b, jt.values().shape[1]).index_add_(0, at, jt.values())
            pooled.append(sums / lengths.clamp(min=1).unsqueeze(1))
        return self.mlp(torch.cat(pooled, 1)).squeeze(1)


def _sharder(config: str) -> object:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    if config == "stock-fp32":
        return EmbeddingCollectionSharder()
    if config == "stock-bf16":
        from torchrec.distributed.fbgemm_qcomm_codec import (
            CommType,
            QCommsConfig,
            get_qcomm_codecs_registry,
        )

        bf16 = QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16)
        return EmbeddingCollectionSharder(qcomm_codecs_registry=get_qcomm_codecs_registry(bf16))
    import recsz.torchrec as rt

    options = {
        "recsz": {},
        "recsz-auto": {"compress": "auto"},
        "recsz-lossless": {"fwd_codec": "none", "bwd_codec": "none", "eb_policy": "none"},
        "recsz-tight": {f"{d}_class_eb": "0.000333,0.001,0.00167" for d in ("fwd", "bwd")},
        "recsz-fwd": {"bwd_codec": "none"},
    }
    return rt.CompressedECSharder(**options[config])


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration (under torchrun); rank 0 writes ``summary.json``."""
    import torch.distributed as dist
    from torchrec import EmbeddingCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import recsz.torchrec as rt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(
            name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"s{i}"]
        )
        for i in range(args.features)
    ]
    ec = EmbeddingCollection(tables=tables)
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": args.lr})
    net = _Net(ec, args.features, args.dim)
    sharder = _sharder(args.config)
    plan = construct_module_sharding_plan(
        ec, {f"t{i}": table_wise(rank=i % world) for i in range(args.features)},
        sharder=sharder, local_size=world, world_size=world, device_type="cpu",
    )  # fmt: skip
    model = DistributedModelParallel(
        net, device=torch.device("cpu"), plan=ShardingPlan({"ec": plan}), sharders=[sharder]
    )
    opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if "mlp" in n], lr=args.lr)
    batches = _batches(args, rank, world)
    b = args.batch // world
    # stock's bytes: the rows of my samples' ids in tables on other ranks, both ways
    crossing = sum(
        int(kjt.lengths()[i * b : (i + 1) * b].sum())
        for kjt, _ in batches[args.warmup :]
        for i in range(args.features)
        if i % world != rank
    )
    losses, t0 = [], 0.0
    for step, (kjt, labels) in enumerate(batches):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(kjt, b), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    dist.barrier()
    secs = time.perf_counter() - t0
    timed = args.steps - args.warmup
    if args.config.startswith("recsz"):
        sent = rt.comm_bytes(model)
        # (counted over every step)
        wire, raw = (sum(sent[k].values()) * timed / args.steps for k in ("wire", "raw"))
        steps = [s["steps"] for s in sent["compress"].values()]
    else:
        per_value = 2 if args.config == "stock-bf16" else 4
        wire, raw, steps = 2 * crossing * args.dim * per_value, 2 * crossing * args.dim * 4, []
    totals = torch.tensor([float(wire), sum(losses[-5:]) / 5, float(raw)])
    dist.all_reduce(totals)
    if rank == 0:
        summary = {
            "config": args.config,
            "samples_per_s": args.batch * timed / secs,
            "wire_mb_per_step": float(totals[0]) / timed / 1e6,
            "fp32_mb_per_step": float(totals[2]) / timed / 1e6,
            "loss_last5": float(totals[1]) / world,
            "switch_steps": steps,
        }
        Path(args.out, "summary.json").write_text(json.dumps(summary))
    del model, net, ec, opt, batches  # freed while the interpreter is whole
    gc.collect()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="unshaped,1gbit,200mbit")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--features", type=int, default=4)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--mean-len", type=int, default=20)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--batch", type=int, default=1024, help="global batch")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--json", default="benchmarks/results/sequence.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="recsz", help=argparse.SUPPRESS)
    p.add_argument("--out", default=".", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import can_shape, shaped
    from results_io import write_results

    rates = args.rates.split(",")
    if any(r != "unshaped" for r in rates) and (why := can_shape()):
        raise SystemExit(f"cannot shape the link here: {why}")
    keep = ["--features", "--rows", "--dim", "--mean-len", "--zipf", "--batch", "--steps",
            "--warmup", "--lr"]  # fmt: skip
    common = [f for k in keep for f in (k, str(getattr(args, k[2:].replace("-", "_"))))]
    rows = []
    for rate in rates:
        with shaped(None if rate == "unshaped" else rate) as prefix:
            for config in args.configs.split(","):
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", __file__, "--worker", "--config", config,
                           "--out", tmp, *common]  # fmt: skip
                    env = {**os.environ, "OMP_NUM_THREADS": "1"}
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    summary = Path(tmp, "summary.json")
                    # (gloo or TorchRec at interpreter exit, stock's runs too, now and then:
                    # "terminate called without an active exception" after the summary)
                    if done.returncode and not summary.exists():
                        raise RuntimeError(f"{config} at {rate}:\n{done.stderr[-3000:]}")
                    row = {"rate": rate, **json.loads(summary.read_text())}
                    row["exit_code"] = done.returncode
                print(row, flush=True)
                rows.append(row)
    table = "| rate | config | samples/s | wire MB/step | loss (last 5) | x stock best |\n"
    table += "|---|---|---|---|---|---|\n"
    for rate in rates:
        at = [r for r in rows if r["rate"] == rate]
        best = max((r["samples_per_s"] for r in at if r["config"].startswith("stock")), default=0)
        for r in at:
            vs = f"{r['samples_per_s'] / best:.2f}x" if best else "-"
            speed, wire, loss = r["samples_per_s"], r["wire_mb_per_step"], r["loss_last5"]
            table += f"| {rate} | {r['config']} | {speed:,.0f} | {wire:.2f} | {loss:.4f} | {vs} |\n"
    write_results(rows, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
