"""The model parts of one rank and what they do in one step: build them, train on a
global batch (:mod:`recsz.evaluation` evaluates them).

    every rank reads its part of the global batch (B samples): its slice of b = B / W
    samples, and its tables' ids of all B (data.source.Part; what else a source may leave 0)
    table owner:  pooled = lookup(own tables, all B ids)           # (B, |T_r|, D)
                  start forward all-to-all (one payload per destination)
    sample owner: x = bottom MLP(own dense)                        # overlaps the a2a
                  emb = wait()                                     # (b, T, D)
                  loss = BCE(top MLP(interact(x, emb)), labels)
                  backward: DDP all-reduce of MLP grads; the exchange sends d emb back
    table owner:  sparse update of its tables

World size 1 runs the same code with the all-to-all looping back to itself, so a
single-process run measures exactly the codec the distributed one uses.
(docs/ARCHITECTURE.md follows one step through the modules; :mod:`recsz.train` runs them.)
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from recsz import hostmemory
from recsz.codecs import get_codec
from recsz.comm.direction import Direction
from recsz.comm.dp_hooks import DPComm
from recsz.comm.dp_hooks import register as register_dp_hook
from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.route import host_of, host_ranks, plain_within_host
from recsz.comm.stats import ShardPlan
from recsz.comm.switch import device_sync, max_over
from recsz.config import TrainConfig
from recsz.data.source import Batch, Part
from recsz.model import DenseArch, RowOptimizer, SparseArch, dense_optimizer, tt_parameters
from recsz.model.fiited import HeldMask
from recsz.model.multihot import draws_nbytes
from recsz.model.rowopt import TABLE_DTYPES
from recsz.model.schedule import ScheduledRates
from recsz.model.sharding import optimizer_row_bytes, plan_tables
from recsz.model.ttrec import TTTables
from recsz.policy.factory import make_policy
from recsz.profiling import stage
from recsz.ranks import Ranks

# DDP without a buffer broadcast each forward: `forward_sync_buffers` from torch 2.13 (where
# `broadcast_buffers` warns it is deprecated), `broadcast_buffers` before it (torch 2.11 on
# the lent GPU machines).
DDP_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)


# ---- model parts and optimizers -------------------------------------------------------
@dataclass
class Parts:
    sparse: SparseArch
    dense: nn.Module  # DenseArch, or DDP around it
    #: the MLPs' (the tables' runs inside their backward); None: built to score, not train
    dense_opt: torch.optim.Optimizer | None
    exchange: EmbeddingExchange
    dp: DPComm  # the MLP gradients' exchange (DDP hook), its state and counters
    rates: ScheduledRates | None = None  # --lr-warmup-steps / --lr-decay-steps (None: constant)
    #: --column-shards: each exchanged table's column of the model's ids (None: one a table)
    columns: torch.Tensor | None = None

    @property
    def dense_module(self) -> DenseArch:
        m = self.dense.module if isinstance(self.dense, DDP) else self.dense
        assert isinstance(m, DenseArch)
        return m


def table_owners(cfg: TrainConfig, world: int) -> list[int]:
    """Each (sharded) table's rank under ``cfg`` on ``world`` ranks (-1: replicated TT
    tables, on every rank, out of the plan and of the all-to-all): the planner's, each table
    charged what its rank will hold for it (:func:`_charged_rows`)."""
    charged = _charged_rows(cfg)
    sizes, dim = cfg.sharded_tables()
    owners = [-1] * len(sizes)
    for t, r in zip(charged, plan_tables(list(charged.values()), dim, world), strict=True):
        owners[t] = r
    return owners


def _charged_rows(cfg: TrainConfig) -> dict[int, int]:
    """Each sharded table's load, in rows of the tables' width and dtype (replicated TT
    tables: none): its rows, a TT table its cores; with MLPerf's bag draws
    (``--multi-hot-draws mlperf``) a table's draws beside its rows, on each of its shards
    (each holds them)."""
    tt, hot = cfg.tt_spec(), cfg.hotness()
    local = tt.replicated if tt is not None else frozenset()
    sizes, dim = cfg.sharded_tables()  # (--column-shards: each table's shards)
    row_bytes = dim * TABLE_DTYPES[cfg.table_dtype].itemsize
    whole = cfg.model().table_sizes
    drawn = [0] * len(whole)  # each whole table's draws, in rows of its shards
    if hot is not None and cfg.multi_hot_draws == "mlperf":
        drawn = [-(-draws_nbytes(whole, hot, [t]) // row_bytes) for t in range(len(whole))]
    charged = {}
    for t, n in enumerate(sizes):
        if t in local:
            continue
        if tt is not None and t in tt.tables:
            n = -(-tt_parameters(n, dim, tt.rank, tt.cores) // dim)
        charged[t] = n + drawn[t // cfg.column_shards]
    return charged


def held_bytes(cfg: TrainConfig, owners: list[int], world: int, train: bool = True) -> list[int]:
    """What each of ``world`` ranks holds for its tables under ``owners``, in bytes: a
    plain table's rows and (``train``) their row optimizer's state, a TT table's cores
    (float32), and with MLPerf's bag draws its tables' draws (once a rank, however many
    shards of a table it holds). What `recsz plan` prints, a rank a row."""
    sizes, dim = cfg.sharded_tables()
    tt = cfg.tt_spec()
    state = optimizer_row_bytes(cfg.resolved("emb_optimizer"), dim) if train else 0
    row = dim * TABLE_DTYPES[cfg.table_dtype].itemsize + state
    out = rank_draws(cfg, owners, world)
    for t, r in enumerate(owners):
        if r < 0:  # replicated TT tables: out of the plan
            continue
        if tt is not None and t in tt.tables:
            out[r] += 4 * tt_parameters(sizes[t], dim, tt.rank, tt.cores)
        else:
            out[r] += sizes[t] * row
    return out


def rank_draws(cfg: TrainConfig, owners: list[int], world: int) -> list[int]:
    """The bytes of MLPerf's bag draws (``--multi-hot-draws mlperf``) each rank holds under
    ``owners``: a table's once on each rank holding any of its shards (a replicated TT
    table's on every rank); none otherwise."""
    hot = cfg.hotness()
    if hot is None or cfg.multi_hot_draws != "mlperf":
        return [0] * world
    whole = cfg.model().table_sizes
    everywhere = {t // cfg.column_shards for t, r in enumerate(owners) if r < 0}
    mine: list[set[int]] = [set(everywhere) for _ in range(world)]
    for t, r in enumerate(owners):
        if r >= 0:
            mine[r].add(t // cfg.column_shards)
    return [draws_nbytes(whole, hot, m) for m in mine]


#: what makes tables fit: on a host (its ranks' together), on a GPU (its rank's)
_HOST_ROOM = (
    "spread them over more hosts (recsz plan --nproc N prints each rank's share), halve "
    "them (--table-dtype fp16) or compress the largest (--tt-tables K)"
)
_GPU_ROOM = (
    "spread them over more ranks (recsz plan --nproc N prints each rank's share), split the "
    "large ones (--column-shards K), halve them (--table-dtype fp16) or compress the largest "
    "(--tt-tables K)"
)


def refuse_tables_that_cannot_fit(
    cfg: TrainConfig, owners: list[int], ranks: Ranks, train: bool = True
) -> None:
    """Before any table is made: MemoryError where this host's ranks' tables need more than
    the host's memory (the ranks make theirs at once: on the CPU all they hold, for GPUs
    what passes through the host, MLPerf's bag draws; the rows are made on the GPU), or
    this rank's more than its GPU's; what they would hold (``train``: with their
    optimizer's state), not what is free (other ranks may be allocating)."""
    need, gb = held_bytes(cfg, owners, ranks.world, train), 1e9
    on_host = rank_draws(cfg, owners, ranks.world) if cfg.device == "cuda" else need
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
    first = ranks.rank - int(os.environ.get("LOCAL_RANK", ranks.rank))
    host = on_host[first : first + local]
    have = hostmemory.total()
    if sum(host) > have:
        who = f"rank {first}'s tables" if len(host) == 1 else (
            f"the tables of this host's ranks {first}-{first + len(host) - 1} "
            f"({', '.join(f'{x / gb:.1f}' for x in host)} GB)")  # fmt: skip
        raise MemoryError(f"{who} need {sum(host) / gb:.1f} GB, more than this host's "
                         f"{have / gb:.1f} GB of memory: {_HOST_ROOM}")  # fmt: skip
    if ranks.device.type == "cuda":
        gpu = torch.cuda.get_device_properties(ranks.device)
        if need[ranks.rank] > gpu.total_memory:
            raise MemoryError(f"rank {ranks.rank}'s tables need {need[ranks.rank] / gb:.1f} GB, "
                             f"more than its GPU's {gpu.total_memory / gb:.1f} GB ({gpu.name}): "
                             f"{_GPU_ROOM}")  # fmt: skip


def build_parts(cfg: TrainConfig, ranks: Ranks, train: bool = True) -> tuple[Parts, list[int]]:
    """This rank's parts under ``cfg``, and every table's rank. ``train=False`` (to score:
    evaluate, predict, export): no optimizer and no optimizer state (exact Adagrad's
    doubles the tables), no DDP around the MLPs (nothing to all-reduce); a checkpoint
    loads into them all the same (:func:`recsz.checkpoint.load`)."""
    mcfg = cfg.model()
    tt = cfg.tt_spec()
    local = tt.replicated if tt is not None else frozenset()
    sizes, _ = cfg.sharded_tables()
    owners = table_owners(cfg, ranks.world)
    refuse_tables_that_cannot_fit(cfg, owners, ranks, train)
    plan = ShardPlan(owners, ranks.world)
    row_opt = RowOptimizer(cfg.resolved("emb_optimizer"), cfg.resolved("emb_lr"))
    emb_opt = row_opt if train else None
    fiited = cfg.fiited_spec()
    hot = cfg.hotness()
    dtype = TABLE_DTYPES[cfg.table_dtype]
    mine = plan.tables_of(ranks.rank)
    sparse = SparseArch(mcfg, mine, cfg.seed, emb_opt, tt, fiited, hot, dtype, cfg.column_shards,
                        cfg.multi_hot_draws, ranks.device)  # fmt: skip
    sparse = sparse.to(ranks.device)  # (what was made on the host: TT cores, draws, indices)
    replicated = TTTables(mcfg, sorted(local), cfg.seed, emb_opt, tt, in_backward=False,
                          hotness=hot, bag_draws=cfg.multi_hot_draws)  # fmt: skip
    compute = torch.bfloat16 if cfg.dense_dtype == "bf16" else None
    init = cfg.resolved("mlp_init")
    dense_arch = DenseArch(mcfg, cfg.seed, replicated, compute, init).to(ranks.device)
    if cfg.compile:
        dense_arch.compile()  # in place: DDP and the checkpoints see the same module
    hosts = host_ranks(ranks.gather)  # (torchrun's nodes: --compress-scope, the eb hook)
    # --compress auto's switch: the exchange asks it each step, the MLPs' hook follows it
    switch = cfg.switch(agree=max_over(None), sync=device_sync(ranks.device))
    dp = DPComm(cfg.dp_comm, ranks.world)
    dense: nn.Module = dense_arch
    if ranks.world > 1 and train:
        group = dist.new_group()  # the MLP gradients' own (DPComm.group)
        dense = DDP(
            dense_arch,
            device_ids=[ranks.device] if ranks.device.type == "cuda" else None,
            process_group=group,
            gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in or out
            **DDP_NO_BUFFER_SYNC,  # its one buffer is a constant: no collective a step
        )
        goes_plain = (lambda: not switch.current) if cfg.compress == "auto" else None
        options = cfg.dp_hook_options()
        dp = register_dp_hook(dense, cfg.dp_comm, ranks.world, group, goes_plain, hosts=hosts,
                              **options)  # fmt: skip
    params, lr = dense_arch.mlp_parameters(), cfg.resolved("lr")
    dense_opt = dense_optimizer(cfg.resolved("dense_optimizer"), params, lr) if train else None
    fwd, bwd = (Direction(d, cfg.codec(d), make_policy(cfg, d, len(sizes))) for d in ("fwd", "bwd"))
    # --compress auto: the plain steps' directions (lossless; a codec that takes no bound
    # never asks its policy) and the switch, which every rank's step times decide alike
    plain = (
        Direction("fwd", get_codec("none"), fwd.policy),
        Direction("bwd", get_codec("none"), bwd.policy),
    )
    # --compress-scope: the blocks for ranks of this host may go plain on every step
    host = frozenset(host_of(hosts, ranks.rank))
    near = host if plain_within_host(cfg.compress_scope, len(hosts)) else frozenset()
    # A lone rank whose codecs code nothing sends nothing anywhere: id-aware traffic would
    # only sort its ids (on a GPU a host read a step). Bags keep it: their update reads
    # its sparse gradient (fewer bags to expand).
    alone = ranks.world == 1 and fwd.codec.identity and bwd.codec.identity and hot is None
    exchange = EmbeddingExchange(
        plan,
        ranks.rank,
        fwd,
        bwd,
        check_bounds=cfg.check_bounds,
        id_dedup=cfg.id_dedup and not alone,
        coalesce=cfg.bwd_coalesce and not alone,
        sparse_grad=sparse.takes_sparse_grad,
        plain=plain if cfg.compress == "auto" or near else None,
        switch=switch,
        near=near,
        host=host,
    )
    schedule = cfg.lr_schedule()
    rates = None
    if not schedule.constant and dense_opt is not None:  # every rate from one schedule
        opts = [dense_opt, *sparse.tt.optimizers, *replicated.optimizers]
        rates = ScheduledRates(schedule, row_opt, opts)
    k = cfg.column_shards
    columns = None if k == 1 else torch.arange(len(sizes), device=ranks.device) // k
    return Parts(sparse, dense, dense_opt, exchange, dp, rates, columns), owners


def rank_part(parts: Parts, ranks: Ranks) -> Part:
    """What this rank reads of a global batch: its samples, and its tables' ids of all."""
    k = parts.sparse.shards  # (--column-shards: a model's table for each of its shards)
    return Part(ranks.rank, ranks.world, tuple(sorted({t // k for t in parts.sparse.tables})))


def share_chunk_counts(parts: Parts, ranks: Ranks, chunk: int) -> None:
    """FIITED: every rank's held chunks per row, to every rank's exchange (one gather)."""
    gathered = ranks.gather(parts.sparse.chunk_counts())
    counts = {t: c.to(ranks.device) for mine in gathered for t, c in mine.items()}
    parts.exchange.grad_filter = HeldMask(counts, chunk) if counts else None


# ---- one step ------------------------------------------------------------
def forward(parts: Parts, batch_dense: torch.Tensor, ids: torch.Tensor, step: int) -> torch.Tensor:
    """Logits of this rank's b samples; ids are the global batch's (B, T)."""
    # checked: the sources are made for the model's table sizes (no host sync on a GPU).
    pooled = parts.sparse(ids, checked=True)  # (B, |T_r|, D)
    sent = ids if parts.columns is None else ids.index_select(1, parts.columns)  # shards' ids
    pending = parts.exchange.start_forward(pooled, step, sent)
    b = len(batch_dense)
    mine = ids[parts.exchange.rank * b : (parts.exchange.rank + 1) * b]
    # the bottom MLP runs while the bytes fly
    return parts.dense(batch_dense, pending, mine, checked=True)


def train_step(parts: Parts, batch: Batch, step: int, ranks: Ranks) -> torch.Tensor:
    """One optimizer step on the global ``batch`` (each rank trains on its slice); the
    loss stays where it was computed (read when logged: no host sync in the step)."""
    b = len(batch) // ranks.world
    mine = batch.slice(ranks.rank * b, (ranks.rank + 1) * b)
    logits = forward(parts, mine.dense, batch.ids, step)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, mine.labels)
    opt = parts.dense_opt
    assert opt is not None, "parts built to score (build_parts(train=False)) do not train"
    opt.zero_grad(set_to_none=True)
    loss.backward()  # also updates the tables (their optimizer is fused into it)
    with stage("recsz.dense_opt"):
        opt.step()
    if parts.dense_module.local is not None:  # replicated tables, on averaged gradients
        parts.dense_module.local.step()
    return loss.detach()
