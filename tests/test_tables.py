"""The batched tables and their fused optimizers against plain per-table references:
``nn.EmbeddingBag`` per table with ``torch.optim`` (sparse gradients), and a row-wise
Adagrad written out row by row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recsz.model import ModelConfig, RowOptimizer, SparseArch
from recsz.model.tableinit import init_table

CFG = ModelConfig(table_sizes=(7, 3, 11, 5), emb_dim=4, bottom_mlp=(4,), top_mlp=(1,))


def reference_bags(tables: list[int], seed: int = 0) -> list[nn.EmbeddingBag]:
    bags = []
    for t in tables:
        bag = nn.EmbeddingBag(CFG.table_sizes[t], CFG.emb_dim, mode="sum", sparse=True)
        with torch.no_grad():
            bag.weight.copy_(init_table(CFG.table_sizes[t], CFG.emb_dim, seed, t))
        bags.append(bag)
    return bags


def batch_ids(b: int, seed: int) -> torch.Tensor:
    """(b, T) ids with many repeats (small tables)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (b,), generator=g) for n in CFG.table_sizes], 1)


def table_weights(arch: SparseArch) -> list[torch.Tensor]:
    return list(arch.weight.detach().split(arch.sizes))


@pytest.mark.parametrize("tables", [[0, 1, 2, 3], [2, 0], [3]])
def test_lookup_equals_per_table_bags(tables: list[int]) -> None:
    arch = SparseArch(CFG, tables, seed=0)
    ref = reference_bags(tables)
    ids = batch_ids(9, 1)
    out = arch(ids)
    expect = torch.stack([bag(ids[:, t : t + 1]) for bag, t in zip(ref, tables, strict=True)], 1)
    assert out.shape == (9, len(tables), CFG.emb_dim)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=8, max_size=8),
    weighted=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_bags_of_several_ids_equal_embedding_bag(lengths: list[int], weighted: bool, seed: int):
    tables = [1, 3]
    arch = SparseArch(CFG, tables, seed=0, optimizer=RowOptimizer("sgd", lr=1.0))
    ref = reference_bags(tables)
    lens = torch.tensor(lengths).view(4, 2)  # 4 samples x 2 tables
    g = torch.Generator().manual_seed(seed)
    per = [torch.randint(0, CFG.table_sizes[tables[j]], (int(n),), generator=g) for n, j in
           zip(lens.view(-1), [0, 1] * 4, strict=True)]  # fmt: skip
    ids = torch.cat(per)
    psw = torch.rand(ids.numel(), generator=g) if weighted else None
    out = arch.bags(ids, lens, psw)
    w = psw.split(lens.view(-1).tolist()) if psw is not None else None
    for s in range(4):
        for j in range(2):
            k = s * 2 + j
            x = per[k]
            pw = w[k] if w is not None else None
            expect = ref[j](x, torch.zeros(1, dtype=torch.long), per_sample_weights=pw)
            torch.testing.assert_close(out[s, j], expect[0], rtol=1e-6, atol=1e-6)
    # Backward with SGD lr 1 moves each row by minus its gradient.
    before = arch.weight.detach().clone()
    upstream = torch.randn(out.shape, generator=g)
    (out * upstream).sum().backward()
    for j, bag in enumerate(ref):
        lens_j = lens[:, j]
        ids_j = torch.cat([per[s * 2 + j] for s in range(4)])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lens_j.cumsum(0)[:-1]])
        pw = None
        if psw is not None:
            pw = torch.cat([w[s * 2 + j] for s in range(4)]) if w is not None else None
        y = bag(ids_j, starts, per_sample_weights=pw)
        (y * upstream[:, j]).sum().backward()
        grad = bag.weight.grad.to_dense() if bag.weight.grad is not None else 0
        moved = arch.weight.detach().split(arch.sizes)[j] - before.split(arch.sizes)[j]
        torch.testing.assert_close(moved, -grad if torch.is_tensor(grad) else moved * 0,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_fused_optimizer_equals_torch_sparse_optimizer(kind: str) -> None:
    """Several steps with repeated ids: the same weights as nn.EmbeddingBag + torch.optim."""
    tables = [0, 2, 3]
    lr = 0.3
    arch = SparseArch(CFG, tables, seed=0, optimizer=RowOptimizer(kind, lr))
    ref = reference_bags(tables)
    params = [b.weight for b in ref]
    torch.sparse.check_sparse_tensor_invariants.disable()  # the reference's sparse grads
    opt = torch.optim.SGD(params, lr=lr) if kind == "sgd" else torch.optim.Adagrad(params, lr=lr)
    for step in range(5):
        ids = batch_ids(16, step)
        g = torch.Generator().manual_seed(step)
        up = torch.randn(16, len(tables), CFG.emb_dim, generator=g)
        (arch(ids) * up).sum().backward()
        opt.zero_grad()
        out = torch.stack([b(ids[:, t : t + 1]) for b, t in zip(ref, tables, strict=True)], 1)
        (out * up).sum().backward()
        opt.step()
    assert arch.weight.grad is None  # the update happened inside backward
    for mine, bag in zip(table_weights(arch), ref, strict=True):
        torch.testing.assert_close(mine, bag.weight.detach(), rtol=1e-6, atol=1e-7)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]))
def test_sync_free_row_sums_update_as_the_distinct_rows_do(seed: int, kind: str) -> None:
    """The GPU's sync-free update (every position keeps its row, copies write the same
    result) leaves the weights and state of the update over distinct rows. In float64: the
    two sum a row's gradients in different orders, which float32 rounds apart (seed 12707,
    adagrad: 1.4e-6 relative)."""
    g = torch.Generator().manual_seed(seed)
    n_rows, n = 40, int(torch.randint(1, 60, (1,), generator=g))
    rows = torch.randint(0, n_rows, (n,), generator=g) ** 2 % n_rows  # many repeats
    grad = torch.randn(n, 8, generator=g, dtype=torch.float64)
    opt = RowOptimizer(kind, 0.3)
    w0 = torch.randn(n_rows, 8, generator=g, dtype=torch.float64)
    out = []
    for keep in (False, True):
        w = w0.clone()
        state = opt.new_state(w)
        for _ in range(2):
            opt.step(w, state, rows, grad, keep_size=keep)
        out.append((w, state))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-6, atol=1e-6)


def test_rowwise_adagrad_equals_row_by_row_reference() -> None:
    tables = [0, 1, 2, 3]
    lr, eps = 0.2, 1e-8
    arch = SparseArch(CFG, tables, seed=0, optimizer=RowOptimizer("rowwise_adagrad", lr))
    w = [init_table(CFG.table_sizes[t], CFG.emb_dim, 0, t) for t in tables]
    acc = [torch.zeros(CFG.table_sizes[t]) for t in tables]
    for step in range(4):
        ids = batch_ids(12, 10 + step)
        up = torch.randn(12, 4, CFG.emb_dim, generator=torch.Generator().manual_seed(step))
        (arch(ids) * up).sum().backward()
        for j, _ in enumerate(tables):
            grads: dict[int, torch.Tensor] = {}
            for s in range(12):  # the gradient of a row is the sum over samples reading it
                r = int(ids[s, j])
                grads[r] = grads.get(r, torch.zeros(CFG.emb_dim)) + up[s, j]
            for r, gr in grads.items():
                acc[j][r] += float((gr * gr).mean())
                w[j][r] -= lr * gr / (acc[j][r].sqrt() + eps)
    for mine, ref in zip(table_weights(arch), w, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-7)
    assert arch.optimizer_state.shape == (sum(CFG.table_sizes),)  # one value per row


def test_frozen_tables_and_no_grad_leave_weights() -> None:
    arch = SparseArch(CFG, [0, 1], seed=0)  # no optimizer
    out = arch(batch_ids(4, 0))
    assert not out.requires_grad
    trained = SparseArch(CFG, [0, 1], seed=0, optimizer=RowOptimizer("sgd", 1.0))
    with torch.no_grad():
        assert not trained(batch_ids(4, 0)).requires_grad
    torch.testing.assert_close(trained.weight.detach(), arch.weight.detach())


def test_state_dict_round_trip_carries_optimizer_state() -> None:
    a = SparseArch(CFG, [2, 3], seed=0, optimizer=RowOptimizer("adagrad", 0.1))
    a(batch_ids(8, 0)).sum().backward()
    b = SparseArch(CFG, [2, 3], seed=1, optimizer=RowOptimizer("adagrad", 0.1))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b.weight, a.weight)
    torch.testing.assert_close(b.optimizer_state, a.optimizer_state)
    assert float(a.optimizer_state.abs().sum()) > 0


def test_bad_input_is_named() -> None:
    arch = SparseArch(CFG, [1, 3], seed=0)
    ids = batch_ids(3, 0)
    ids[2, 3] = 5  # table 3 has 5 rows
    with pytest.raises(IndexError, match="table 3: id 5 outside"):
        arch(ids)
    with pytest.raises(IndexError, match="table 1: id 3 outside"):
        arch.bags(torch.tensor([3, 0]), torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="do not describe"):
        arch.bags(torch.tensor([0]), torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="not one of"):
        RowOptimizer("adam", 0.1)
