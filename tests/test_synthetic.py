"""The built-in generator: deterministic, Criteo-shaped, power-law ids, learnable."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.data.prefetch import prefetch
from recsz.data.source import Batch, Part, SyntheticSource, make_source
from recsz.data.synthetic import SyntheticCriteo
from recsz.model import get_preset
from recsz.train import main
from tests.common import check_part

SIZES = get_preset("tiny").model.table_sizes


def test_deterministic_per_seed() -> None:
    a = SyntheticCriteo(SIZES, seed=3).block(0, 5, 100)
    b = SyntheticCriteo(SIZES, seed=3).block(0, 5, 100)
    c = SyntheticCriteo(SIZES, seed=4).block(0, 5, 100)
    np.testing.assert_array_equal(a.cats, b.cats)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.cats, c.cats)


def test_shape_ranges_and_click_rate() -> None:
    blk = SyntheticCriteo(SIZES, seed=0).block(0, 0, 20_000)
    assert blk.dense.shape == (20_000, 13) and blk.cats.shape == (20_000, 26)
    assert (blk.cats >= 1).all() and (blk.cats < np.array(SIZES)).all()
    assert 0.18 < blk.labels.mean() < 0.32


def test_ids_follow_a_power_law() -> None:
    blk = SyntheticCriteo(SIZES, seed=0).block(0, 0, 20_000)
    col = blk.cats[:, 2]  # a large table
    _, counts = np.unique(col, return_counts=True)
    top = np.sort(counts)[::-1]
    assert top[0] > 50 * np.median(counts)  # a few hot ids dominate


def test_counts_are_geometric() -> None:
    """The dense features are log(1 + count), count geometric: its mean is (1 - p) / p."""
    gen = SyntheticCriteo(SIZES, seed=0)
    counts = np.expm1(gen.block(0, 0, 50_000).dense.astype(np.float64))
    np.testing.assert_allclose(counts, np.round(counts), rtol=1e-6)  # float32's log1p
    want = (1 - gen.dense_p) / gen.dense_p
    np.testing.assert_allclose(counts.mean(0), want, rtol=0.05)


@settings(max_examples=40, deadline=None)
@given(
    n_per=st.integers(1, 40),
    world=st.integers(1, 5),
    data=st.data(),
)
def test_a_part_of_a_block_is_the_block_where_it_says(n_per: int, world: int, data) -> None:
    """A rank's part of a global batch: its samples in full and its tables' ids of every
    sample, each the very value the whole batch holds; every other entry 0."""
    n = n_per * world
    rank = data.draw(st.integers(0, world - 1))
    tables = tuple(data.draw(st.sets(st.integers(0, 25), max_size=26)))
    part = Part(rank, world, tables)
    src = SyntheticSource(SIZES, seed=9)
    step = data.draw(st.integers(0, 1000))
    check_part(src, step, n, part)
    got = src.train_batch(step, n, part)  # and the generator makes nothing else
    unnamed = np.ones((n, 26), bool)
    unnamed[part.rows(n)] = False
    unnamed[:, list(tables)] = False
    assert not got.ids.numpy()[unnamed].any()
    assert not got.dense.numpy()[unnamed.all(1)].any()


@settings(max_examples=30, deadline=None)
@given(n_eval=st.integers(1, 120), size=st.integers(1, 50), world=st.integers(1, 4), data=st.data())
def test_the_evaluation_set_is_one_set_whatever_its_batches(
    n_eval: int, size: int, world: int, data
) -> None:
    """The held-out set's batches of any size are runs of one set (so runs of other
    batch sizes or ranks evaluate the same samples); a rank's part of each (a last batch
    that does not divide leaves the last ranks fewer samples) holds the batch's values
    where it names them."""
    src = SyntheticSource(SIZES, seed=2, n_eval=n_eval)
    (whole,) = src.eval_batches(n_eval)
    batches = list(src.eval_batches(size))
    for field in ("dense", "ids", "labels"):
        joined = torch.cat([getattr(b, field) for b in batches])
        assert torch.equal(joined, getattr(whole, field)), field
    rank = data.draw(st.integers(0, world - 1))
    part = Part(rank, world, tuple(data.draw(st.sets(st.integers(0, 25), max_size=26))))
    for mine, full in zip(src.eval_batches(size, part), batches, strict=True):
        n = len(full)
        rows = part.rows(n)
        runs = [Part(q, world, ()).rows(n) for q in range(world)]  # the ranks' samples:
        assert [r.start for r in runs[1:]] == [r.stop for r in runs[:-1]]  # one after another,
        assert (runs[0].start, runs[-1].stop) == (0, n)  # all of them, none twice
        assert torch.equal(mine.dense[rows], full.dense[rows])
        assert torch.equal(mine.labels[rows], full.labels[rows])
        assert torch.equal(mine.ids[rows], full.ids[rows])
        assert torch.equal(mine.ids[:, list(part.tables)], full.ids[:, list(part.tables)])


def test_a_part_of_rows_that_are_no_run_is_refused() -> None:
    gen = SyntheticCriteo(SIZES, seed=0)
    with pytest.raises(ValueError, match="not a run"):
        gen.block(0, 0, 10, rows=slice(0, 10, 2))


def _auc(tmp, extra: list[str]) -> float:
    import json

    main(
        [
            "--steps",
            "250",
            "--batch-size",
            "128",
            "--no-progress",
            "--synthetic-eval",
            "5000",
            "--out",
            str(tmp),
            *extra,
        ]
    )
    return json.loads((tmp / "summary.json").read_text())["auc"]


def test_learnable_versus_shuffled_labels(tmp_path) -> None:
    """A model that learns beats 0.5 clearly; with labels independent of features it cannot."""
    import recsz.data.source as source

    auc = _auc(tmp_path / "real", [])
    orig = source.SyntheticSource.__init__

    def shuffled(self, *a, **k):  # type: ignore[no-untyped-def]
        orig(self, *a, shuffle_labels=True, **k)

    source.SyntheticSource.__init__ = shuffled  # type: ignore[method-assign]
    try:
        control = _auc(tmp_path / "control", [])
    finally:
        source.SyntheticSource.__init__ = orig  # type: ignore[method-assign]
    assert auc > 0.72, auc
    assert abs(control - 0.5) < 0.04, control


# ---- prefetching -------------------------------------------------------------------------
def test_prefetch_gives_the_batches_train_batch_gives() -> None:
    src = make_source("synthetic", SIZES, seed=3)
    got = list(prefetch(src.train_batches(range(4, 9), 16), torch.device("cpu")))
    assert len(got) == 5
    for step, b in zip(range(4, 9), got, strict=True):
        want = src.train_batch(step, 16)
        assert torch.equal(b.ids, want.ids) and torch.equal(b.dense, want.dense)
        assert torch.equal(b.labels, want.labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetched_batches_stay_intact_while_the_gpu_lags() -> None:
    """The host runs steps ahead of the GPU (no sync in a step): a batch the loop has let
    go of may still be read by queued kernels, so the thread's next copies must not reuse
    its memory (each kernel here waits ~20 ms before reading its batch)."""
    src = make_source("synthetic", SIZES, seed=3)
    sums = []
    for b in prefetch(src.train_batches(range(12), 4096), torch.device("cuda"), depth=2):
        torch.cuda._sleep(40_000_000)
        sums.append(b.ids.sum())
        del b
    want = [int(src.train_batch(k, 4096).ids.sum()) for k in range(12)]
    assert torch.stack(sums).tolist() == want


class Failing(SyntheticSource):
    def train_batch(self, step: int, batch_size: int, part: Part | None = None) -> Batch:
        if step == 2:
            raise ValueError("bad line 7 of data.tsv")
        return super().train_batch(step, batch_size, part)


def test_prefetch_raises_the_threads_error_and_stops_early() -> None:
    src = Failing(SIZES, seed=0)
    it = prefetch(src.train_batches(range(5), 8), torch.device("cpu"))
    assert len(next(it)) == 8
    next(it)
    with pytest.raises(ValueError, match="bad line 7"):
        next(it)
    # Leaving a loop early stops the thread (no thread left waiting on a full queue).
    cpu = torch.device("cpu")
    early = prefetch(make_source("synthetic", SIZES, seed=0).train_batches(range(100), 8), cpu)
    next(early)
    early.close()
    assert not any(t.name == "recsz-prefetch" for t in threading.enumerate())


def test_the_teachers_kept_values_are_the_hashed_ones() -> None:
    """Once a table's values are kept (after as many ids as it has rows), the teacher's
    logits are the very numbers hashing each id gives (every batch, bit for bit)."""
    kept = SyntheticCriteo(SIZES, seed=5)
    hashed = SyntheticCriteo(SIZES, seed=5, cached_rows=0)  # hash every id, keep nothing
    for i in range(8):
        a, b = kept.block(0, i, 6000), hashed.block(0, i, 6000)
        np.testing.assert_array_equal(kept.logits(a.dense, a.cats), hashed.logits(b.dense, b.cats))
        np.testing.assert_array_equal(a.labels, b.labels)
    in_pairs = {t for pair in kept.pairs for t in pair}
    assert len(kept._tables) == 26 + 4 * len(in_pairs) and not hashed._tables
