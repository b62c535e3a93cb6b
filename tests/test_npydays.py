"""TorchRec's preprocessed Criteo days (``day_N_{dense,sparse,labels}.npy``) read where they
lie (recsz.data.npydays): written here by TorchRec's own ``BinaryCriteoUtils.tsv_to_npys``
from the real sample, read back as the plain arrays say, trained on, and refused by name
where damaged."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.data import npydays
from recsz.data.source import ArraySource, Part, make_source
from recsz.model import get_preset
from recsz.model.multihot import MLPERF_HOTNESS
from recsz.train import main
from tests.conftest import SHARED_DATA

SIZES = get_preset("tiny").model.table_sizes


_WRITE = """
import sys
from torchrec.datasets.criteo import BinaryCriteoUtils
BinaryCriteoUtils.tsv_to_npys(*sys.argv[1:], dataset_name="criteo_1tb")
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real sample as TorchRec preprocesses Criteo: day 0 its first 6,000 lines, day 1
    the rest, each by ``tsv_to_npys`` (in a process of its own: its reader leaves files
    open, which this suite's warnings would fail on)."""
    pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")
    pytest.importorskip("iopath", reason="TorchRec's file reader (make test installs it)")
    sample = SHARED_DATA / "criteo_kaggle_head10k.tsv"
    if not sample.exists():
        pytest.skip(f"real Criteo sample not found at {sample}")
    tmp = tmp_path_factory.mktemp("npydays")
    lines = sample.read_text().splitlines(keepends=True)
    out = tmp / "days"
    out.mkdir()
    for day, chunk in enumerate((lines[:6000], lines[6000:])):
        tsv = tmp / f"day_{day}.tsv"
        tsv.write_text("".join(chunk))
        names = [str(out / f"day_{day}_{k}.npy") for k in ("dense", "sparse", "labels")]
        subprocess.run([sys.executable, "-W", "ignore", "-c", _WRITE, str(tsv), *names],
                       check=True)  # fmt: skip
    return out


@pytest.fixture
def days(written: Path, tmp_path: Path) -> Path:
    """A copy of the days, for a test's own changes."""
    return Path(shutil.copytree(written, tmp_path / "days"))


def plain(d: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the files say, read whole: dense, ids (categories modulo the tables' rows), labels."""
    got = [
        np.concatenate([np.load(d / f"day_{day}_{k}.npy") for day in (0, 1)])
        for k in ("dense", "sparse", "labels")
    ]
    return got[0], got[1].astype(np.int64) % np.asarray(SIZES), got[2][:, 0].astype(np.float32)


def test_the_days_read_as_the_files_say(days: Path) -> None:
    dense, ids, labels = plain(days)
    n = len(labels)  # the sample's 9,999 lines
    assert n == 9_999 and set(np.unique(labels)) == {0.0, 1.0}
    src = make_source(str(days), SIZES, seed=1)
    assert isinstance(src, ArraySource) and src.n_train == n - 2_000
    for order in ("rows", "batches"):
        src = make_source(str(days), SIZES, seed=1, order=order)
        for step in (0, 7, 40):  # 40: the second epoch's permutation
            got = src.train_batch(step, 200)
            rows = {tuple(r) for r in np.c_[got.dense.numpy(), got.ids.numpy(), got.labels]}
            want = {tuple(r) for r in np.c_[dense, ids, labels][: n - 2000]}
            assert len(got) == 200 and rows <= want, (order, step)
    held = list(src.eval_batches(512))
    assert torch.equal(torch.cat([b.ids for b in held]), torch.from_numpy(ids[n - 2000 :]))
    assert torch.equal(torch.cat([b.dense for b in held]), torch.from_numpy(dense[n - 2000 :]))
    part = Part(1, 2, (0, 3, 25))  # a rank's part, across the days' seam
    src = make_source(str(days), SIZES, seed=1, order="rows")
    mine, whole = src.train_batch(3, 400, part), src.train_batch(3, 400)
    assert torch.equal(mine.ids[200:], whole.ids[200:])
    assert torch.equal(mine.ids[:, [0, 3, 25]], whole.ids[:, [0, 3, 25]])


def test_a_run_trains_on_days_and_evaluates_on_another_days_directory(
    days: Path, tmp_path: Path
) -> None:
    """Day 1 moved to a directory of its own: --data trains on day 0, --eval-data evaluates
    day 1, as MLPerf's recipes hold out day 23."""
    held = tmp_path / "held"
    held.mkdir()
    for k in ("dense", "sparse", "labels"):
        (days / f"day_1_{k}.npy").rename(held / f"day_1_{k}.npy")
    out = tmp_path / "run"
    argv = ["--data", str(days), "--eval-data", str(held), "--batch-size", "32",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 6000 // 32 and s["eval_samples"] == 3999
    assert s["auc"] > 0.68  # the tiny preset on the real sample, one pass


def test_damaged_days_are_refused_naming_the_file(days: Path) -> None:
    (days / "day_1_labels.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"day_1_labels\.npy: missing"):
        make_source(str(days), SIZES, seed=0)
    np.save(days / "day_1_labels.npy", np.zeros((5, 1), np.int32))
    with pytest.raises(ValueError, match="day 1's files hold different row counts"):
        make_source(str(days), SIZES, seed=0)
    np.save(days / "day_1_labels.npy", np.zeros((3999, 2), np.int32))  # (floats may be labels)
    with pytest.raises(ValueError, match=r"day_1_labels\.npy: int32 \(3999, 2\)"):
        make_source(str(days), SIZES, seed=0)
    labels = np.zeros((3999, 1), np.int32)
    labels[123] = -1  # what tsv_to_npys writes for Kaggle's unlabelled test set
    np.save(days / "day_1_labels.npy", labels)
    src = make_source(str(days), SIZES, seed=0, eval_frac=0.5)
    with pytest.raises(ValueError, match=r"row 6123: label -1\.0 is not 0 or 1"):
        list(src.eval_batches(1000))


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda x: sum(x) > 0),
    data=st.data(),
)
def test_days_read_rows_as_their_concatenation(lens: list[int], data) -> None:
    """Runs of rows (views, read when made arrays), rows in any order with repeats, and
    rows of one column: the concatenated arrays' values, through the conversion."""
    g = np.random.default_rng(sum(lens))
    parts = [g.integers(0, 1000, (n, 3)) for n in lens]
    whole = np.concatenate(parts)
    days = npydays.Days(parts, lambda x, cols: x * 2)
    n = len(whole)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    view = days[a:b]
    assert len(view) == b - a and np.array_equal(np.array(view), whole[a:b] * 2)
    drawn = data.draw(st.lists(st.integers(0, b - a - 1), max_size=12)) if b > a else []
    idx = np.array(drawn, dtype=np.int64)
    assert np.array_equal(view[idx], whole[a:b][idx] * 2)
    if idx.size:
        col = data.draw(st.integers(0, 2))
        assert np.array_equal(view[idx, col], whole[a:b][idx, col] * 2)
    with pytest.raises(IndexError):
        view[np.array([b - a])]


def test_a_directory_of_neither_form_says_what_it_lacks(tmp_path: Path) -> None:
    (tmp_path / "day_0_sparse.npy").write_bytes(b"")  # no dense file: not TorchRec's days
    with pytest.raises(FileNotFoundError, match=r"no meta\.json .* and no day_N_dense\.npy"):
        make_source(str(tmp_path), SIZES, seed=0)


# ---- MLPerf's materialized multi-hot days -------------------------------------------------
def _materialized(tmp: Path, draws_seed: int = 0, compressed: bool = False) -> tuple[Path, Path]:
    """Two days of random raw categories, as one-hot days and as MLPerf's materializer
    writes them (each feature's bags: its reference table's rows of the ids, numpy seeded
    ``draws_seed``; dense and labels copied): (one-hot dir, materialized dir)."""
    from tests.reference import reference_bags

    state = np.random.get_state()
    if draws_seed:
        np.random.seed(draws_seed)  # another stream: reference_bags reseeds 0, so draw here
        tables = [np.c_[np.arange(n), np.random.randint(0, n, (n, h - 1))]
                  for n, h in zip(SIZES, MLPERF_HOTNESS, strict=True)]  # fmt: skip
    else:
        tables = reference_bags(SIZES, MLPERF_HOTNESS)
    np.random.set_state(state)
    rng = np.random.default_rng(1)
    one, mat = tmp / "one_hot", tmp / "materialized"
    one.mkdir(parents=True)
    mat.mkdir(parents=True)
    for day, rows in enumerate((3000, 1000)):
        raw = rng.integers(0, 2**31, (rows, 26), dtype=np.int64)
        for d in (one, mat):
            np.save(d / f"day_{day}_dense.npy", rng.random((rows, 13), dtype=np.float32))
            np.save(d / f"day_{day}_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))
        np.save(one / f"day_{day}_sparse.npy", raw)
        bags = {str(j): tables[j][raw[:, j] % SIZES[j]].astype(np.int32) for j in range(26)}
        save = np.savez_compressed if compressed else np.savez
        save(mat / f"day_{day}_sparse_multi_hot.npz", **bags)
    for day in (0, 1):  # the same dense features and labels in both
        for k in ("dense", "labels"):
            shutil.copy(one / f"day_{day}_{k}.npy", mat / f"day_{day}_{k}.npy")
    return one, mat


def test_materialized_days_read_as_their_one_hot_days(tmp_path: Path) -> None:
    """The materialized form's first ids are the one-hot days' ids (categories modulo the
    rows), batch for batch; and with MLPerf's draws a run on either trains alike."""
    one, mat = _materialized(tmp_path)
    a, b = make_source(str(one), SIZES, seed=1), make_source(str(mat), SIZES, seed=1)
    for step in (0, 5):
        x, y = a.train_batch(step, 128), b.train_batch(step, 128)
        assert torch.equal(x.ids, y.ids) and torch.equal(x.dense, y.dense)
    assert torch.equal(torch.cat([e.ids for e in a.eval_batches(300)]),
                       torch.cat([e.ids for e in b.eval_batches(300)]))  # fmt: skip
    runs = []
    for d in (one, mat):
        out = tmp_path / d.name
        argv = ["--data", str(d), "--steps", "4", "--batch-size", "128", "--no-progress",
                "--multi-hot", "mlperf", "--multi-hot-draws", "mlperf",
                "--out", str(out)]  # fmt: skip
        assert main(argv) == 0
        runs.append(json.loads((out / "summary.json").read_text()))
    assert runs[0]["auc"] == runs[1]["auc"] and runs[0]["logloss"] == runs[1]["logloss"]


def test_materialized_days_need_the_runs_bags_to_be_theirs(tmp_path: Path) -> None:
    """Refused by name, before any rank starts: hashed bags, other sizes, bags of another
    draw, a compressed archive."""
    from recsz.config import TrainConfig

    _, mat = _materialized(tmp_path / "a")
    spec = ",".join(map(str, MLPERF_HOTNESS))
    with pytest.raises(ValueError, match=f"bags of {spec} ids; train on it with --multi-hot"):
        TrainConfig(data=str(mat), multi_hot="mlperf")
    with pytest.raises(ValueError, match=r"day_0_sparse_multi_hot\.npz: MLPerf's materialized"):
        TrainConfig(data=str(mat), multi_hot="2", multi_hot_draws="mlperf")
    TrainConfig(data=str(mat), multi_hot="mlperf", multi_hot_draws="mlperf")
    _, other = _materialized(tmp_path / "b", draws_seed=7)
    with pytest.raises(ValueError, match="feature 0's bags are not MLPerf's reference's draws"):
        TrainConfig(data=str(other), multi_hot="mlperf", multi_hot_draws="mlperf")
    _, packed = _materialized(tmp_path / "c", compressed=True)
    with pytest.raises(ValueError, match="array 0 is compressed"):
        TrainConfig(data=str(packed), multi_hot="mlperf", multi_hot_draws="mlperf")
    npz = mat / "day_0_sparse_multi_hot.npz"
    with zipfile.ZipFile(npz) as z:  # array 3's own header damaged (its magic)
        at = z.getinfo("3.npy").header_offset
    with npz.open("r+b") as f:
        f.seek(at + 26)
        name, extra = struct.unpack("<HH", f.read(4))
        f.seek(at + 30 + name + extra)
        f.write(b"XXXX")
    with pytest.raises(ValueError, match=r"multi_hot\.npz: array 3 is not a \.npy array"):
        TrainConfig(data=str(mat), multi_hot="mlperf", multi_hot_draws="mlperf")
