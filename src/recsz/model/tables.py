"""A rank's embedding tables as one batched module, with the optimizer fused into backward.

All of a rank's tables live in one weight buffer, table j's rows starting at
``offsets[j]``; one ``embedding_bag`` call looks every table up (the design of fbgemm's
TableBatchedEmbeddingBags), and the backward applies the row optimizer
(:mod:`recsz.model.rowopt`) to the rows the batch read, with no gradient tensor the size
of the tables and no separate optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recsz.devicepath import device_path
from recsz.model.config import ModelConfig
from recsz.model.fiited import FiitedLookup, FiitedSpec, FiitedStore
from recsz.model.multihot import Bags, mlperf_draws
from recsz.model.rowopt import RowOptimizer
from recsz.model.tableinit import init_table
from recsz.model.ttrec import TTSpec, TTTables
from recsz.profiling import stage


class SparseArch(nn.Module):
    """Some or all of the embedding tables, pooled by sum, in one buffer.

    Args:
        cfg: the model (rows per table, dim).
        tables: the global table indices held here, in order.
        seed: initialization (per table, so any sharding starts from the same weights).
        optimizer: the fused row optimizer; None freezes the tables (no gradient flows).
        tt: which tables are tensor trains (TT-Rec).
        fiited: the dense tables as a FIITED chunk store that prunes dimensions.
        hotness: ids per bag of every table of the model (None: one), the bags made from
            each one-hot id as MLPerf's multi-hot Criteo (:mod:`recsz.model.multihot`).
        bag_draws: where a bag's other ids come from: "hash" or "mlperf" (the reference's
            draws, held for the tables here: :func:`recsz.model.multihot.mlperf_draws`).
        dtype: what the dense tables' rows are stored in (float32, or float16 / bfloat16:
            half the memory; looked up into float32, a bag's rows summed in float32;
            updated in float32 and rounded stochastically,
            :func:`recsz.model.rowopt.round_stochastic`).
        shards: every table of the model split into this many column shards, each a table
            of its own here (``tables`` index them: shard c of table t is t * shards + c),
            D / shards wide, looked up with table t's ids (and bags), started as table t's
            columns (:func:`recsz.model.sharding.column_shards`; no TT or FIITED tables).
        device: where the dense tables' rows (and their optimizer's state) are made, in
            place (:func:`recsz.model.tableinit.init_table`): a GPU's never pass through
            the host. The rest is made on the CPU and moved by ``.to()`` (FIITED's store
            too: its rows start on the CPU).
    """

    offsets: torch.Tensor  # (|dense tables|,) each table's first row in ``weight``
    dense_pos: torch.Tensor  # where the dense tables' columns go in the output
    dense_cols: torch.Tensor  # the dense tables' columns in the global ids
    tt_pos: torch.Tensor  # where the TT tables' columns go
    rows: torch.Tensor  # (|tables|,) rows per table, for one range check of all
    optimizer_state: torch.Tensor  # the row optimizer's accumulator

    def __init__(
        self,
        cfg: ModelConfig,
        tables: Sequence[int],
        seed: int,
        optimizer: RowOptimizer | None = None,
        tt: TTSpec | None = None,
        fiited: FiitedSpec | None = None,
        hotness: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        shards: int = 1,
        bag_draws: str = "hash",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if fiited is not None and dtype != torch.float32:
            raise ValueError("FIITED's chunk store keeps float32 rows (--table-dtype fp32)")
        self.tables = list(tables)
        self.shards = shards
        tt_set = tt.tables if tt is not None else frozenset()
        if shards > 1 and (tt_set or fiited is not None):
            raise ValueError("column shards of TT or FIITED tables are not supported")
        self.dense_tables = [t for t in self.tables if t not in tt_set]
        whole = [t // shards for t in self.dense_tables]  # each one's table of the model
        self.sizes = [cfg.table_sizes[t] for t in whole]
        self.dim = cfg.emb_dim // shards
        self.optimizer = optimizer
        self.dense_bytes = 4 * self.dim * sum(cfg.table_sizes[t // shards] for t in self.tables)
        start = torch.tensor([0, *self.sizes], dtype=torch.int64).cumsum(0)
        held = dtype if fiited is None else torch.float32  # (FIITED's store: float32 rows)
        made_on = torch.device(device) if fiited is None else torch.device("cpu")
        weight = torch.empty(int(start[-1]), self.dim, dtype=held, device=made_on)
        for j, t in enumerate(self.dense_tables):
            c = t % shards
            cols = slice(c * self.dim, (c + 1) * self.dim) if shards > 1 else slice(None)
            rows = weight[start[j] : start[j + 1]]
            init_table(self.sizes[j], cfg.emb_dim, seed, whole[j], cols, out=rows)
        self.tt = TTTables(cfg, [t for t in self.tables if t in tt_set], seed, optimizer, tt,
                          hotness=hotness, bag_draws=bag_draws)  # fmt: skip
        pos = {t: j for j, t in enumerate(self.tables)}
        self.register_buffer(
            "dense_pos", torch.tensor([pos[t] for t in self.dense_tables]), persistent=False
        )
        self.register_buffer(
            "dense_cols", torch.tensor(whole, dtype=torch.int64), persistent=False
        )  # each dense table's column of the model's ids
        self.register_buffer(
            "tt_pos", torch.tensor([pos[t] for t in self.tt.tables], dtype=torch.int64),
            persistent=False,
        )  # fmt: skip
        self.store = None if fiited is None else FiitedStore(weight, self.sizes, fiited, optimizer)
        if self.store is not None:  # the rows live in the store
            weight = weight[:0]
        weight = weight.to(dtype)
        # A parameter so that .to() and state_dict() carry it, but no torch optimizer owns
        # it: the backward updates it in place and leaves .grad empty.
        self.weight = nn.Parameter(weight, requires_grad=optimizer is not None)
        self.register_buffer("offsets", start[:-1].clone(), persistent=False)
        self.multi_hot: Bags | None = None
        if hotness is not None and any(hotness[t] > 1 for t in whole):  # a table's shards: its bags
            draws = (
                mlperf_draws(cfg.table_sizes, hotness, set(whole))
                if bag_draws == "mlperf"
                else None
            )
            self.multi_hot = Bags(whole, hotness, self.sizes, start[:-1].tolist(), draws)
        self.register_buffer("rows", torch.tensor(self.sizes, dtype=torch.int64), persistent=False)
        state = optimizer.new_state(weight) if optimizer else torch.zeros(0)  # none with a store
        self.register_buffer("optimizer_state", state)

    @property
    def bytes_held(self) -> int:
        """What this rank's tables hold: the dense rows (or FIITED's store) and the TT
        cores (float32)."""
        store = self.store.bytes_held if self.store is not None else 0
        rows = self.weight.numel() * self.weight.element_size()
        return rows + self.tt.bytes_held + store

    def prune(self) -> None:
        """FIITED: keep each table's most important chunks (no-op without a store)."""
        if self.store is not None:
            self.store.prune()

    def chunk_counts(self) -> dict[int, torch.Tensor]:
        """FIITED: per dense table, each row's number of held chunks (empty without)."""
        if self.store is None:
            return {}
        counts = self.store.count.cpu().split(self.sizes)
        return dict(zip(self.dense_tables, counts, strict=True))

    def kept(self) -> dict[int, float]:
        """FIITED: per dense table, the fraction of its chunks held (empty without)."""
        k = self.store.k if self.store is not None else 1
        return {t: float(c.float().mean()) / k for t, c in self.chunk_counts().items()}

    @torch.no_grad()
    def start_from(self, tables: Sequence[torch.Tensor]) -> None:
        """Each held table's rows from the model's whole ``tables`` ((rows, D) each): a
        column shard its columns, rounded to the rows' dtype (``--init-from``)."""
        if self.store is not None or self.tt.tables:
            raise ValueError("FIITED's store and TT tables do not start from dense rows")
        at = 0
        for t, n in zip(self.dense_tables, self.sizes, strict=True):
            whole, c = divmod(t, self.shards)
            cols = tables[whole][:, c * self.dim : (c + 1) * self.dim]
            self.weight[at : at + n] = cols.to(self.weight.device, self.weight.dtype)
            at += n

    @torch.no_grad()
    def table_weights(self) -> dict[int, torch.Tensor]:
        """Each table's rows held here as float32, by its index in ``tables``: a FIITED
        table's pruned chunks as zeros, a TT table's cores multiplied out (export)."""
        if self.store is not None:
            dense = self.store.lookup(torch.arange(sum(self.sizes), device=self.rows.device))
        else:
            dense = self.weight.detach().float()
        out = dict(zip(self.dense_tables, dense.split(self.sizes), strict=True))
        return {**out, **self.tt.weights()}

    def forward(self, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """ids (B, T_all), one global id per sample and table -> pooled (B, |tables|, D).
        Each id is checked against its table's size (on a GPU one host sync) unless the
        caller has (``checked``: ids from a source made for these tables' sizes)."""
        if not self.tt.tables:
            return self._dense(ids, checked)
        b = ids.shape[0]
        out = self.weight.new_zeros(b, len(self.tables), self.dim, dtype=torch.float32)
        if self.dense_tables:
            out = out.index_copy(1, self.dense_pos, self._dense(ids, checked))
        return out.index_copy(1, self.tt_pos, self.tt(ids, checked))

    def _dense(self, ids: torch.Tensor, checked: bool) -> torch.Tensor:
        n = len(self.dense_tables)
        if not n or not ids.numel():
            return self.weight.new_zeros(ids.shape[0], n, self.dim, dtype=torch.float32)
        with stage("recsz.lookup"):
            mine = ids.index_select(1, self.dense_cols)  # (B, T_dense); a list: a host copy
            if not checked:
                self._check_range(mine, torch.arange(n, device=ids.device))
            if self.multi_hot is not None:  # each id's bag
                rows, starts = self.multi_hot.rows(mine)
                return self._pool(rows, starts, None, (ids.shape[0], n, self.dim))
            rows = (mine + self.offsets).view(-1)
            return self._pool(rows, None, None, (ids.shape[0], n, self.dim))

    def bags(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bags of several ids: ``lengths`` (B, |tables|) ids per sample and table; ``ids``
        (lengths.sum(),) laid out sample by sample, each sample's tables in order; optional
        weight per id. -> pooled (B, |tables|, D), an empty bag pooling to zeros."""
        b, n_t = lengths.shape
        if self.tt.tables:
            raise NotImplementedError("bags of several ids in TT tables are not supported yet")
        if n_t != len(self.tables):
            raise ValueError(f"lengths has {n_t} tables, this module holds {len(self.tables)}")
        if int(lengths.sum()) != ids.numel() or bool((lengths < 0).any()):
            raise ValueError(
                f"lengths (sum {int(lengths.sum())}) do not describe {ids.numel()} ids"
            )
        table_of = (
            torch.arange(n_t, device=ids.device).repeat(b).repeat_interleave(lengths.view(-1))
        )
        self._check_range(ids, table_of)
        starts = torch.zeros(b * n_t, dtype=torch.int64, device=ids.device)
        starts[1:] = lengths.view(-1)[:-1].cumsum(0)
        return self._pool(
            ids + self.offsets[table_of], starts, per_sample_weights, (b, n_t, self.dim)
        )

    def _check_range(self, ids: torch.Tensor, table_of: torch.Tensor) -> None:
        """Each id against the size of its dense table (``table_of``, broadcast against
        ``ids``): one check (one host sync on a GPU) for every table."""
        wrong = (ids < 0) | (ids >= self.rows[table_of])
        if bool(wrong.any()):
            ids, table_of = (t.reshape(-1) for t in torch.broadcast_tensors(ids, table_of))
            i = int(wrong.reshape(-1).nonzero()[0])
            j = int(table_of[i])
            raise IndexError(
                f"table {self.dense_tables[j]}: id {int(ids[i])} outside [0, {self.sizes[j]})"
            )

    @property
    def takes_sparse_grad(self) -> bool:
        """The pooled output of :meth:`forward` takes a sparse COO gradient (rows for some
        (sample, table) pairs only; the fused update reads just those): all tables dense
        rows, no FIITED store; bags of several ids off a GPU's path only (their ids' count
        is read on the host)."""
        bags_ok = self.multi_hot is None or not device_path(self.weight.device)
        plain = not self.tt.tables and self.store is None and bags_ok
        return plain and self.optimizer is not None

    def _pool(
        self,
        rows: torch.Tensor,
        starts: torch.Tensor | None,
        psw: torch.Tensor | None,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        if self.store is not None:  # the rows, then bags over them
            train = self.optimizer is not None and torch.is_grad_enabled()
            vecs = FiitedLookup.apply(self.store.pool, rows, self.store) if train else None
            vecs = self.store.lookup(rows) if vecs is None else vecs
            if starts is None and psw is None:
                return vecs.view(shape)
            at = torch.arange(rows.numel(), device=rows.device)
            return _bag(vecs, at, starts, psw).view(shape)
        if self.optimizer is None or not torch.is_grad_enabled():
            return _bag(self.weight.detach(), rows, starts, psw).view(shape).float()
        return _FusedLookup.apply(self.weight, rows, starts, psw, self, shape)


def _bag(
    weight: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor | None, psw: torch.Tensor | None
) -> torch.Tensor:
    if starts is None:  # one row per bag
        starts = torch.arange(rows.numel(), device=rows.device)
    elif weight.dtype != torch.float32:  # half rows: their bags summed in float32
        weight, rows = (
            weight.index_select(0, rows).float(),
            torch.arange(rows.numel(), device=rows.device),
        )
    return F.embedding_bag(rows, weight, starts, mode="sum", per_sample_weights=psw)


class _FusedLookup(torch.autograd.Function):
    """Pools rows forward; backward turns the pooled gradient into row gradients and
    applies the row optimizer to them in place (returns no weight gradient)."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor | None,
        psw: torch.Tensor | None,
        arch: SparseArch,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        ctx.rows, ctx.starts, ctx.psw, ctx.arch = rows, starts, psw, arch
        return _bag(weight.detach(), rows, starts, psw).view(shape).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        rows, psw, source = ctx.rows, ctx.psw, None  # source: each id's bag's gradient
        if grad.is_sparse:  # gradients of some (sample, table) bags only: their ids only
            at = grad._indices()
            bags, g = at[0] * grad.shape[1] + at[1], grad._values()
            if ctx.starts is None:
                rows = rows.index_select(0, bags)
            else:
                pos, source = _bag_positions(ctx.starts, rows.numel(), bags)
                rows = rows.index_select(0, pos)
                psw = None if psw is None else psw.index_select(0, pos)
        else:
            g = grad.reshape(-1, grad.shape[-1])
            if ctx.starts is not None:
                n = rows.numel()
                source = torch.arange(g.shape[0], device=g.device)
                source = source.repeat_interleave(_bag_sizes(ctx.starts, n), output_size=n)
        if psw is not None:  # weighted: each id's own gradient
            g = (g if source is None else g.index_select(0, source)) * psw.unsqueeze(1)
            source = None
        arch = ctx.arch
        with stage("recsz.table_update"):
            arch.optimizer.step(arch.weight.data, arch.optimizer_state, rows, g, source=source)
        return None, None, None, None, None, None


def _bag_sizes(starts: torch.Tensor, n: int) -> torch.Tensor:
    """Ids in each bag, bag i's starting at ``starts[i]`` of ``n``."""
    return torch.cat([starts[1:], starts.new_full((1,), n)]) - starts


def _bag_positions(
    starts: torch.Tensor, n: int, bags: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions among the ids (``n``, bag i's from ``starts[i]``) of the bags
    ``bags[k]``, and for each the k of its bag: the bags in their order in the batch, so
    that each row's gradients add up in the order the dense gradient's would (the same
    sums). Their count is read on the host (:attr:`SparseArch.takes_sparse_grad`: not on
    a GPU's path)."""
    bags, order = torch.sort(bags)
    lens = _bag_sizes(starts, n).index_select(0, bags)
    at = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    pos = torch.repeat_interleave(starts.index_select(0, bags) - at, lens, output_size=total)
    pos += torch.arange(total, device=pos.device)
    return pos, torch.repeat_interleave(order, lens, output_size=total)
