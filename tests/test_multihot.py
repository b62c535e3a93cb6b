"""Multi-hot bags made from one-hot ids (MLPerf's DLRM-DCNv2 data): the bags themselves
(hashed, or MLPerf's reference's draws against its own algorithm), the batched lookup over
them against explicit bags, and the flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.config import TrainConfig, build_parser, parse_train_args
from recsz.devicepath import DEVICE_PATH_ON_CPU
from recsz.model import ModelConfig, RowOptimizer, SparseArch, multihot
from recsz.model.multihot import MLPERF_HOTNESS, Bags, mlperf_draws, parse_hotness
from recsz.model.rowopt import sum_by_row
from recsz.model.ttrec import TTEmbeddingBag
from tests.reference import reference_bags

CFG = ModelConfig(table_sizes=(7, 3, 11, 5), emb_dim=4, bottom_mlp=(4,), top_mlp=(1,))
HOT = (3, 1, 5, 2)


def one_hot(b: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (b,), generator=g) for n in CFG.table_sizes], 1)


def test_hotness_flag() -> None:
    assert parse_hotness("", 26) is None
    assert parse_hotness("1", 26) is None  # one id a bag: no bags
    assert parse_hotness("mlperf", 26) == MLPERF_HOTNESS and sum(MLPERF_HOTNESS) == 214
    assert parse_hotness("3", 4) == (3, 3, 3, 3)
    assert parse_hotness("3,1,5,2", 4) == HOT
    with pytest.raises(ValueError, match="mlperf gives 26 tables' bags, the model has 4"):
        parse_hotness("mlperf", 4)
    for bad in ("3,1", "0", "2,x", "1,1,1,-1"):
        with pytest.raises(ValueError, match=f"--multi-hot '{bad}'"):
            parse_hotness(bad, 4)
    assert TrainConfig(multi_hot="mlperf", tt_tables=2).tt_spec() is not None  # TT bags
    with pytest.raises(ValueError, match="--multi-hot with --fiited-mask-backward"):
        TrainConfig(multi_hot="2", fiited_budget=0.5, fiited_mask_backward=True)
    assert TrainConfig(multi_hot="mlperf").hotness() == MLPERF_HOTNESS
    with pytest.raises(ValueError, match="--multi-hot-draws mlperf draws bags: it needs"):
        parse_train_args(["--multi-hot-draws", "mlperf"])
    cfg = parse_train_args(["--multi-hot", "mlperf", "--multi-hot-draws", "mlperf"])
    assert cfg.multi_hot_draws == "mlperf" and TrainConfig().multi_hot_draws == "hash"


def test_the_mlps_start_as_learned_more_on_the_data() -> None:
    """--mlp-init's default: facebookresearch/dlrm's on one-hot data of up to 26 tables,
    PyTorch's (TorchRec's) on bags (benchmarks/bench_draws.py) or more tables
    (benchmarks/bench_mlpinit.py); a given one is kept, also from a config file."""
    assert TrainConfig().resolved("mlp_init") == "dlrm"
    assert TrainConfig(table_rows="26x100").resolved("mlp_init") == "dlrm"
    assert TrainConfig(table_rows="26x100,7").resolved("mlp_init") == "torch"
    assert TrainConfig(table_rows="40x100", mlp_init="dlrm").resolved("mlp_init") == "dlrm"
    assert TrainConfig(multi_hot="1").resolved("mlp_init") == "dlrm"
    assert TrainConfig(multi_hot="mlperf").resolved("mlp_init") == "torch"
    assert TrainConfig(multi_hot="mlperf", mlp_init="dlrm").resolved("mlp_init") == "dlrm"
    old = TrainConfig(multi_hot="2", mlp_init="dlrm").to_dict()
    assert TrainConfig.from_dict(old).resolved("mlp_init") == "dlrm"
    assert parse_train_args(["--multi-hot", "2"]).resolved("mlp_init") == "torch"
    assert parse_train_args(["--mlp-init", "torch"]).resolved("mlp_init") == "torch"
    assert build_parser().format_help().count("default: dlrm") == 1


def test_bags_train_the_tables_at_a_lower_default_rate() -> None:
    """With bags the tables' default rate is BAG_EMB_LR of the preset's (a bag's sum moves
    with all its rows), or the preset's own for bags; one-hot data and a given --emb-lr keep
    theirs."""
    from recsz.config import BAG_EMB_LR

    assert TrainConfig(preset="bench").resolved("emb_lr") == 0.05
    assert TrainConfig(preset="bench", multi_hot="mlperf").resolved("emb_lr") == 0.05 * BAG_EMB_LR
    assert TrainConfig(preset="bench", multi_hot="1").resolved("emb_lr") == 0.05
    assert TrainConfig(multi_hot="3", emb_lr=0.3).resolved("emb_lr") == 0.3
    # MLPerf's DLRM-DCNv2 rate is its bags' own
    assert TrainConfig(preset="dcnv2", multi_hot="mlperf").resolved("emb_lr") == 0.005


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), big=st.booleans())
def test_a_bag_starts_with_its_id_and_draws_the_rest_from_its_table(seed: int, big: bool):
    sizes = [7, 2**40 + 3] if big else [7, 3]  # ids past 2^32 too
    bags = Bags([0, 1], (4, 3), sizes, (0, 0))
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, n, (50,), generator=g) for n in sizes], 1)
    got = bags.ids(ids)
    assert got.shape == (50, 7)
    assert torch.equal(got[:, 0], ids[:, 0]) and torch.equal(got[:, 4], ids[:, 1])
    assert bool((got[:, :4] >= 0).all() and (got[:, :4] < 7).all())
    assert bool((got[:, 4:] >= 0).all() and (got[:, 4:] < sizes[1]).all())
    assert torch.equal(bags.ids(ids[:7]), got[:7])  # a function of the id alone


def test_drawn_ids_are_uniform_and_differ_by_table_and_slot() -> None:
    n = 1_000_003
    bags = Bags([0, 1], (9, 9), (n, n), (0, 0))
    got = bags.ids(torch.arange(200_000).view(-1, 1).repeat(1, 2))  # 200k ids, both tables
    drawn = got[:, 1:9]  # table 0's 8 drawn ids of each
    buckets = torch.bincount((drawn.reshape(-1) * 16) // n, minlength=16).double()
    assert float(buckets.min()) > 0.98 * float(buckets.mean())  # uniform within 2%
    assert float((got[:, 1:9] == got[:, 10:18]).double().mean()) < 1e-4  # tables differ
    assert float((got[:, 1] == got[:, 2]).double().mean()) < 1e-4  # so do slots


def test_mlperf_draws_are_the_reference_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn a block of rows at a time (here 4), kept for some tables only, the same ids as
    the reference's one call a table, tables before them and of one id a bag included."""
    sizes, hot = (9, 3, 13, 1, 6), (3, 1, 4, 2, 2)
    ref = reference_bags(sizes, hot)
    monkeypatch.setattr(multihot, "_DRAW_ROWS", 4)
    for kept in ({0, 1, 2, 3, 4}, {2}, {4, 1}, set()):
        got = mlperf_draws(sizes, hot, kept)
        assert sorted(got) == sorted(t for t in kept if hot[t] > 1)
        for t, d in got.items():
            assert d.dtype == torch.int32 and np.array_equal(d.numpy(), ref[t][:, 1:])
    whole = mlperf_draws(sizes, hot, range(5))  # held by the bags as drawn: no second copy
    bags = Bags([2, 0], hot, [13, 9], [0, 13], whole)
    assert bags.drawn.data_ptr() == whole.flat.data_ptr()
    with pytest.raises(ValueError, match=r"no draws of tables \[0\]"):
        Bags([2, 0], hot, [13, 9], [0, 13], mlperf_draws(sizes, hot, {2}))


@pytest.mark.parametrize("shards", [1, 2])
def test_mlperf_bags_are_the_materialized_datasets(shards: int) -> None:
    """Each id's bag with ``bag_draws="mlperf"``: the row of the reference's table that its
    materialized multi-hot day holds for that id (on any rank, and on column shards, which
    share their table's bags), and the lookup sums those rows."""
    ref = reference_bags(CFG.table_sizes, HOT)
    ids, mine = one_hot(64, 5), [0, 2, 3]
    tables = [t * shards + c for t in mine for c in range(shards)]
    arch = SparseArch(CFG, tables, seed=0, hotness=HOT, shards=shards, bag_draws="mlperf")
    assert arch.multi_hot is not None
    whole = [t // shards for t in tables]
    got = arch.multi_hot.ids(ids[:, whole])
    materialized = [torch.from_numpy(ref[t][ids[:, t].numpy()]) for t in whole]
    assert torch.equal(got, torch.cat(materialized, 1))
    plain = SparseArch(CFG, mine, seed=0, optimizer=None)
    bags = torch.cat([torch.from_numpy(ref[t][ids[:, t].numpy()]) for t in mine], 1)
    want = plain.bags(bags.reshape(-1), torch.tensor([HOT[t] for t in mine]).repeat(64, 1))
    out = arch(ids)  # (64, tables, dim / shards): a table's shards side by side
    torch.testing.assert_close(out.reshape(64, len(mine), -1), want, rtol=0, atol=0)


@pytest.mark.parametrize("draws", ["hash", "mlperf"])
def test_a_table_has_the_same_bags_on_every_shard(draws: str) -> None:
    ids = one_hot(32, 3)
    whole = SparseArch(CFG, [0, 1, 2, 3], seed=0, hotness=HOT, bag_draws=draws)
    for tables in ([2], [3, 0], [1, 2]):
        part = SparseArch(CFG, tables, seed=0, hotness=HOT, bag_draws=draws)
        torch.testing.assert_close(part(ids), whole(ids)[:, tables], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_multi_hot_lookup_and_updates_equal_explicit_bags(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and several fused updates (repeated ids in and across bags) as the explicit
    bag lookup of the same ids, table after table within each sample."""
    tables = [0, 2, 3]
    arch = SparseArch(CFG, tables, seed=0, optimizer=RowOptimizer(kind, 0.3), hotness=HOT)
    ref = SparseArch(CFG, tables, seed=0, optimizer=RowOptimizer(kind, 0.3))
    expand = Bags(tables, HOT, [CFG.table_sizes[t] for t in tables], [0] * len(tables))
    hot = torch.tensor([HOT[t] for t in tables])
    for step in range(4):
        ids = one_hot(16, step)
        flat = expand.ids(ids.index_select(1, torch.tensor(tables))).reshape(-1)
        out = arch(ids)
        want = ref.bags(flat, hot.repeat(16, 1))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        (out * up).sum().backward()
        (want * up).sum().backward()
        torch.testing.assert_close(arch.weight, ref.weight, rtol=0, atol=0)
    assert arch.takes_sparse_grad  # some bags' gradients: the ids of those bags
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    assert not arch.takes_sparse_grad  # their ids' count would be a host read on a GPU


def test_one_id_a_bag_is_the_one_hot_lookup() -> None:
    arch = SparseArch(CFG, [0, 1], seed=0, hotness=(1, 1, 1, 1))
    assert arch.multi_hot is None
    hot = SparseArch(CFG, [1], seed=0, hotness=HOT)  # table 1 has one id a bag
    assert hot.multi_hot is None


@pytest.mark.parametrize("draws", ["hash", "mlperf"])
def test_tt_tables_look_up_the_bags_of_dense_tables_and_train_their_cores_by_them(
    draws: str,
) -> None:
    """TT-Rec tables with bags (beside a dense table with bags): each TT table's column is
    the bag lookup of a dense table holding its cores' rows, the same bags as the dense
    tables'; its cores' step (SGD in the backward) is autograd's through that lookup."""
    from torch.nn import functional as F

    from recsz.model import TTSpec

    tables, tt = [0, 2, 3], frozenset({2, 3})
    opt = RowOptimizer("sgd", 0.3)
    arch = SparseArch(CFG, tables, 0, opt, tt=TTSpec(tt, 2, 2), hotness=HOT, bag_draws=draws)
    dense = SparseArch(CFG, tables, 0, opt, hotness=HOT, bag_draws=draws)
    assert arch.tt.multi_hot is not None and arch.tt.hotness == [5, 2]
    full = zip(arch.tt.tables, arch.tt.each, strict=True)
    dense.start_from(
        {0: dense.table_weights()[0], **{t: b.full_weight().detach() for t, b in full}}
    )
    ids = one_hot(16, 5)
    out, want = arch(ids), dense(ids)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # the cores' step against autograd through the dense lookup of the same bags
    drawn = mlperf_draws(CFG.table_sizes, HOT, tables) if draws == "mlperf" else None
    expand = Bags(tables, HOT, [CFG.table_sizes[t] for t in tables], [0] * 3, drawn)
    bag_ids = expand.ids(ids.index_select(1, torch.tensor(tables))).split([3, 5, 2], 1)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    cores = [[c.detach().clone() for c in bag.cores] for bag in arch.tt.each]
    (out * up).sum().backward()
    for j, (bag, before) in enumerate(zip(arch.tt.each, cores, strict=True)):
        ref = TTEmbeddingBag(bag.num_embeddings, bag.embedding_dim, 2, 2)
        with torch.no_grad():
            for p, c in zip(ref.cores, before, strict=True):
                p.copy_(c)
        (
            F.embedding_bag(bag_ids[j + 1], ref.full_weight(), mode="sum") * up[:, j + 1]
        ).sum().backward()
        for p, c, c0 in zip(bag.cores, ref.cores, before, strict=True):
            torch.testing.assert_close(p.detach(), c0 - 0.3 * c.grad, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    bags=st.integers(1, 40),
    rows=st.integers(1, 50),
    seed=st.integers(0, 10**6),
)
def test_summing_bag_gradients_by_row_equals_summing_each_ids(
    n: int, bags: int, rows: int, seed: int
) -> None:
    """The update's sums taken from one gradient a bag (one embedding_bag) are the sums of
    every id's copy added one position after another, bit for bit; so are the sums of the
    copies made (no ``source``), and, position by position, the GPU's (``keep_size``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g)
    source = torch.randint(0, bags, (n,), generator=g)
    grad = torch.randn(bags, 8, generator=g)
    acc: dict[int, torch.Tensor] = {}
    for i, s in zip(ids.tolist(), source.tolist(), strict=True):
        acc[i] = acc[i] + grad[s] if i in acc else grad[s].clone()
    want_rows = torch.tensor(sorted(acc))
    want = torch.stack([acc[i] for i in sorted(acc)])
    for got_rows, got in (sum_by_row(ids, grad, source=source), sum_by_row(ids, grad[source])):
        assert torch.equal(got_rows, want_rows) and torch.equal(got, want)
    every, sums = sum_by_row(ids, grad, keep_size=True, source=source)
    assert torch.equal(every, ids.sort().values)
    assert torch.equal(sums, want[torch.searchsorted(want_rows, every)])


def test_bags_over_a_fiited_store_train_as_over_dense_tables() -> None:
    """FIITED's chunk store, nothing pruned, looks the bags up and updates their rows as
    the dense tables do (SGD, several steps)."""
    from recsz.model import FiitedSpec

    opt = RowOptimizer("sgd", 0.3)
    store = SparseArch(CFG, [0, 2], 0, opt, fiited=FiitedSpec(1.0, 2), hotness=HOT)
    dense = SparseArch(CFG, [0, 2], 0, opt, hotness=HOT)
    assert store.store is not None
    for step in range(3):
        ids = one_hot(16, step)
        a, b = store(ids), dense(ids)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        up = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        (a * up).sum().backward()
        (b * up).sum().backward()


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad", "sgd"])
def test_bags_and_row_optimizers_equal_fbgemms_tbe(kind: str) -> None:
    """The same bags through fbgemm's table-batched embedding (the kernel TorchRec's DMP
    runs on CPU, with its exact fused optimizers): the same pooled vectors and weights,
    step after step, within float rounding."""
    tbe_ops = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    sizes, hot = (50, 30), (3, 5)
    cfg = ModelConfig(table_sizes=sizes, emb_dim=8, bottom_mlp=(8,), top_mlp=(1,))
    opt = RowOptimizer(kind, 0.1)
    ours = SparseArch(cfg, [0, 1], seed=0, optimizer=opt, hotness=hot)
    loc, dev = tbe_ops.EmbeddingLocation.HOST, tbe_ops.ComputeDevice.CPU
    tbe = tbe_ops.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, 8, loc, dev) for n in sizes],
        optimizer=getattr(configs.EmbOptimType, "EXACT_" + kind.upper()),
        learning_rate=0.1,
        eps={"rowwise_adagrad": 1e-8, "adagrad": 1e-10, "sgd": 0.0}[kind],
    )
    with torch.no_grad():
        for w, mine in zip(tbe.split_embedding_weights(), ours.weight.split(sizes), strict=True):
            w.copy_(mine)
    expand = Bags([0, 1], hot, sizes, [0, 0])
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(hot).repeat_interleave(16)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    for _ in range(5):
        ids = torch.stack([torch.randint(0, n, (16,), generator=g) for n in sizes], 1)
        values = torch.cat([p.reshape(-1) for p in expand.ids(ids).split(hot, dim=1)])
        theirs, mine = tbe(values, offsets).view(16, 2, 8), ours(ids)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
        up = torch.randn(16, 2, 8, generator=g)
        (theirs * up).sum().backward()
        (mine * up).sum().backward()
        updated = torch.cat(tbe.split_embedding_weights())
        torch.testing.assert_close(ours.weight.detach(), updated, rtol=0, atol=1e-6)
