"""Train DLRM, one process or many, with a compressed embedding all-to-all.

Reads top to bottom: set up ranks -> data -> model parts -> exchange -> loop -> evaluate
-> write the run directory. One step (docs/ARCHITECTURE.md follows it through the modules):

    every rank reads the global batch (B samples) and keeps its slice of b = B / W
    table owner:  pooled = lookup(own tables, all B ids)           # (B, |T_r|, D)
                  start forward all-to-all (one payload per destination)
    sample owner: x = bottom MLP(own dense)                        # overlaps the a2a
                  emb = wait()                                     # (b, T, D)
                  loss = BCE(top MLP(interact(x, emb)), labels)
                  backward: DDP all-reduce of MLP grads; the exchange sends d emb back
    table owner:  sparse update of its tables

World size 1 runs the same code with the all-to-all looping back to itself, so a
single-process run measures exactly the codec the distributed one uses.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import log_loss, roc_auc_score
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from recsz import checkpoint, report
from recsz.codecs import get_codec
from recsz.comm.direction import Direction
from recsz.comm.dp_hooks import DPComm
from recsz.comm.dp_hooks import register as register_dp_hook
from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.stats import ShardPlan
from recsz.config import TrainConfig, parse_train_args
from recsz.data.source import Batch, DataSource, make_source, prefetch
from recsz.model import DenseArch, RowOptimizer, SparseArch, get_preset, tt_parameters
from recsz.model.fiited import HeldMask
from recsz.model.sharding import plan_tables
from recsz.model.ttrec import TTTables
from recsz.policy.factory import make_policy
from recsz.ranks import Ranks, launch, watch_parent
from recsz.stepgraph import graphed

# DDP without a buffer broadcast each forward: `forward_sync_buffers` from torch 2.13 (where
# `broadcast_buffers` warns it is deprecated), `broadcast_buffers` before it (torch 2.11 on
# the lent GPU machines).
DDP_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)

SYNTHETIC_DEFAULT_STEPS = 1000
#: Steps left out of samples_per_s_steady (first kernel compiles, CUDA graph captures).
WARM_STEPS = 3


# ---- model parts and optimizers -------------------------------------------------------
@dataclass
class Parts:
    sparse: SparseArch
    dense: nn.Module  # DenseArch, or DDP around it
    dense_opt: torch.optim.Optimizer  # the tables' optimizer runs inside their backward
    exchange: EmbeddingExchange
    dp: DPComm  # the MLP gradients' exchange (DDP hook), its state and counters

    @property
    def dense_module(self) -> DenseArch:
        m = self.dense.module if isinstance(self.dense, DDP) else self.dense
        assert isinstance(m, DenseArch)
        return m


def build_parts(cfg: TrainConfig, ranks: Ranks) -> tuple[Parts, list[int]]:
    preset = get_preset(cfg.preset)
    mcfg = preset.model
    tt = cfg.tt_spec()
    local = tt.replicated if tt is not None else frozenset()
    # A TT table is charged what its cores hold, as rows of the table's width; replicated
    # ones are on every rank, out of the plan (owner -1) and of the all-to-all.
    charged = {
        t: -(-tt_parameters(n, mcfg.emb_dim, tt.rank, tt.cores) // mcfg.emb_dim)
        if tt is not None and t in tt.tables
        else n
        for t, n in enumerate(mcfg.table_sizes)
        if t not in local
    }
    owners = [-1] * mcfg.n_tables
    planned = plan_tables(list(charged.values()), mcfg.emb_dim, ranks.world)
    for t, r in zip(charged, planned, strict=True):
        owners[t] = r
    plan = ShardPlan(owners, ranks.world)
    emb_opt = RowOptimizer(cfg.resolved("emb_optimizer"), cfg.resolved("emb_lr"))
    fiited = cfg.fiited_spec()
    sparse = SparseArch(mcfg, plan.tables_of(ranks.rank), cfg.seed, emb_opt, tt, fiited)
    sparse = sparse.to(ranks.device)
    replicated = TTTables(mcfg, sorted(local), cfg.seed, emb_opt, tt, in_backward=False)
    compute = torch.bfloat16 if cfg.dense_dtype == "bf16" else None
    dense_arch = DenseArch(mcfg, cfg.seed, replicated, compute).to(ranks.device)
    if cfg.compile:
        dense_arch.compile()  # in place: DDP and the checkpoints see the same module
    dp = DPComm(cfg.dp_comm, ranks.world)
    dense: nn.Module = dense_arch
    if ranks.world > 1:
        group = dist.new_group()  # the MLP gradients' own (DPComm.group)
        dense = DDP(
            dense_arch,
            device_ids=[ranks.device] if ranks.device.type == "cuda" else None,
            process_group=group,
            gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in or out
            **DDP_NO_BUFFER_SYNC,  # its one buffer is a constant: no collective a step
        )
        dp = register_dp_hook(
            dense,
            cfg.dp_comm,
            ranks.world,
            group,
            dct_keep=cfg.dct_keep,
            dct_refresh=cfg.dct_refresh,
            powersgd_rank=cfg.powersgd_rank,
            powersgd_warmup=cfg.powersgd_warmup,
            codec=get_codec(cfg.dp_codec),
            eb=cfg.dp_eb,
            collective=cfg.dp_eb_collective,
        )
    dense_opt = torch.optim.SGD(dense_arch.mlp_parameters(), lr=cfg.resolved("lr"))
    exchange = EmbeddingExchange(
        plan,
        ranks.rank,
        Direction("fwd", cfg.codec("fwd"), make_policy(cfg, "fwd", mcfg.n_tables)),
        Direction("bwd", cfg.codec("bwd"), make_policy(cfg, "bwd", mcfg.n_tables)),
        check_bounds=cfg.check_bounds,
        id_dedup=cfg.id_dedup,
        coalesce=cfg.bwd_coalesce,
        sparse_grad=sparse.takes_sparse_grad,
    )
    return Parts(sparse, dense, dense_opt, exchange, dp), owners


def share_chunk_counts(parts: Parts, ranks: Ranks, chunk: int) -> None:
    """FIITED: every rank's held chunks per row, to every rank's exchange (one gather)."""
    gathered = ranks.gather(parts.sparse.chunk_counts())
    counts = {t: c.to(ranks.device) for mine in gathered for t, c in mine.items()}
    parts.exchange.grad_filter = HeldMask(counts, chunk) if counts else None


# ---- one step and evaluation ------------------------------------------------------------
def forward(parts: Parts, batch_dense: torch.Tensor, ids: torch.Tensor, step: int) -> torch.Tensor:
    """Logits of this rank's b samples; ids are the global batch's (B, T)."""
    # checked: the sources are made for the model's table sizes (no host sync on a GPU).
    pooled = parts.sparse(ids, checked=True)  # (B, |T_r|, D)
    pending = parts.exchange.start_forward(pooled, step, ids)
    b = len(batch_dense)
    mine = ids[parts.exchange.rank * b : (parts.exchange.rank + 1) * b]
    return parts.dense(batch_dense, pending, mine)  # bottom MLP runs while the bytes fly


def train_step(parts: Parts, batch: Batch, step: int, ranks: Ranks) -> torch.Tensor:
    """One optimizer step on the global ``batch`` (each rank trains on its slice); the
    loss stays where it was computed (read when logged: no host sync in the step)."""
    b = len(batch) // ranks.world
    mine = batch.slice(ranks.rank * b, (ranks.rank + 1) * b)
    logits = forward(parts, mine.dense, batch.ids, step)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, mine.labels)
    parts.dense_opt.zero_grad(set_to_none=True)
    loss.backward()  # also updates the tables (their optimizer is fused into it)
    parts.dense_opt.step()
    if parts.dense_module.local is not None:  # replicated tables, on averaged gradients
        parts.dense_module.local.step()
    return loss.detach()


@torch.no_grad()
def evaluate(
    parts: Parts, source: DataSource, cfg: TrainConfig, step: int, ranks: Ranks
) -> dict[str, float]:
    """AUC, logloss and accuracy on the held-out set (every rank returns the same). The
    exchange codes evaluation batches as training ones but feeds no policy or counter."""
    parts.exchange.train(False)
    try:
        return _evaluate(parts, source, cfg, step, ranks)
    finally:
        parts.exchange.train(True)


def _evaluate(
    parts: Parts, source: DataSource, cfg: TrainConfig, step: int, ranks: Ranks
) -> dict[str, float]:
    w = ranks.world
    eb = math.ceil(cfg.eval_batch_size / w) * w
    preds, labels = [], []
    for batch in source.eval_batches(eb):
        n = len(batch)
        pad = (-n) % w
        if pad:  # repeat the last row so every rank gets the same number of samples
            idx = torch.cat([torch.arange(n), torch.full((pad,), n - 1)])
            batch = type(batch)(batch.dense[idx], batch.ids[idx], batch.labels[idx])
        batch = batch.to(ranks.device)
        b = len(batch) // w
        mine = batch.slice(ranks.rank * b, (ranks.rank + 1) * b)
        p = torch.sigmoid(forward(parts, mine.dense, batch.ids, step))
        if w > 1:
            gathered = [torch.empty_like(p) for _ in range(w)]
            dist.all_gather(gathered, p)
            p = torch.cat(gathered)
        preds.append(p[:n].double().cpu().numpy())
        labels.append(batch.labels[:n].double().cpu().numpy())
    y, p_all = np.concatenate(labels), np.concatenate(preds)
    # AUC is undefined with one class: say so (NaN) rather than invent a number.
    auc = float(roc_auc_score(y, p_all)) if len(np.unique(y)) == 2 else float("nan")
    p_clip = np.clip(p_all, 1e-7, 1 - 1e-7)
    return {
        "auc": auc,
        "logloss": float(log_loss(y, p_clip, labels=[0.0, 1.0])),
        "accuracy": float(((p_all > 0.5) == (y > 0.5)).mean()),
        "eval_samples": int(y.size),
    }


# ---- the run ---------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this process's rank; returns the summary (same on every rank)."""
    ranks = Ranks.from_env(cfg.dist_timeout, cfg.device)
    ok = False
    try:
        ranks.check_same({k: v for k, v in cfg.to_dict().items() if k not in _LOCAL_FIELDS})
        bsz = cfg.resolved("batch_size")
        if bsz % ranks.world:
            raise ValueError(
                f"--batch-size {bsz} is not divisible by the {ranks.world} ranks; "
                f"use a multiple of {ranks.world}"
            )
        tables = get_preset(cfg.preset).model.table_sizes
        source = make_source(cfg.data, tables, cfg.seed, cfg.skip_bad_lines, cfg.synthetic_eval)
        steps = cfg.steps or source.steps_per_epoch(bsz) or SYNTHETIC_DEFAULT_STEPS
        parts, owners = build_parts(cfg, ranks)
        out = Path(cfg.out) if cfg.out else None
        start, counters = 0, {"train_s": 0.0, "data_s": 0.0}
        if cfg.resume:
            start, counters = checkpoint.load(Path(cfg.resume), parts, cfg, ranks)
            out = out or checkpoint.run_dir_of(Path(cfg.resume))
            if steps < start:
                raise ValueError(
                    f"--steps {steps} is below the step of the checkpoint resumed ({start})"
                )
            if steps == start:
                msg = f"recsz: {cfg.resume} already finished its {steps} steps; nothing to do"
                if ranks.rank == 0:
                    print(msg, flush=True)
                ok = True
                return {"steps": steps, "already_finished": True}
        if out and ranks.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(cfg.to_json())
        # Resumed: the metrics rows after the checkpoint are dropped (they are rerun).
        log = report.Log(out if ranks.rank == 0 else None, keep_until=start if cfg.resume else None)
        if ranks.rank == 0:
            tqdm.write(
                f"recsz: preset {cfg.preset}, data {source.name}, {ranks.world} rank(s), "
                f"global batch {bsz}, steps {start}..{steps}, codecs "
                f"fwd={cfg.fwd_codec} bwd={cfg.bwd_codec} ({cfg.eb_policy} {cfg.eb_mode})"
            )
            tqdm.write(f"table owners: {owners}")
        bar = tqdm(
            total=steps,
            initial=start,
            disable=not (cfg.progress and ranks.rank == 0),
            desc="train",
            unit="step",
            leave=False,
        )
        losses: list[torch.Tensor] = []
        train_s, data_s = counters["train_s"], counters["data_s"]
        warm: tuple[float, int] | None = None  # train_s and step after the first steps

        def gathered() -> list[dict]:
            """Every rank's counters, in one collective (metrics rows and the summary)."""
            loss = float(torch.stack(losses).double().mean()) if losses else float("nan")
            losses.clear()
            return ranks.gather(report.rank_record(parts, ranks.rank, loss, train_s, data_s))

        fail_at = cfg.failure_at()
        fiited = cfg.fiited_spec()
        if fiited is not None and cfg.fiited_mask_backward:
            share_chunk_counts(parts, ranks, fiited.chunk)

        def one_step(batch: Batch, k: int) -> torch.Tensor:
            return train_step(parts, batch, k, ranks)

        run_step = graphed(one_step, parts.exchange, ranks.world) if cfg.cuda_graph else one_step
        batches = prefetch(source, range(start, steps), bsz, ranks.device, cfg.prefetch)
        for step in range(start, steps):
            if fail_at == (ranks.rank, step):
                raise RuntimeError(f"injected failure on rank {ranks.rank} at step {step}")
            # data_s: the time spent waiting for a batch (making it, without --prefetch).
            t0 = time.perf_counter()
            batch = next(batches)
            data_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            losses.append(run_step(batch, step))
            done = step + 1
            if fiited is not None and done % fiited.interval == 0:
                parts.sparse.prune()
                if cfg.fiited_mask_backward:
                    share_chunk_counts(parts, ranks, fiited.chunk)
            logged = done % cfg.log_every == 0 or done == steps
            warmed = done - start == WARM_STEPS  # compilation, graph capture, caches behind
            if ranks.device.type == "cuda" and (logged or warmed):
                # The loss is read only when logged, so the GPU may lag the host: the
                # queued work of the steps counted so far counts here.
                torch.cuda.synchronize(ranks.device)
            train_s += time.perf_counter() - t0
            bar.update(1)
            if warmed:
                warm = (train_s, done)
            row: dict[str, Any] = {}
            if logged:
                recs = gathered()
                if bad := report.diverged(recs):  # every rank sees the same: all stop here
                    msg = f"the loss is not finite on rank(s) {bad} by step {done}"
                    raise FloatingPointError(f"{msg}: diverged (lower --lr, --emb-lr or bounds)")
                row = {"step": done, **report.summarize(recs, done, bsz)}
            if cfg.eval_every and done % cfg.eval_every == 0 and done != steps:
                ev = evaluate(parts, source, cfg, done, ranks)
                row = {"step": done, **row, **{f"eval_{k}": v for k, v in ev.items()}}
            if row:
                log.metrics(row)
                bar.set_postfix(loss=f"{row.get('loss', float('nan')):.4f}")
            if out and cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == steps):
                run_totals = {"train_s": train_s, "data_s": data_s}
                checkpoint.save(out, parts, cfg, ranks, done, run_totals)
        bar.close()
        ev = evaluate(parts, source, cfg, steps, ranks)
        recs = gathered()
        totals = report.summarize(recs, steps, bsz)  # the counters span the whole run
        totals.pop("loss", None)
        summary = {
            **ev,
            "steps": steps,
            "world_size": ranks.world,
            "skipped_lines": source.skipped_lines,
            "graph_replays": getattr(run_step, "replays", 0),  # --cuda-graph's steps
            **totals,
            "per_table": totals.pop("tables"),
            # This rank's pace after its first WARM_STEPS steps (the ranks keep in step).
            "samples_per_s_steady": (steps - warm[1]) * bsz / (train_s - warm[0])
            if warm is not None and steps > warm[1] and train_s > warm[0]
            else float("nan"),
            **report.final_extras(recs, cfg.check_bounds),
            "config": cfg.to_dict(),
        }
        if out and ranks.rank == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            log.metrics({"step": steps, **{f"eval_{k}": v for k, v in ev.items()}})
        if ranks.rank == 0:
            tqdm.write(report.format_summary(summary))
        ok = True
        return summary
    finally:
        ranks.close(ok)


#: Fields that may differ between ranks of one job.
_LOCAL_FIELDS = ("progress", "out", "nproc", "prefetch")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `recsz train`; tests call it with a list of flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_train_args(argv)
    if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch(cfg.nproc, argv)
    rank = os.environ.get("RANK", "0")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun's agent
        watch_parent()
    try:
        run(cfg)
    except Exception as e:
        print(f"recsz: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and __name__ == "__main__":
        # A worker whose job is done and whose group is destroyed leaves without running
        # C++ static destructors: under load, gloo's teardown occasionally aborted there
        # ("terminate called without an active exception") after all work had succeeded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
