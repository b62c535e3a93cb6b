"""Train DLRM, one process or many, with a compressed embedding all-to-all.

Reads top to bottom: set up ranks -> data -> model parts -> exchange -> loop -> evaluate
-> write the run directory. One step (see shared DESIGN.md):

    every rank reads the global batch (B samples) and keeps its slice of b = B / W
    table owner:  pooled = lookup(own tables, all B ids)           # (B, |T_r|, D)
                  start forward all-to-all (encoded per table and destination)
    sample owner: x = bottom MLP(own dense)                        # overlaps the a2a
                  emb = wait()                                     # (b, T, D)
                  loss = BCE(top MLP(interact(x, emb)), labels)
                  backward: DDP all-reduce of MLP grads; the exchange sends d emb back
    table owner:  sparse update of its tables

World size 1 runs the same code with the all-to-all looping back to itself, so a
single-process run measures exactly the codec the distributed one uses.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import log_loss, roc_auc_score
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from recsz.codecs import get_codec
from recsz.comm.dct_dp import DCTState, dct_hook
from recsz.comm.embedding import EmbeddingExchange, ShardPlan
from recsz.config import TrainConfig, parse_train_args
from recsz.data.source import Batch, DataSource, make_source
from recsz.model import DenseArch, SparseArch, get_preset
from recsz.model.sharding import plan_tables
from recsz.policy import BoundPolicy
from recsz.policy.factory import make_policy

SYNTHETIC_DEFAULT_STEPS = 1000


# ---- ranks ------------------------------------------------------------------------------
@dataclass
class Ranks:
    """Who we are in the job. ``world == 1`` runs without any process group."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def from_env(cls, timeout_s: float, device: str = "cpu") -> Ranks:
        """One process group for the job. On CPU, gloo; with CUDA, gloo for the small CPU
        tensors (sizes, metrics) and NCCL for the CUDA ones (payloads, MLP gradients):
        NCCL moves CUDA tensors only, and picking it alone failed every CPU collective."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dev = torch.device("cpu")
        if device == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        if world == 1:
            return cls(device=dev)
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
        kw: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
        return cls(dist.get_rank(), dist.get_world_size(), dev)

    def all_mean(self, x: float) -> float:
        if self.world == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / self.world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self, ok: bool) -> None:
        """Leave the group; on success wait for everyone first, so that no rank tears
        down its connections while a peer is still using them (gloo aborts then)."""
        if self.world > 1 and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def _config_fingerprint(cfg: TrainConfig) -> str:
    keep = {k: v for k, v in cfg.to_dict().items() if k not in ("progress", "out", "nproc")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _check_same_config(cfg: TrainConfig, ranks: Ranks) -> None:
    """Refuse to start when ranks were launched with different configurations."""
    if ranks.world == 1:
        return
    fps: list[Any] = [None] * ranks.world
    dist.all_gather_object(fps, _config_fingerprint(cfg))
    bad = [r for r, f in enumerate(fps) if f != fps[0]]
    if bad:
        raise ValueError(
            f"ranks {bad} were started with a configuration that differs from "
            f"rank 0's ({fps[0]} vs {[fps[r] for r in bad]})"
        )


# ---- DDP all-reduce with timing ----------------------------------------------------------
@dataclass
class AllReduceTimer:
    seconds: float = 0.0
    world: int = 1


def _timed_allreduce(state: AllReduceTimer, bucket):
    """Plain averaging all-reduce, blocking so its time is measured exactly.

    (No annotations: DDP checks them by identity, which string annotations fail.)
    """
    t = time.perf_counter()
    buf = bucket.buffer()
    dist.all_reduce(buf)
    buf.div_(state.world)
    state.seconds += time.perf_counter() - t
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# ---- model parts and optimizers -------------------------------------------------------
@dataclass
class Parts:
    sparse: SparseArch
    dense: nn.Module  # DenseArch, or DDP around it
    dense_opt: torch.optim.Optimizer
    sparse_opt: torch.optim.Optimizer | None
    exchange: EmbeddingExchange
    ar_timer: AllReduceTimer = field(default_factory=AllReduceTimer)
    dct: DCTState | None = None  # DCT-DP hook state, when --dp-comm dct

    @property
    def dense_module(self) -> DenseArch:
        m = self.dense.module if isinstance(self.dense, DDP) else self.dense
        assert isinstance(m, DenseArch)
        return m


def build_parts(cfg: TrainConfig, ranks: Ranks) -> tuple[Parts, list[int]]:
    preset = get_preset(cfg.preset)
    mcfg = preset.model
    owners = plan_tables(mcfg.table_sizes, mcfg.emb_dim, ranks.world)
    plan = ShardPlan(owners, ranks.world)
    sparse = SparseArch(mcfg, plan.tables_of(ranks.rank), cfg.seed).to(ranks.device)
    dense_arch = DenseArch(mcfg, cfg.seed).to(ranks.device)
    timer = AllReduceTimer(world=ranks.world)
    dct_state: DCTState | None = None
    dense: nn.Module = dense_arch
    if ranks.world > 1:
        dense = DDP(dense_arch, device_ids=[ranks.device] if ranks.device.type == "cuda" else None)
        if cfg.dp_comm == "dct":
            dct_state = DCTState(ranks.world, cfg.dct_keep, cfg.dct_refresh)
            dense.register_comm_hook(dct_state, dct_hook)
        else:
            dense.register_comm_hook(timer, _timed_allreduce)
    dense_opt = torch.optim.SGD(dense_arch.parameters(), lr=cfg.resolved_lr)
    sparse_opt: torch.optim.Optimizer | None = None
    if len(sparse.tables):
        if cfg.resolved_emb_optimizer == "adagrad":
            sparse_opt = torch.optim.Adagrad(sparse.parameters(), lr=cfg.resolved_emb_lr)
        else:
            sparse_opt = torch.optim.SGD(sparse.parameters(), lr=cfg.resolved_emb_lr)
    fwd_policy: BoundPolicy = make_policy(cfg, "fwd", mcfg.n_tables)
    bwd_policy: BoundPolicy = make_policy(cfg, "bwd", mcfg.n_tables)
    exchange = EmbeddingExchange(
        plan,
        ranks.rank,
        get_codec(cfg.fwd_codec),
        get_codec(cfg.bwd_codec),
        fwd_policy,
        bwd_policy,
        check_bounds=cfg.check_bounds,
        mask_backward=cfg.bwd_codec == "dct-mask",
        id_dedup=cfg.id_dedup,
        coalesce=cfg.bwd_coalesce,
        fwd_refs=cfg.fwd_refs,
        ref_cache_rows=cfg.ref_cache_rows,
        dim=mcfg.emb_dim,
    )
    return Parts(sparse, dense, dense_opt, sparse_opt, exchange, timer, dct_state), owners


# ---- one step and evaluation ------------------------------------------------------------
def forward(
    parts: Parts,
    batch_dense: torch.Tensor,
    ids: torch.Tensor,
    step: int,
    ranks: Ranks,
    record: bool = True,
) -> torch.Tensor:
    """Logits of this rank's b samples; ids are the global batch's (B, T)."""
    pooled = parts.sparse(ids)  # (B, |T_r|, D)
    pending = parts.exchange.start_forward(pooled, step, ids, record=record)
    return parts.dense(batch_dense, pending)  # bottom MLP runs while the bytes fly


def train_step(parts: Parts, batch: Batch, step: int, ranks: Ranks) -> float:
    """One optimizer step on the global ``batch`` (each rank trains on its slice)."""
    b = len(batch) // ranks.world
    mine = batch.slice(ranks.rank * b, (ranks.rank + 1) * b)
    logits = forward(parts, mine.dense, batch.ids, step, ranks)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, mine.labels)
    parts.dense_opt.zero_grad(set_to_none=True)
    if parts.sparse_opt is not None:
        parts.sparse_opt.zero_grad(set_to_none=True)
    loss.backward()
    parts.dense_opt.step()
    if parts.sparse_opt is not None:
        parts.sparse_opt.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(
    parts: Parts, source: DataSource, cfg: TrainConfig, step: int, ranks: Ranks
) -> dict[str, float]:
    """AUC, logloss and accuracy on the held-out set (every rank returns the same)."""
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
        p = torch.sigmoid(forward(parts, mine.dense, batch.ids, step, ranks, record=False))
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
    from recsz import checkpoint

    # Embedding optimizers build sparse gradients of well-formed indices; say so once
    # rather than have torch warn on every step.
    torch.sparse.check_sparse_tensor_invariants.disable()
    ranks = Ranks.from_env(cfg.dist_timeout, cfg.device)
    ok = False
    try:
        _check_same_config(cfg, ranks)
        preset = get_preset(cfg.preset)
        bsz = cfg.resolved_batch_size
        if bsz % ranks.world:
            raise ValueError(
                f"--batch-size {bsz} is not divisible by the {ranks.world} ranks; "
                f"use a multiple of {ranks.world}"
            )
        source = make_source(cfg.data, preset.model.table_sizes, cfg.seed, cfg.skip_bad_lines)
        if cfg.data == "synthetic":
            source.n_eval = cfg.synthetic_eval  # type: ignore[attr-defined]
        steps = cfg.steps or source.steps_per_epoch(bsz) or SYNTHETIC_DEFAULT_STEPS
        parts, owners = build_parts(cfg, ranks)
        out = Path(cfg.out) if cfg.out else None
        start = 0
        if cfg.resume:
            start = checkpoint.load(Path(cfg.resume), parts, cfg, ranks)
            out = out or Path(cfg.resume)
        if out and ranks.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(cfg.to_json())
        log = _Logger(out if ranks.rank == 0 else None, append=bool(cfg.resume))
        if ranks.rank == 0:
            log.line(
                f"recsz: preset {cfg.preset}, data {source.name}, {ranks.world} rank(s), "
                f"global batch {bsz}, steps {start}..{steps}, codecs "
                f"fwd={cfg.fwd_codec} bwd={cfg.bwd_codec} ({cfg.eb_policy} {cfg.eb_mode})"
            )
            log.line(f"table owners: {owners}")
        bar = tqdm(
            total=steps,
            initial=start,
            disable=not (cfg.progress and ranks.rank == 0),
            desc="train",
            unit="step",
            leave=False,
        )
        losses: list[float] = []
        train_s = 0.0
        data_s = 0.0
        ev: dict[str, float] = {}
        fail_at = _parse_failure(cfg.inject_failure)
        for step in range(start, steps):
            if fail_at == (ranks.rank, step):
                raise RuntimeError(f"injected failure on rank {ranks.rank} at step {step}")
            # Data loading is timed apart (data_s): a real input pipeline overlaps it with
            # training, and the synthetic generator's cost is not what we measure.
            t0 = time.perf_counter()
            batch = source.train_batch(step, bsz).to(ranks.device)
            data_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            losses.append(train_step(parts, batch, step, ranks))
            train_s += time.perf_counter() - t0
            bar.update(1)
            done = step + 1
            row: dict[str, Any] = {}
            if done % cfg.log_every == 0 or done == steps:
                row = {"step": done, "loss": ranks.all_mean(float(np.mean(losses)))}
                losses.clear()
                row.update(_comm_row(parts, ranks, train_s, done - start, bsz))
                row["data_s"] = ranks.all_mean(data_s)
                row["tables"] = table_report(parts, ranks)
            if cfg.eval_every and done % cfg.eval_every == 0 and done != steps:
                ev = evaluate(parts, source, cfg, done, ranks)
                row = row or {"step": done}
                row.update({f"eval_{k}": v for k, v in ev.items()})
            if row:
                log.metrics(row)
                bar.set_postfix(loss=f"{row.get('loss', float('nan')):.4f}")
            if out and cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == steps):
                checkpoint.save(out, parts, cfg, ranks, done)
        bar.close()
        ev = evaluate(parts, source, cfg, steps, ranks)
        summary = {
            **ev,
            "steps": steps,
            "world_size": ranks.world,
            **_comm_row(parts, ranks, train_s, max(1, steps - start), bsz),
            "data_s": ranks.all_mean(data_s),
            "per_table": table_report(parts, ranks),
            "policy_events": _policy_events(parts, ranks),
            **_ref_report(parts, ranks),
            **_bound_report(parts, ranks, cfg),
            "config": cfg.to_dict(),
        }
        if out and ranks.rank == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            log.metrics({"step": steps, **{f"eval_{k}": v for k, v in ev.items()}})
        if ranks.rank == 0:
            log.line(format_summary(summary))
        ok = True
        return summary
    finally:
        ranks.close(ok)


def table_report(parts: Parts, ranks: Ranks) -> dict[str, dict[str, Any]]:
    """Per table: class, current bound and cumulative ratio of each direction.

    Forward numbers come from the table's owner; backward bytes are summed over all
    sample owners, and the backward class and bound are rank 0's.
    """
    ex = parts.exchange
    st = ex.stats
    fwd_desc, bwd_desc = ex.policies["fwd"].describe(), ex.policies["bwd"].describe()
    local = {
        "fwd": {
            t: (
                st.table_raw["fwd"][t],
                st.table_sent["fwd"][t],
                st.last_eb["fwd"].get(t),
                fwd_desc.get(t, {}).get("class"),
            )
            for t in ex.mine
        },
        "bwd": {
            t: (
                st.table_raw["bwd"][t],
                st.table_sent["bwd"][t],
                st.last_eb["bwd"].get(t),
                bwd_desc.get(t, {}).get("class"),
            )
            for t in st.table_raw["bwd"]
        },
    }
    views: list[Any] = [local]
    if ranks.world > 1:
        views = [None] * ranks.world
        dist.all_gather_object(views, local)
    out: dict[str, dict[str, Any]] = {}
    for r, v in enumerate(views):
        for t, (raw, sent, eb, cls) in v["fwd"].items():
            out.setdefault(str(t), {}).update(
                {"fwd_ratio": raw / sent if sent else None, "fwd_eb": eb, "fwd_class": cls}
            )
        for t, (raw, sent, eb, cls) in v["bwd"].items():
            row = out.setdefault(str(t), {})
            row["_bwd_raw"] = row.get("_bwd_raw", 0) + raw
            row["_bwd_sent"] = row.get("_bwd_sent", 0) + sent
            if r == 0:
                row.update({"bwd_eb": eb, "bwd_class": cls})
    for row in out.values():
        raw, sent = row.pop("_bwd_raw", 0), row.pop("_bwd_sent", 0)
        row["bwd_ratio"] = raw / sent if sent else None
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _bound_report(parts: Parts, ranks: Ranks, cfg: TrainConfig) -> dict[str, Any]:
    """With --check-bounds: the largest error seen, as a fraction of its bound (<= 1)."""
    if not cfg.check_bounds:
        return {}
    m = parts.exchange.stats.max_err
    worst = torch.tensor([m["fwd"], m["bwd"]], dtype=torch.float64)
    if ranks.world > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"max_err_over_eb": {"fwd": float(worst[0]), "bwd": float(worst[1])}}


def _ref_report(parts: Parts, ranks: Ranks) -> dict[str, Any]:
    """Reference-cache numbers: hit rate per table, rows held, and whether the mirrors of
    every table owner equal the caches of every receiver (digests)."""
    ex = parts.exchange
    if not ex.fwd_refs:
        return {}
    local = {
        "hits": dict(ex.stats.ref_hits),
        "total": dict(ex.stats.ref_total),
        "rows": ex.cache_rows(),
        "digests": ex.cache_digests(),
    }
    views: list[Any] = [local]
    if ranks.world > 1:
        views = [None] * ranks.world
        dist.all_gather_object(views, local)
    hits: dict[int, int] = {}
    total: dict[int, int] = {}
    mirrors: dict[str, str] = {}
    caches: dict[str, str] = {}
    for v in views:
        for t, n in v["hits"].items():
            hits[t] = hits.get(t, 0) + n
        for t, n in v["total"].items():
            total[t] = total.get(t, 0) + n
        mirrors.update(v["digests"]["mirrors"])
        caches.update(v["digests"]["caches"])
    return {
        "ref_hit_rate": sum(hits.values()) / max(1, sum(total.values())),
        "ref_hit_rate_per_table": {
            str(t): hits.get(t, 0) / max(1, n) for t, n in sorted(total.items())
        },
        "ref_cache_rows": sum(v["rows"] for v in views),
        "ref_caches_in_sync": mirrors == caches,
    }


def _policy_events(parts: Parts, ranks: Ranks) -> list[dict[str, Any]]:
    """Class changes of every rank's policies (forward: each table's owner)."""
    mine = [
        {**e, "direction": d, "rank": ranks.rank}
        for d, p in parts.exchange.policies.items()
        for e in getattr(p, "events", [])
        if d == "fwd" or ranks.rank == 0
    ]
    if ranks.world == 1:
        return mine
    views: list[Any] = [None] * ranks.world
    dist.all_gather_object(views, mine)
    return [e for v in views for e in v]


def _parse_failure(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        r, s = spec.split(":")
        return int(r), int(s)
    except ValueError:
        raise ValueError(f"--inject-failure wants RANK:STEP, got {spec!r}") from None


def _comm_row(parts: Parts, ranks: Ranks, train_s: float, n_steps: int, bsz: int) -> dict[str, Any]:
    """Communication and speed numbers, summed over steps and averaged over ranks."""
    st = parts.exchange.stats.summary()
    row: dict[str, Any] = {}
    for k in ("a2a_fwd_s", "a2a_bwd_s", "codec_s"):
        row[k] = ranks.all_mean(st[k])
    dp_s = parts.dct.seconds if parts.dct else parts.ar_timer.seconds
    row["allreduce_s"] = ranks.all_mean(dp_s)
    if parts.dct:
        d = _sum_over_ranks(ranks, [parts.dct.bytes_dense, parts.dct.bytes_sent])
        row["dp_ratio"] = d[0] / d[1] if d[1] else float("nan")
        row["dp_bytes_sent"] = int(d[1])
        row["dp_threshold_refreshes"] = parts.dct.refreshes
    total = ranks.all_mean(train_s)
    row["train_s"] = total
    row["compute_s"] = max(
        0.0, total - row["a2a_fwd_s"] - row["a2a_bwd_s"] - row["codec_s"] - row["allreduce_s"]
    )
    row["samples_per_s"] = n_steps * bsz / total if total > 0 else float("nan")
    for k in ("bytes_raw", "bytes_payload", "bytes_sent"):
        row[k] = round(ranks.all_mean(float(st[k])) * ranks.world)
    raw = _sum_over_ranks(
        ranks,
        [
            parts.exchange.stats.raw["fwd"],
            parts.exchange.stats.sent["fwd"],
            parts.exchange.stats.raw["bwd"],
            parts.exchange.stats.sent["bwd"],
        ],
    )
    row["fwd_ratio"] = raw[0] / raw[1] if raw[1] else float("nan")
    row["bwd_ratio"] = raw[2] / raw[3] if raw[3] else float("nan")
    return row


def _sum_over_ranks(ranks: Ranks, xs: list[float]) -> list[float]:
    t = torch.tensor(xs, dtype=torch.float64)
    if ranks.world > 1:
        dist.all_reduce(t)
    return t.tolist()


def format_summary(s: dict[str, Any]) -> str:
    """The readable end-of-run summary."""
    lines = [
        "",
        f"  AUC            {s['auc']:.4f}",
        f"  logloss        {s['logloss']:.4f}",
        f"  accuracy       {s['accuracy']:.4f}",
        f"  steps          {s['steps']} on {s['world_size']} rank(s)",
        f"  samples/s      {s['samples_per_s']:.0f}",
        f"  fwd ratio      {s['fwd_ratio']:.2f}x   (embedding all-to-all)",
        f"  bwd ratio      {s['bwd_ratio']:.2f}x   (gradient all-to-all)",
        f"  bytes on wire  {s['bytes_sent'] / 1e6:.2f} MB of {s['bytes_raw'] / 1e6:.2f} MB raw",
        f"  a2a time       fwd {s['a2a_fwd_s']:.2f} s, bwd {s['a2a_bwd_s']:.2f} s, "
        f"codec {s['codec_s']:.2f} s, all-reduce {s['allreduce_s']:.2f} s",
    ]
    return "\n".join(lines)


class _Logger:
    """Writes metrics.jsonl and prints lines, on rank 0 only."""

    def __init__(self, out: Path | None, append: bool) -> None:
        self.path = out / "metrics.jsonl" if out else None
        if self.path and not append:
            self.path.write_text("")

    def line(self, text: str) -> None:
        tqdm.write(text)

    def metrics(self, row: dict[str, Any]) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


# ---- launching ---------------------------------------------------------------------------
def launch(cfg: TrainConfig, argv: list[str]) -> int:
    """Start ``cfg.nproc`` local ranks under torchrun; its agent stops all on any failure."""
    worker_argv: list[str] = []
    skip = False
    for a in argv:  # workers learn their count from torchrun's env; torchrun would
        if skip:  # also misread "--nproc" as an abbreviation of its own flag
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            worker_argv.append(a)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.nproc}",
        "--max-restarts=0",
        "-m",
        "recsz.train",
        *worker_argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `recsz train`; tests call it with a list of flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_train_args(argv)
    if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
        if cfg.resolved_batch_size % cfg.nproc:
            # Refuse here, once, rather than in every rank after the launch.
            raise ValueError(
                f"--batch-size {cfg.resolved_batch_size} is not divisible by "
                f"--nproc {cfg.nproc}; use a multiple of {cfg.nproc}"
            )
        return launch(cfg, argv)
    rank = os.environ.get("RANK", "0")
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
