"""Our DLRM against TorchRec's, apart from the luck of the initial draw.

    python benchmarks/bench_draws.py [--multi-hot mlperf] [--interaction dcn] [--draws K]
        [--json-out PATH]

One process, the ``bench`` preset's model (``--preset``), the same synthetic data for every
run (seed 0), the tables under the same row optimizer (fbgemm's fused kernel for TorchRec, through
``DistributedModelParallel`` on one gloo rank; ours fused into the backward), SGD on the
MLPs, then the AUC on the held-out samples. Runs:

- ``torchrec``: TorchRec's ``torchrec.models.dlrm.DLRM`` (``DLRM_DCN`` with ``--interaction
  dcn``), drawn with ``torch.manual_seed(k)``;
- ``ours, torchrec's weights``: our model started from that very draw (draw 1 only);
- ``ours, torch init`` / ``ours, dlrm init``: our model drawn with seed k, the MLPs as
  ``nn.Linear`` (TorchRec's) or as facebookresearch/dlrm (normal), the tables alike.

So the first two say whether the models train alike, and the spread over draws k = 1..K
how much of a difference between two single runs is the draw. Needs TorchRec
(``make anchors``). Prints a table; writes JSON rows ``run, draw, auc, loss``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from results_io import write_results
from sklearn.metrics import roc_auc_score
from torchrec_dmp import bag_kjt, torchrec_dlrm

from recsz.config import TrainConfig
from recsz.data.source import make_source
from recsz.model import ROW_OPTIMIZERS, DenseArch, RowOptimizer, SparseArch, get_preset
from recsz.model.multihot import Bags, parse_hotness


class Runs:
    """What every run shares: the model's shape, the data, the schedule."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.preset = get_preset(a.preset)
        self.cfg = TrainConfig(preset=a.preset, interaction=a.interaction).model()
        self.n = len(self.cfg.table_sizes)
        self.hot = parse_hotness(a.multi_hot, self.n) or (1,) * self.n
        self.bags = Bags(range(self.n), self.hot, self.cfg.table_sizes, [0] * self.n)
        self.src = make_source("synthetic", self.cfg.table_sizes, 0)
        self.src.n_eval = a.eval_samples  # type: ignore[attr-defined]

    def torchrec(self, draw: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
        """TorchRec's DLRM under DMP (fused optimizer), and its tables as tensors."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        torch.manual_seed(draw)
        kind = getattr(EmbOptimType, "EXACT_" + self.a.emb_optimizer.upper())
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": kind, "learning_rate": self.a.emb_lr}
        )
        dmp = torchrec_dlrm(self.cfg, sharder)
        state = dmp.state_dict()
        weights = [
            state[f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight"]
            for i in range(self.n)
        ]
        return dmp, [w.local_shards()[0].tensor for w in weights]

    def kjt(self, ids: torch.Tensor) -> object:
        return bag_kjt(self.bags, self.hot, ids)

    def train(self, forward, dense_params) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        """The schedule, then (AUC on the held-out samples, the last step's loss)."""
        opt = torch.optim.SGD(dense_params, lr=self.preset.lr)
        bce = torch.nn.BCEWithLogitsLoss()
        for step in range(self.a.steps):
            batch = self.src.train_batch(step, self.a.batch_size)
            loss = bce(forward(batch.dense, batch.ids), batch.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        preds, labels = [], []
        with torch.no_grad():
            for batch in self.src.eval_batches(4096):
                preds.append(torch.sigmoid(forward(batch.dense, batch.ids)).numpy())
                labels.append(batch.labels.numpy())
        return float(roc_auc_score(np.concatenate(labels), np.concatenate(preds))), loss.item()

    def run_torchrec(self, draw: int) -> tuple[float, float]:
        dmp, _ = self.torchrec(draw)
        mlps = [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
        return self.train(lambda x, ids: dmp(x, self.kjt(ids)).view(-1), mlps)

    def run_ours(self, draw: int, init: str, from_torchrec: bool = False) -> tuple[float, float]:
        opt = RowOptimizer(self.a.emb_optimizer, self.a.emb_lr)
        sparse = SparseArch(self.cfg, range(self.n), draw, opt, hotness=self.hot)
        dense = DenseArch(self.cfg, draw, init=init)
        if from_torchrec:
            dmp, tables = self.torchrec(draw)
            with torch.no_grad():
                sparse.weight.copy_(torch.cat(tables))
            dense.load_torchrec_mlps(
                [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
            )
        return self.train(lambda x, ids: dense(x, sparse(ids)), dense.mlp_parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--multi-hot", default="", help="recsz train's --multi-hot ('': one-hot)")
    ap.add_argument("--interaction", help="recsz train's (dcn: TorchRec's DLRM_DCN)")
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--emb-lr", type=float, help="the tables' rate (default: recsz train's)")
    ap.add_argument("--emb-optimizer", default="rowwise_adagrad", choices=ROW_OPTIMIZERS)
    ap.add_argument("--eval-samples", type=int, default=8192)
    ap.add_argument("--json-out", default="bench_out/draws.json")
    a = ap.parse_args(argv)
    try:
        import torchrec  # noqa: F401
    except ImportError:
        print("bench_draws.py needs TorchRec: make anchors", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", f"file://{rendezvous}/pg", rank=0, world_size=1)
        rows = run_all(a)
        dist.destroy_process_group()
    write_results(rows, a.json_out, table(rows, a))
    return 0


def run_all(a: argparse.Namespace) -> list[dict]:
    runs = Runs(a)
    a.emb_lr = a.emb_lr or TrainConfig(preset=a.preset, multi_hot=a.multi_hot).resolved("emb_lr")
    plan = [("ours, torchrec's weights", 1, lambda k: runs.run_ours(k, "torch", True))]
    for k in range(1, a.draws + 1):
        plan += [
            ("torchrec", k, runs.run_torchrec),
            ("ours, torch init", k, lambda k: runs.run_ours(k, "torch")),
            ("ours, dlrm init", k, lambda k: runs.run_ours(k, "dlrm")),
        ]
    rows = []
    for run, k, fn in plan:
        t = time.perf_counter()
        auc, loss = fn(k)
        rows.append({"run": run, "draw": k, "auc": auc, "loss": loss, "preset": a.preset,
                     "multi_hot": a.multi_hot, "emb_optimizer": a.emb_optimizer,
                     "emb_lr": a.emb_lr, "steps": a.steps, "batch": a.batch_size})  # fmt: skip
        secs = time.perf_counter() - t
        print(f"{run:26s} draw {k}: AUC {auc:.4f} loss {loss:.4f} ({secs:.0f} s)")
    return rows


def table(rows: list[dict], a: argparse.Namespace) -> str:
    lines = [
        f"{a.preset} preset, one process, {a.steps} steps of {a.batch_size}, multi-hot "
        f"{a.multi_hot or 'no'}, tables {a.emb_optimizer} at {a.emb_lr}, {a.draws} draws",
        "",
        "| run | AUC mean | min | max | std | draw 1 |",
        "|---|---|---|---|---|---|",
    ]
    for run in dict.fromkeys(r["run"] for r in rows):
        aucs = [r["auc"] for r in rows if r["run"] == run]
        std = statistics.stdev(aucs) if len(aucs) > 1 else 0.0
        lines.append(f"| {run} | {statistics.mean(aucs):.4f} | {min(aucs):.4f} | "
                     f"{max(aucs):.4f} | {std:.4f} | {aucs[0]:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
