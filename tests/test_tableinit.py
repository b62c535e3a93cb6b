"""A table's initial weights: the compiled CPU loop, torch's operations (the GPU's way) and a
plain numpy reference write the same bits, for any rows, columns, chunking and dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.devicepath import DEVICE_PATH_ON_CPU
from recsz.model import ModelConfig, RowOptimizer, SparseArch, tableinit
from recsz.model.tableinit import init_table, table_key


def reference(rows: int, dim: int, seed: int, table: int) -> np.ndarray:
    """splitmix64 of each element's place, the top 24 bits a float32 in [0, 1) scaled to
    +-sqrt(1/rows): written out in numpy's uint64, whole table at once."""
    with np.errstate(over="ignore"):
        x = np.arange(rows * dim, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x += np.uint64(table_key(seed, table))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    bound = (1.0 / rows) ** 0.5
    top = (x >> np.uint64(40)).astype(np.float32)
    return (top * np.float32(2 * bound * 2.0**-24) - np.float32(bound)).reshape(rows, dim)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    dim=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    table=st.integers(0, 1000),
    cut=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    block=st.sampled_from([1, 7, 64, 1 << 16]),
    device_path=st.booleans(),
    threads=st.sampled_from([1, 2, 5]),
)
def test_any_chunking_columns_and_path_write_the_reference(
    rows: int, dim: int, seed: int, table: int, cut: tuple[int, int], block: int,
    device_path: bool, threads: int,
) -> None:  # fmt: skip
    lo, hi = sorted(min(c, dim) for c in cut)
    want = torch.from_numpy(reference(rows, dim, seed, table))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tableinit, "INIT_ROWS", block)
        mp.setattr(torch, "get_num_threads", lambda: threads)  # blocks on that many threads
        mp.setenv(DEVICE_PATH_ON_CPU, "1" if device_path else "0")
        assert torch.equal(init_table(rows, dim, seed, table), want)
        assert torch.equal(init_table(rows, dim, seed, table, slice(lo, hi)), want[:, lo:hi])
        for dtype in (torch.float16, torch.bfloat16):  # rounded once from float32
            half = torch.empty(rows, hi - lo, dtype=dtype)
            init_table(rows, dim, seed, table, slice(lo, hi), out=half)
            assert torch.equal(half, want[:, lo:hi].to(dtype))
        rows_of_a_buffer = torch.zeros(rows + 3, dim)[1 : rows + 1]  # a view into a weight
        init_table(rows, dim, seed, table, out=rows_of_a_buffer)
        assert torch.equal(rows_of_a_buffer, want)


def test_making_tables_starts_no_second_openmp_runtime() -> None:
    """The compiled loop runs on Python threads, never numba's parallel layer: its OpenMP
    runtime (the system's libgomp beside torch's own) kept a thread spinning through every
    step after the tables were made (2 ranks on 2 cores trained 4x slower). A fresh process
    makes a table of 3 blocks on 2 threads: numba's threading layer is never started."""
    import subprocess
    import sys

    code = "\n".join([
        "import numba, torch", "from recsz.model.tableinit import INIT_ROWS, init_table",
        "torch.set_num_threads(2)", "init_table(2 * INIT_ROWS + 5, 8, 0, 0)",
        "try:", "    print(numba.threading_layer())", "except ValueError:", "    print('none')",
    ])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "none\n", done.stdout + done.stderr[-2000:]


def test_the_values_are_uniform_in_the_bound_and_each_table_its_own() -> None:
    rows, dim = 4096, 64
    w = init_table(rows, dim, 0, 3)
    bound = rows**-0.5
    assert float(w.abs().max()) <= bound and float(w.min()) < -0.99 * bound
    assert abs(float(w.mean())) < 0.01 * bound
    assert abs(float(w.std()) / (bound / 3**0.5) - 1) < 0.01
    # neighbours uncorrelated: rows, columns
    flat = w.flatten().double()
    assert abs(float(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([w[:-1].flatten(), w[1:].flatten()]))[0, 1])) < 0.01
    others = [init_table(rows, dim, 0, 4), init_table(rows, dim, 1, 3)]  # a table, a seed
    assert all(float((w == o).float().mean()) < 1e-3 for o in others)


def test_bad_columns_and_outputs_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        init_table(5, 8, 0, 0, slice(0, 8, 2))
    with pytest.raises(ValueError, match="out is"):
        init_table(5, 8, 0, 0, out=torch.empty(5, 7))


def test_tables_made_on_their_device_are_the_cpu_s() -> None:
    """SparseArch(device=...) makes its rows there (on the CPU's device path here: torch's
    operations, a GPU's way): the same tables and optimizer state as made on the CPU."""
    cfg = ModelConfig(table_sizes=(70, 3, 110, 5), emb_dim=8, bottom_mlp=(8,), top_mlp=(1,))
    opt = RowOptimizer("rowwise_adagrad", 0.1)
    plain = SparseArch(cfg, [0, 2, 3], 5, opt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEVICE_PATH_ON_CPU, "1")
        there = SparseArch(cfg, [0, 2, 3], 5, opt, device=torch.device("cpu"))
        shards = SparseArch(cfg, [0, 1, 8, 11], 5, opt, shards=4)  # table 0's, table 2's
    assert torch.equal(plain.weight, there.weight)
    assert torch.equal(plain.optimizer_state, there.optimizer_state)
    assert torch.equal(shards.weight[:70], plain.weight[:70, :2])
    assert torch.equal(shards.weight[70:140], plain.weight[:70, 2:4])
    assert torch.equal(shards.weight[140:250], plain.weight[70:180, :2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tables_made_on_a_gpu_are_the_cpu_s() -> None:
    """On a GPU the rows are made in its memory, bit for bit the CPU's (gpu_check.sh)."""
    for rows, dim, cols in [(100_003, 128, slice(None)), (70_000, 128, slice(32, 64))]:
        cpu = init_table(rows, dim, 7, 3, cols)
        gpu = torch.empty(cpu.shape, device="cuda", dtype=torch.float16)
        init_table(rows, dim, 7, 3, cols, out=gpu)
        assert torch.equal(gpu.cpu(), cpu.half())
        assert torch.equal(init_table(rows, dim, 7, 3, cols, out=gpu.float()).cpu(), cpu)
    cfg = ModelConfig(table_sizes=(70, 3, 110, 5), emb_dim=8, bottom_mlp=(8,), top_mlp=(1,))
    opt = RowOptimizer("adagrad", 0.1)
    there = SparseArch(cfg, [0, 2, 3], 5, opt, device=torch.device("cuda"))
    assert there.weight.is_cuda and there.optimizer_state.is_cuda
    assert torch.equal(there.weight.cpu(), SparseArch(cfg, [0, 2, 3], 5, opt).weight)
