"""A TorchRec program (DLRM, DistributedModelParallel) with recsz's compressed all-to-all.

    torchrun --standalone --nproc-per-node 2 examples/torchrec_dlrm.py --steps 50

Everything is plain TorchRec except the two lines marked ``# recsz``: the sharders passed to
``DistributedModelParallel``, and our error-bounded hook on the DDP it wraps the MLPs in.
Data: recsz's synthetic Criteo-shaped generator (one id per feature). Prints the loss and,
at the end, the bytes the embedding all-to-all and the MLPs' gradients saved.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.optimizers import in_backward_optimizer_filter

import recsz.torchrec
from recsz.data.source import make_source

ROWS, DIM, FEATURES = 10_000, 16, 26


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=512, help="global batch")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"]
        )
        for i in range(FEATURES)
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, DIM],
        over_arch_layer_sizes=[64, 1],
    )
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    dmp = DistributedModelParallel(
        model,
        device=device,
        sharders=recsz.torchrec.sharders(eb_policy="dual", fused_params=fused),  # recsz
    )
    dp = recsz.torchrec.dense_comm(dmp, "eb")  # recsz
    opt = torch.optim.SGD(dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), 0.1)

    src = make_source("synthetic", (ROWS,) * FEATURES, seed=0)
    b = a.batch_size // world
    for step in range(a.steps):
        batch = src.train_batch(step, a.batch_size).slice(rank * b, (rank + 1) * b)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(FEATURES)],
            values=batch.ids.t().reshape(-1),
            lengths=torch.ones(b * FEATURES, dtype=torch.int32),
        ).to(device)
        logits = dmp(batch.dense.to(device), kjt).view(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    sent = recsz.torchrec.comm_bytes(dmp)
    if rank == 0:
        for d in ("fwd", "bwd"):
            raw, wire = sent["raw"][d], sent["wire"][d]
            print(
                f"{d}: {raw / 1e6:.1f} MB of fp32 sent as {wire / 1e6:.2f} MB ({raw / wire:.1f}x)"
            )
        print(
            f"mlp: {dp.bytes_dense / 1e6:.1f} MB of fp32 sent as {dp.bytes_sent / 1e6:.2f} MB "
            f"({dp.bytes_dense / max(dp.bytes_sent, 1):.1f}x)"
        )
    dist.destroy_process_group()
    # fbgemm's CPU threads occasionally abort the interpreter's teardown ("terminate called
    # without an active exception") after all the work is done: leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
