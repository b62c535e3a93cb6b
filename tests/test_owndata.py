"""A model of other tables and dense inputs than Criteo's (``--table-rows``,
``--dense-features``): its configuration, the generator's data of its shape, TorchRec-layout
``.npy`` days of its shape trained on, and Criteo's files refused by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.config import TrainConfig
from recsz.configcheck import refused
from recsz.data.criteo import FIELDS, N_CAT, N_DENSE
from recsz.data.source import Part, make_source
from recsz.data.stream import RawStream
from recsz.data.synthetic import SyntheticCriteo
from recsz.model import get_preset
from recsz.train import main
from tests.conftest import SHARED_DATA

ROWS = (300, 300, 300, 5000, 40)  # --table-rows 3x300,5000,40
DENSE = 4


def write_days(d: Path, rows: tuple[int, ...], n_dense: int, n: int = 2000, days: int = 2) -> Path:
    """``days`` TorchRec-layout days of ``n`` rows, the generator's samples of that shape
    (ids as int32, labels as (rows, 1) int32, as TorchRec writes them)."""
    gen = SyntheticCriteo(rows, seed=3, n_dense=n_dense)
    d.mkdir(parents=True, exist_ok=True)
    for day in range(days):
        a = gen.block(0, day, n)
        np.save(d / f"day_{day}_dense.npy", a.dense)
        np.save(d / f"day_{day}_sparse.npy", a.cats.astype(np.int32))
        np.save(d / f"day_{day}_labels.npy", a.labels.astype(np.int32)[:, None])
    return d


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(2, 10**7)), min_size=1, max_size=6),
    st.booleans(),
    st.one_of(st.none(), st.integers(2, 10**6)),
)
def test_table_rows_give_the_model_its_tables(
    groups: list[tuple[int, int]], counted: bool, cap: int | None
) -> None:
    """``--table-rows`` against its plain expansion: each item ROWS or COUNTxROWS, in order,
    then capped by ``--max-rows``; the rest of the preset's model stays."""
    text = ",".join(f"{c}x{r}" if counted or c > 1 else str(r) for c, r in groups)
    want = [r for c, r in groups for _ in range(c if counted or c > 1 else 1)]
    if cap is not None:
        want = [min(r, cap) for r in want]
    m = TrainConfig(table_rows=text, max_rows=cap, dense_features=7).model()
    tiny = get_preset("tiny").model
    assert list(m.table_sizes) == want and m.n_dense == 7
    assert (m.emb_dim, m.bottom_mlp, m.top_mlp) == (tiny.emb_dim, tiny.bottom_mlp, tiny.top_mlp)


@pytest.mark.parametrize("text", ["", "abc", "3x", "0x100", "1", "2x1", "100,,5", "-3x10"])
def test_bad_table_rows_are_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="--table-rows"):
        TrainConfig(table_rows=text).model()


def test_the_generator_keeps_criteos_shape_and_makes_any_other() -> None:
    """Criteo's shape makes the stream it made before other shapes could be asked for,
    value for value (its digest, taken then); another shape's blocks hold its columns, ids
    inside their tables, and a rank's part equals the whole's rows."""
    sizes = get_preset("tiny").model.table_sizes
    a = SyntheticCriteo(sizes, seed=3).block(0, 5, 100)
    assert a.cats.shape == (100, N_CAT) and a.dense.shape == (100, N_DENSE)
    h = hashlib.sha256()
    for f in FIELDS:
        h.update(np.ascontiguousarray(getattr(a, f)).tobytes())
    assert h.hexdigest()[:16] == "9d4424a7bb37f343"
    gen = SyntheticCriteo(ROWS, seed=3, n_dense=DENSE)
    whole = gen.block(0, 7, 96)
    assert whole.cats.shape == (96, len(ROWS)) and whole.dense.shape == (96, DENSE)
    assert ((whole.cats >= 1) & (whole.cats < np.array(ROWS))).all()
    assert np.isfinite(whole.dense).all() and set(np.unique(whole.labels)) <= {0.0, 1.0}
    assert 0.05 < whole.labels.mean() < 0.6  # the teacher's bias, calibrated for this shape
    part = Part(1, 3, (0, 3))
    mine = gen.block(0, 7, 96, part.rows(96), part.tables)
    rows = part.rows(96)
    for f in FIELDS:
        assert np.array_equal(getattr(mine, f)[rows], getattr(whole, f)[rows])
    assert np.array_equal(mine.cats[:, [0, 3]], whole.cats[:, [0, 3]])


def test_a_model_of_other_tables_trains_on_days_of_its_shape(tmp_path: Path) -> None:
    """Days written in TorchRec's layout with 4 dense and 5 sparse columns train the model of
    that shape, which learns the generator's teacher; the run's evaluation and a resumed
    one read them again from its configuration."""
    days = write_days(tmp_path / "days", ROWS, DENSE)
    flags = ["--data", str(days), "--table-rows", "3x300,5000,40", "--dense-features", "4",
             "--batch-size", "64", "--no-progress", "--checkpoint-every", "25"]  # fmt: skip
    out = tmp_path / "run"
    assert main([*flags, "--steps", "25", "--out", str(out)]) == 0
    assert main(["--resume", str(out), "--steps", "50", "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 50 and s["eval_samples"] == 800 and s["auc"] > 0.6
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["table_rows"], cfg["dense_features"]) == ("3x300,5000,40", 4)


def test_predict_scores_unlabeled_days_as_evaluate_scores_them_labeled(tmp_path: Path) -> None:
    """`recsz predict RUN DIR`: days of the model's shape without their labels files are
    scored as `recsz evaluate --predictions` scores them labeled, in order; a directory
    beside other files, or one without days, is refused by name."""
    from recsz.cli import main as cli

    days = write_days(tmp_path / "days", ROWS, DENSE, n=600, days=1)
    run = tmp_path / "run"
    flags = ["--data", str(days), "--table-rows", "3x300,5000,40", "--dense-features", "4",
             "--batch-size", "64", "--steps", "5", "--checkpoint-every", "5", "--no-progress",
             "--out", str(run)]  # fmt: skip
    assert main(flags) == 0
    held = write_days(tmp_path / "held", ROWS, DENSE, n=300, days=2)
    ref, out = tmp_path / "ref.npy", tmp_path / "p.npy"
    batch = ["--eval-batch-size", "128"]
    assert cli(["evaluate", str(run), "--eval-data", str(held), "--predictions", str(ref),
                *batch]) == 0  # fmt: skip
    for f in held.glob("day_*_labels.npy"):
        f.unlink()
    assert cli(["predict", str(run), str(held), "--out", str(out), *batch]) == 0
    got, want = np.load(out), np.load(ref)
    assert got.shape == (600,) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want[:, 0])
    for bad in ([str(held), str(held)], [str(tmp_path / "run")]):
        assert cli(["predict", str(run), *bad, "--out", str(tmp_path / "x.npy")]) == 2
    assert not (tmp_path / "x.npy").exists()


def test_days_of_another_shape_are_refused_with_the_file_and_the_flag(tmp_path: Path) -> None:
    days = write_days(tmp_path / "days", ROWS, DENSE, n=100, days=1)
    flags = ["--data", str(days), "--steps", "2", "--batch-size", "16", "--no-progress"]
    with pytest.raises(ValueError, match=r"day_0_dense.npy.*\(rows, 13\).*--dense-features"):
        main([*flags, "--table-rows", "3x300,5000,40"])
    with pytest.raises(ValueError, match=r"day_0_sparse.npy.*\(rows, 4\).*--table-rows"):
        main([*flags, "--table-rows", "4x300", "--dense-features", "4"])


def test_criteos_files_are_refused_for_a_model_of_another_shape(tmp_path: Path) -> None:
    """A raw Criteo file (or a preprocessed one) holds Criteo's columns: a model of other
    tables is told what to give it instead, before any line is read."""
    sample = SHARED_DATA / "criteo_kaggle_head10k.tsv"
    if not sample.exists():
        pytest.skip(f"real Criteo sample not found at {sample}")
    with pytest.raises(ValueError, match=r"head10k.tsv: Criteo's files hold 13 dense.*5 tables"):
        make_source(str(sample), ROWS, 0)
    with pytest.raises(ValueError, match="takes 4 dense inputs and 26 tables"):
        make_source(str(sample), get_preset("tiny").model.table_sizes, 0, n_dense=DENSE)
    assert len(make_source(str(sample), get_preset("tiny").model.table_sizes, 0).held_out) > 0
    # before any rank starts (configcheck), --data and --eval-data alike
    for flags in ({"data": str(sample)}, {"data": str(sample), "eval_data": str(sample)}):
        with pytest.raises(ValueError, match=r"--data .*head10k.tsv: Criteo's files"):
            refused(TrainConfig(table_rows="3x300,5000,40", nproc=2, **flags))
    days = write_days(tmp_path / "days", ROWS, DENSE, n=100, days=1)
    mine = {"table_rows": "3x300,5000,40", "dense_features": DENSE, "data": str(days)}
    refused(TrainConfig(**mine))  # days of the model's shape
    with pytest.raises(ValueError, match=r"--eval-data .*head10k.tsv: Criteo's files"):
        refused(TrainConfig(**mine, eval_data=str(sample)))


def test_a_missing_raw_file_is_named_missing_for_any_shape(tmp_path: Path) -> None:
    """A file that is not there is named so, for a model of any shape, before its layout."""
    missing = str(tmp_path / "nowhere.tsv")
    for rows, dense in ((ROWS, DENSE), (get_preset("tiny").model.table_sizes, N_DENSE)):
        with pytest.raises(FileNotFoundError, match=r"nowhere\.tsv: no such file"):
            RawStream([missing], rows, n_dense=dense)
        with pytest.raises(FileNotFoundError, match=r"--data .*nowhere\.tsv: no such file"):
            make_source(missing, rows, 0, n_dense=dense)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, np.int8])
def test_labels_of_any_numeric_dtype_read_as_they_say(tmp_path: Path, dtype: type) -> None:
    """Labels saved as floats or booleans (not only TorchRec's integers) read as 0 and 1; a
    label other than those is refused with its day's row."""
    days = write_days(tmp_path / "days", ROWS, DENSE, n=200, days=1)
    labels = np.load(days / "day_0_labels.npy")
    np.save(days / "day_0_labels.npy", labels.astype(dtype))
    src = make_source(str(days), ROWS, 0, n_dense=DENSE)
    got = np.concatenate([b.labels.numpy() for b in src.eval_batches(64)])
    assert np.array_equal(got, labels[160:, 0].astype(np.float32))
    if dtype in (np.float32, np.float64):
        labels = labels.astype(dtype)
        labels[170, 0] = 0.5
        np.save(days / "day_0_labels.npy", labels)
        src = make_source(str(days), ROWS, 0, n_dense=DENSE)
        with pytest.raises(ValueError, match=r"row 170: label 0.5 is not 0 or 1"):
            list(src.eval_batches(64))
