"""Sequence embeddings (TorchRec's EmbeddingCollection) under DMP: stock against our sharder.

A model of user histories: ``--features`` sequence features (``--rows`` ids each, dim
``--dim``), each sample 0 to 2 x ``--mean-len`` ids a feature drawn from a Zipf law (popular
items repeat, as in real histories), mean-pooled into an MLP; labels from hidden per-id
weights, so that the embeddings have something to learn. Table-wise, tables dealt over
the ranks; row-wise Adagrad fused into the backward (TorchRec's); DDP on the MLP. Each
configuration runs under torchrun on 2 gloo ranks, on loopback shaped to each rate (root:
a network namespace, as ``bench_train.py``), the same batches for all:

- ``stock-fp32``: TorchRec's ``EmbeddingCollectionSharder``;
- ``stock-bf16``: with TorchRec's quantized comms (fbgemm's bf16 both ways); not run by
  default, its others: ``stock-fp16``, ``stock-int8`` (forward; bf16 back), ``stock-mx4``
  (both ways), ``stock-fp8`` (forward; on the CPU TorchRec 1.8's sequence all-to-all
  refuses it: "Tensor 'input' must have 2 dimension(s)");
- ``recsz``: ``recsz.torchrec.CompressedECSharder()`` (hybrid both ways, dual bounds, its
  gradients' a tenth of the pooled sharder's);
- ``recsz-auto``: the same with ``compress="auto"`` (plain where that is faster);
- not run by default: ``recsz-lossless`` (our dists, codec ``none``: stock's losses),
  ``recsz-tight`` (bounds a tenth of the defaults), ``recsz-fwd`` (the forward alone
  compressed), ``recsz-pooled-bounds`` (the gradients under the pooled sharder's
  bounds, ten times the sequence sharder's default; the twenty-eighth session's results
  call these ``recsz``, and the default ``recsz-bwd-tight``), ``recsz-auto-int8``
  (``compress="auto"`` whose plain batches take TorchRec's int8 comms).

Prints samples/s, bytes on the wire a step (all ranks; stock: the rows that cross ranks at
4 or 2 bytes a value), the last 5 steps' mean loss and the AUC on held-out batches (with
several ``--seeds``, each configuration's AUC and log loss against stock-fp32's on the same
seed); writes JSON and Markdown::

    python benchmarks/bench_sequence.py --rates unshaped,1gbit,200mbit \\
        --json benchmarks/results/session28/sequence_rates.json
    python benchmarks/bench_sequence.py --rates unshaped --seeds 0,1,2,3,4,5 --steps 200 \\
        --configs stock-fp32,recsz --json benchmarks/results/session28/sequence_seeds.json

``--count``: no timing; the GPU's code path on the CPU (``RECSZ_DEVICE_PATH_ON_CPU=1``,
Triton's interpreter), each rank's host reads and launches a step counted
(:mod:`tests.hostreads`), unshaped::

    python benchmarks/bench_sequence.py --count --rates unshaped --configs stock-fp32,recsz \
        --features 16 --batch 256 --steps 16 --warmup 13 \
        --json benchmarks/results/session29/sequence_counts.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = ("stock-fp32", "stock-bf16", "recsz", "recsz-auto")
#: TorchRec's quantized comms (fbgemm's codecs), forward and backward precision
STOCK_COMMS = {"stock-bf16": ("bf16", "bf16"), "stock-fp16": ("fp16", "fp16"),
               "stock-fp8": ("fp8", "bf16"), "stock-int8": ("int8", "bf16"),
               "stock-mx4": ("mx4", "mx4")}  # fmt: skip


def _batches(
    args: argparse.Namespace, rank: int, world: int, steps: range | None = None
) -> list[tuple]:
    """This rank's batches of ``steps`` (default: the training steps): (KJT, labels),
    drawn from the step, rank and seed (the hidden weights: the same task for every seed)."""
    import numpy as np
    from torchrec import KeyedJaggedTensor

    keys = [f"s{i}" for i in range(args.features)]
    hidden = np.random.default_rng(0).standard_normal(args.rows).astype(np.float32)
    out = []
    b = args.batch // world
    for step in range(args.steps) if steps is None else steps:
        g = np.random.default_rng([args.seed, 1000 * step + rank])
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


def _qcomms(config: str) -> dict:
    """TorchRec's codecs registry for ``config``'s comm precisions (:data:`STOCK_COMMS`)."""
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    fwd, bwd = (CommType(p) for p in STOCK_COMMS[config])
    qcomms = QCommsConfig(forward_precision=fwd, backward_precision=bwd)
    return get_qcomm_codecs_registry(qcomms)  # type: ignore[return-value]


def _sharder(config: str) -> object:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    if config == "stock-fp32":
        return EmbeddingCollectionSharder()
    if config in STOCK_COMMS:
        return EmbeddingCollectionSharder(qcomm_codecs_registry=_qcomms(config))
    import recsz.torchrec as rt
    from recsz.config import TrainConfig

    options = {
        "recsz": {},
        "recsz-auto": {"compress": "auto"},
        "recsz-lossless": {"fwd_codec": "none", "bwd_codec": "none", "eb_policy": "none"},
        "recsz-tight": {f"{d}_class_eb": "0.000333,0.001,0.00167" for d in ("fwd", "bwd")},
        "recsz-fwd": {"bwd_codec": "none"},
        "recsz-pooled-bounds": {"bwd_class_eb": TrainConfig().bwd_class_eb},
        # plain batches through TorchRec's dist with its int8 comms
        "recsz-auto-int8": {"compress": "auto", "qcomm_codecs_registry": _qcomms("stock-int8")},
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
    torch.manual_seed(args.seed)
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
    if args.count:
        counts = _counted(model, opt, batches, b, args.warmup)
        every: list[object] = [None] * world
        dist.all_gather_object(every, counts)
        if rank == 0:
            summary = {"config": args.config, "seed": args.seed, "per_rank": every}
            Path(args.out, "summary.json").write_text(json.dumps(summary))
        dist.destroy_process_group()
        return
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
    held_out = _batches(args, rank, world, range(args.steps, args.steps + args.eval_batches))
    auc, logloss = _evaluated(model, held_out, b)
    if args.config.startswith("recsz"):
        sent = rt.comm_bytes(model)
        # (counted over every step)
        wire, raw = (sum(sent[k].values()) * timed / args.steps for k in ("wire", "raw"))
        steps = [s["steps"] for s in sent["compress"].values()]
    else:
        comms = STOCK_COMMS.get(args.config, ("fp32", "fp32"))
        per_row = sum(_row_bytes(p, args.dim) for p in comms)
        wire, raw, steps = crossing * per_row, 2 * crossing * args.dim * 4, []
    totals = torch.tensor([float(wire), sum(losses[-5:]) / 5, float(raw)])
    dist.all_reduce(totals)
    if rank == 0:
        summary = {
            "config": args.config,
            "samples_per_s": args.batch * timed / secs,
            "wire_mb_per_step": float(totals[0]) / timed / 1e6,
            "fp32_mb_per_step": float(totals[2]) / timed / 1e6,
            "loss_last5": float(totals[1]) / world,
            "seed": args.seed,
            "eval_auc": auc,
            "eval_logloss": logloss,
            "switch_steps": steps,
        }
        Path(args.out, "summary.json").write_text(json.dumps(summary))
    del model, net, ec, opt, batches  # freed while the interpreter is whole
    gc.collect()
    dist.destroy_process_group()


def _counted(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, b: int, warm: int
) -> dict[str, float]:
    """Training steps on the GPU's path (``--count``: ``RECSZ_DEVICE_PATH_ON_CPU=1``, Triton's
    interpreter) with :mod:`tests.hostreads` counting, per step after ``warm``: the host
    reads recsz makes outside the sharder's input dist (each a GPU's wait), every host read
    (TorchRec's input dist's and the benchmark model's too) and every launch; the last
    step's launches by operation (``last``)."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.hostreads import counting, mark

    got: dict[str, list[int]] = {"ours": [], "reads": [], "launches": []}
    with counting(list(model.parameters())) as c:
        for step, (kjt, labels) in enumerate(batches):
            mark([kjt.values(), kjt.lengths(), labels])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(kjt, b), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            reads, launches = c.total(), sum(c.launches.values())
            kinds = c.launches.most_common()
            ours, _ = c.ours_after_input_dist()  # (counting starts again)
            if step >= warm:
                for k, n in zip(got, (ours, reads, launches), strict=True):
                    got[k].append(n)
    return {**{f"{k}_per_step": statistics.mean(v) for k, v in got.items()}, "last": kinds}


def _row_bytes(precision: str, dim: int) -> float:
    """A row's bytes in one of TorchRec's comm precisions (fbgemm's formats: int8 rows
    carry a float32 scale and bias; MX4 a shared 8-bit exponent every 32 values)."""
    per_value = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "mx4": 0.5}[precision]
    extra = {"int8": 8, "mx4": math.ceil(dim / 32)}.get(precision, 0)
    return dim * per_value + extra


def _evaluated(model: torch.nn.Module, batches: list[tuple], b: int) -> tuple[float, float]:
    """AUC and log loss over every rank's held-out ``batches`` (no gradient: the dists'
    forward only, under their bounds)."""
    import numpy as np
    import torch.distributed as dist
    from sklearn.metrics import log_loss, roc_auc_score

    with torch.no_grad():
        scores = torch.cat([torch.sigmoid(model(kjt, b)) for kjt, _ in batches])
    labels = torch.cat([y for _, y in batches])
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (scores.numpy(), labels.numpy()))
    p = np.concatenate([s for s, _ in every])  # type: ignore[misc]
    y = np.concatenate([y for _, y in every])  # type: ignore[misc]
    return float(roc_auc_score(y, p)), float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7)))


def _counts_table(rows: list[dict]) -> str:
    """``--count``'s rows: each rank's reads and launches a step."""
    table = "| config | rank | recsz's host reads / step | all host reads / step "
    table += "| launches / step |\n|---|---|---|---|---|\n"
    for r in rows:
        for rank, c in enumerate(r["per_rank"]):
            table += f"| {r['config']} | {rank} | {c['ours_per_step']:.1f} | "
            table += f"{c['reads_per_step']:.1f} | {c['launches_per_step']:.1f} |\n"
    return table


def _by_seed(rows: list[dict]) -> str:
    """Each (rate, config) over the seeds: mean eval AUC and log loss, and their
    differences from stock-fp32's on the same seed (mean, min..max)."""
    import statistics

    table = "| rate | config | seeds | eval AUC | dAUC vs stock-fp32 | eval log loss "
    table += "| d log loss vs stock-fp32 |\n|---|---|---|---|---|---|---|\n"
    for rate, config in dict.fromkeys((r["rate"], r["config"]) for r in rows):
        at = {r["seed"]: r for r in rows if (r["rate"], r["config"]) == (rate, config)}
        ref = {r["seed"]: r for r in rows if (r["rate"], r["config"]) == (rate, "stock-fp32")}
        table += f"| {rate} | {config} | {len(at)} |"
        for key in ("eval_auc", "eval_logloss"):
            d = [at[k][key] - ref[k][key] for k in at if k in ref]
            vs = f"{statistics.mean(d):+.4f} ({min(d):+.4f}..{max(d):+.4f})" if d else "-"
            table += f" {statistics.mean(r[key] for r in at.values()):.4f} | {vs} |"
        table += "\n"
    return table


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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=15, help="untimed (past the first probes)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seeds", default="0", help="comma-separated: each run of each config")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches after training")
    p.add_argument("--json", default="benchmarks/results/sequence.json")
    p.add_argument(
        "--count",
        action="store_true",
        help="count host reads and launches a step on the GPU's path (on the CPU) instead",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="recsz", help=argparse.SUPPRESS)
    p.add_argument("--out", default=".", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
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
            "--warmup", "--lr", "--eval-batches"]  # fmt: skip
    common = [f for k in keep for f in (k, str(getattr(args, k[2:].replace("-", "_"))))]
    common += ["--count"] * args.count
    device_path = {"RECSZ_DEVICE_PATH_ON_CPU": "1", "TRITON_INTERPRET": "1"} if args.count else {}
    rows = []
    for rate in rates:
        with shaped(None if rate == "unshaped" else rate) as prefix:
            runs = [(c, int(k)) for k in args.seeds.split(",") for c in args.configs.split(",")]
            for config, seed in runs:
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", __file__, "--worker", "--config", config,
                           "--out", tmp, "--seed", str(seed), *common]  # fmt: skip
                    env = {**os.environ, "OMP_NUM_THREADS": "1", **device_path}
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
    if args.count:
        write_results(rows, args.json, _counts_table(rows))
        return 0
    table = "| rate | seed | config | samples/s | wire MB/step | loss (last 5) | eval AUC "
    table += "| x stock best |\n|---|---|---|---|---|---|---|---|\n"
    for rate, seed in dict.fromkeys((r["rate"], r["seed"]) for r in rows):
        at = [r for r in rows if (r["rate"], r["seed"]) == (rate, seed)]
        best = max((r["samples_per_s"] for r in at if r["config"].startswith("stock")), default=0)
        for r in at:
            vs = f"{r['samples_per_s'] / best:.2f}x" if best else "-"
            speed, wire, loss = r["samples_per_s"], r["wire_mb_per_step"], r["loss_last5"]
            table += f"| {rate} | {seed} | {r['config']} | {speed:,.0f} | {wire:.2f} | "
            table += f"{loss:.4f} | {r['eval_auc']:.4f} | {vs} |\n"
    if len(args.seeds.split(",")) > 1:
        table += "\n" + _by_seed(rows)
    write_results(rows, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
