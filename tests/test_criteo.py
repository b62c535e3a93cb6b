"""The Criteo reader on the real samples, ragged lines, and malformed input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.data import criteo, preprocessed
from recsz.data.criteo import CriteoFormatError, hash_category
from recsz.model import get_preset

SIZES = get_preset("tiny").model.table_sizes


def _expected_from_text(
    path: Path, n: int
) -> tuple[list[float], list[list[float]], list[list[int]]]:
    """An independent, obvious reading of the first n lines."""
    labels, dense, ids = [], [], []
    with open(path) as f:
        for _ in range(n):
            fs = f.readline().rstrip("\n").split("\t")
            fs += [""] * (40 - len(fs))
            labels.append(float(fs[0]))
            dense.append([math.log1p(max(0, int(v))) if v else 0.0 for v in fs[1:14]])
            ids.append(
                [hash_category(int(v, 16), SIZES[j]) if v else 0 for j, v in enumerate(fs[14:40])]
            )
    return labels, dense, ids


def test_reads_real_sample(criteo_10k: Path) -> None:
    stats = criteo.ParseStats()
    a = criteo.read(criteo_10k, SIZES, stats=stats)
    assert len(a) == 9999 and stats.lines == 9999 and stats.skipped == 0
    assert a.dense.shape == (9999, 13) and a.cats.shape == (9999, 26)
    assert abs(float(a.labels.mean()) - 0.218) < 0.001  # the README's click rate
    labels, dense, ids = _expected_from_text(criteo_10k, 50)
    np.testing.assert_array_equal(a.labels[:50], labels)
    np.testing.assert_allclose(a.dense[:50], dense, rtol=1e-6)
    np.testing.assert_array_equal(a.cats[:50], ids)
    assert (a.cats >= 0).all() and (a.cats < np.array(SIZES)).all()
    assert (a.dense >= 0).all()  # negatives clamp to 0


def test_distinct_values_match_readme(criteo_10k: Path) -> None:
    """Per-column distinct categories equal the README's counts (wide tables: no collisions)."""
    readme = [
        175,
        386,
        5520,
        4033,
        56,
        8,
        3184,
        93,
        3,
        2986,
        2084,
        5283,
        1725,
        24,
        2035,
        4723,
        9,
        1149,
        547,
        4,
        5036,
        8,
        12,
        2525,
        40,
        1939,
    ]
    a = criteo.read(criteo_10k, [2**40] * 26)
    got = [len(np.unique(a.cats[:, j])) for j in range(26)]  # "missing" counts as a value
    assert got == readme


def test_ragged_lines_are_padded(criteo_ragged: Path, criteo_10k: Path) -> None:
    stats = criteo.ParseStats()
    a = criteo.read(criteo_ragged, SIZES, stats=stats)
    assert len(a) == 1000 and stats.padded == 498
    b = criteo.read(criteo_10k, SIZES)  # its first 1000 rows are the same samples
    np.testing.assert_array_equal(a.cats, b.cats[:1000])
    np.testing.assert_array_equal(a.labels, b.labels[:1000])


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = "\t".join(["1", *["3"] * 13, *["68fd1e64"] * 26])


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        (GOOD.replace("68fd1e64", "zzzz", 1), r"bad\.tsv:3: field 15 \(C1\): 'zzzz' is not hex"),
        (GOOD.replace("\t3\t", "\tx7\t", 1), r"bad\.tsv:3: field 2 \(I1\): 'x7' is not an integer"),
        (GOOD + "\textra", r"bad\.tsv:3: 41 fields"),
        ("2" + GOOD[1:], r"bad\.tsv:3: field 1 \(label\)"),
        (GOOD.replace("68fd1e64", "1234567890", 1), r"bad\.tsv:3: field 15 .* longer than 8"),
        ("1\t5\t3", r"bad\.tsv:3: 3 fields, none of them a category: a Criteo line holds 40 "),
        ("\t".join(["0", *["7"] * 13]), r"bad\.tsv:3: 14 fields, none of them a category"),
    ],
)
def test_malformed_line_names_file_line_field(tmp_path: Path, bad: str, pattern: str) -> None:
    p = _write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(CriteoFormatError, match=pattern):
        criteo.read(p, SIZES)


def test_skip_bad_lines_counts_and_reports(tmp_path: Path) -> None:
    p = _write(tmp_path, [GOOD, GOOD.replace("68fd1e64", "zz", 1), GOOD])
    stats = criteo.ParseStats()
    a = criteo.read(p, SIZES, skip_bad_lines=True, stats=stats)
    assert len(a) == 2 and stats.skipped == 1 and ":2:" in stats.first_error


def test_negative_counts_clamp_and_missing_ids(tmp_path: Path) -> None:
    line = "\t".join(["0", "-5", *[""] * 12, "", *["a"] * 25])
    a = criteo.read(_write(tmp_path, [line]), SIZES)
    assert a.dense[0, 0] == 0.0 and a.cats[0, 0] == 0 and a.cats[0, 1] > 0


def test_a_line_that_reaches_its_first_category_is_padded(tmp_path: Path) -> None:
    short = "\t".join(["1", *["7"] * 13, "68fd1e64"])  # 15 fields: 25 empty ones stripped
    stats = criteo.ParseStats()
    a = criteo.read(_write(tmp_path, [short]), SIZES, stats=stats)
    assert stats.padded == 1 and a.cats[0, 0] > 0 and not a.cats[0, 1:].any()
    unlabeled = criteo.read(_write(tmp_path, [short[2:]]), SIZES, labeled=False)
    np.testing.assert_array_equal(unlabeled.cats, a.cats)


def test_preprocess_then_load_matches_read(tmp_path: Path, criteo_ragged: Path) -> None:
    out = tmp_path / "bin"
    stats = preprocessed.preprocess(criteo_ragged, out, SIZES, progress=False)
    assert stats.lines == 1000
    m = preprocessed.load(out, SIZES)
    a = criteo.read(criteo_ragged, SIZES)
    np.testing.assert_array_equal(np.asarray(m.cats), a.cats)
    np.testing.assert_array_equal(np.asarray(m.dense), a.dense)
    with pytest.raises(ValueError, match="hashed into table sizes"):
        preprocessed.load(out, get_preset("kaggle").model.table_sizes)


def test_preprocess_max_rows_hashes_as_trainings_max_rows(tmp_path: Path, criteo_ragged: Path):
    """`recsz preprocess --max-rows N` hashes into the tables `recsz train --max-rows N`
    makes (each capped at N rows), which trains on it; a run without it is refused, told
    to preprocess again alike."""
    from recsz.cli import main as cli_main
    from recsz.train import main as train_main

    out = tmp_path / "bin"
    assert cli_main(["preprocess", str(criteo_ragged), str(out), "--max-rows", "50"]) == 0
    sizes = json.loads((out / "meta.json").read_text())["table_sizes"]
    assert sizes == [min(n, 50) for n in get_preset("tiny").model.table_sizes]
    assert int(np.asarray(preprocessed.load(out, sizes).cats).max()) < 50
    run = ["--data", str(out), "--steps", "2", "--batch-size", "32", "--no-progress"]
    assert train_main([*run, "--max-rows", "50"]) == 0
    with pytest.raises(ValueError, match=r"preprocess again with this preset \(and --max-rows\)"):
        train_main(run)


def test_iter_blocks_streams_in_bounded_blocks(criteo_10k: Path) -> None:
    sizes = [len(b) for b in criteo.iter_blocks(criteo_10k, SIZES, block_rows=4000)]
    assert sizes == [4000, 4000, 1999]


# ---- input that used to escape validation -------------------------------------------------
def _write_bytes(tmp_path: Path, lines: list[bytes]) -> Path:
    p = tmp_path / "bad.tsv"
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        (GOOD.encode().replace(b"68fd1e64", b"68fd\xffe64", 1), r"bad\.tsv:3: byte 0xff at column"),
        (GOOD.replace("\t3\t", "\t" + "9" * 400 + "\t", 1).encode(), r"bad\.tsv:3: .* too large"),
        (GOOD.replace("\t3\t", "\t-" + "9" * 30 + "\t", 1).encode(), r"bad\.tsv:3: .* too large"),
    ],
)
def test_bad_bytes_and_huge_numbers_are_named_and_skippable(
    tmp_path: Path, bad: bytes, pattern: str
) -> None:
    p = _write_bytes(tmp_path, [GOOD.encode(), GOOD.encode(), bad, GOOD.encode()])
    with pytest.raises(CriteoFormatError, match=pattern):
        criteo.read(p, SIZES)
    stats = criteo.ParseStats()
    a = criteo.read(p, SIZES, skip_bad_lines=True, stats=stats)
    assert len(a) == 3 and stats.skipped == 1 and ":3:" in stats.first_error


def test_a_huge_field_makes_a_short_message(tmp_path: Path) -> None:
    p = _write(tmp_path, [GOOD.replace("68fd1e64", "z" * 3_000_000, 1)])
    with pytest.raises(CriteoFormatError) as e:
        criteo.read(p, SIZES)
    assert len(str(e.value)) < 300 and "3000000 characters" in str(e.value)


def test_preprocess_refuses_empty_input_and_leaves_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv: no samples"):
        preprocessed.preprocess(empty, tmp_path / "out", SIZES, progress=False)
    bad = _write(tmp_path, [GOOD, "2" + GOOD[1:]])
    with pytest.raises(CriteoFormatError, match=r"bad\.tsv:2"):
        preprocessed.preprocess(bad, tmp_path / "out", SIZES, progress=False)
    assert not list((tmp_path / "out").glob("*")), "no partial output after a failure"


def test_preprocess_on_a_full_disk_names_its_output(tmp_path: Path, monkeypatch) -> None:
    """A full filesystem (ENOSPC at a write) is said with the output directory and its
    free room, as bad input (the same command fails until someone makes room), and leaves
    no partial output."""
    from recsz.ranks import bad_input

    def full(*_args: object, **_kw: object) -> None:
        (tmp_path / "out" / "dense.tmp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(preprocessed, "_write", full)
    with pytest.raises(OSError, match=rf"cannot write {tmp_path}/out: no space left on device "
                       r"\(\d+\.\d MB free on its filesystem\)") as e:  # fmt: skip
        preprocessed.preprocess(_write(tmp_path, [GOOD]), tmp_path / "out", SIZES, progress=False)
    assert bad_input(e.value) and not list((tmp_path / "out").glob("*"))


def test_damaged_preprocessed_arrays_are_named(tmp_path: Path, criteo_ragged: Path) -> None:
    from recsz.data.source import make_source

    out = tmp_path / "bin"
    preprocessed.preprocess(criteo_ragged, out, SIZES, progress=False)
    labels = out / "labels.f32"
    good = labels.read_bytes()
    labels.write_bytes(good[:-4])  # one row short
    with pytest.raises(ValueError, match=r"labels\.f32: 3996 bytes, expected 4000"):
        preprocessed.load(out, SIZES)
    for value in (7.0, float("nan")):  # a label no Criteo line can have
        arr = np.frombuffer(good, "<f4").copy()
        arr[5] = value
        labels.write_bytes(arr.tobytes())
        src = make_source(str(out), SIZES, seed=0)
        with pytest.raises(CriteoFormatError, match=r"bin: row \d+: label .* is not 0 or 1"):
            for step in range(src.steps_per_epoch(100) or 0):
                src.train_batch(step, 100)
            list(src.eval_batches(100))
    labels.unlink()
    with pytest.raises(FileNotFoundError, match=r"labels\.f32: missing, named by .*meta\.json"):
        preprocessed.load(out, SIZES)
    meta = out / "meta.json"
    fields = meta.read_text()
    for text, said in (
        ('{\n  "rows": 5', r"meta\.json, line 2: not JSON"),
        ('{"rows": 5}', r"meta\.json: no rows and table_sizes .*KeyError"),
        ("[1, 2]", r"meta\.json: no rows and table_sizes"),
        (fields.replace('"rows": 1000', '"rows": -1'), r"rows -1, .*out of range"),
    ):
        meta.write_text(text)
        with pytest.raises(ValueError, match=said):
            preprocessed.load(out, SIZES)
    meta.write_text(fields)
    labels.write_bytes(good)
    dense = out / "dense.f32"
    arr = np.frombuffer(dense.read_bytes(), "<f4").copy()
    arr[13 * 5 + 2] = np.inf
    dense.write_bytes(arr.tobytes())
    src = make_source(str(out), SIZES, seed=0)
    with pytest.raises(CriteoFormatError, match="row 5: a dense value is not finite"):
        for step in range(src.steps_per_epoch(100) or 0):
            src.train_batch(step, 100)
        list(src.eval_batches(100))


def test_skipped_lines_reach_the_summary(tmp_path: Path, criteo_ragged: Path) -> None:
    import json

    from recsz.config import TrainConfig
    from recsz.train import main

    lines = criteo_ragged.read_text().splitlines()[:200]
    lines[7] = "2" + lines[7][1:]
    data = _write(tmp_path, lines)
    out = tmp_path / "run"
    argv = ["--data", str(data), "--skip-bad-lines", "--no-progress", "--out", str(out)]
    assert main([*argv, "--steps", "2"]) == 0
    assert json.loads((out / "summary.json").read_text())["skipped_lines"] == 1
    with pytest.raises(ValueError, match="--eval-batch-size must be >= 1"):
        TrainConfig(eval_batch_size=0)


def test_eval_data_holds_out_another_file_and_all_of_data_trains(
    tmp_path: Path, criteo_10k: Path, criteo_ragged: Path
) -> None:
    """--eval-data: every row of --data trains (in the permutation an epoch draws) and the
    other file's rows evaluate, in order; --eval-fraction moves the split of one file."""
    import torch

    from recsz.data.source import make_source

    binned = tmp_path / "eval_bin"
    preprocessed.preprocess(criteo_ragged, binned, SIZES, progress=False)
    for held in (str(criteo_ragged), str(binned)):  # a raw file or a preprocessed directory
        src = make_source(str(criteo_10k), SIZES, seed=2, eval_data=held)
        assert src.n_train == 9_999
        rows = torch.cat([src.train_batch(k, 99).labels for k in range(101)])
        assert len(rows) == 9_999  # one epoch: every row once
        want = criteo.read(criteo_ragged, SIZES)
        got = list(src.eval_batches(300))
        assert [len(b) for b in got] == [300, 300, 300, 100]
        np.testing.assert_array_equal(torch.cat([b.ids for b in got]).numpy(), want.cats)
        np.testing.assert_array_equal(torch.cat([b.labels for b in got]).numpy(), want.labels)
    split = make_source(str(criteo_10k), SIZES, seed=2, eval_frac=0.05)
    assert split.n_train == 9_499 and sum(len(b) for b in split.eval_batches(4096)) == 500
    with pytest.raises(FileNotFoundError, match=r"--eval-data .*nowhere\.tsv: no such file"):
        make_source(str(criteo_10k), SIZES, seed=2, eval_data=str(tmp_path / "nowhere.tsv"))
    with pytest.raises(ValueError, match="--eval-data needs --data from a file"):
        make_source("synthetic", SIZES, seed=2, eval_data=str(criteo_ragged))


def test_a_damaged_held_out_row_is_named_in_its_own_file(
    tmp_path: Path, criteo_10k: Path, criteo_ragged: Path
) -> None:
    from recsz.data.source import make_source

    out = tmp_path / "held"
    preprocessed.preprocess(criteo_ragged, out, SIZES, progress=False)
    arr = np.frombuffer((out / "labels.f32").read_bytes(), "<f4").copy()
    arr[417] = 3.0
    (out / "labels.f32").write_bytes(arr.tobytes())
    src = make_source(str(criteo_10k), SIZES, seed=0, eval_data=str(out))
    with pytest.raises(CriteoFormatError, match=r"held: row 417: label .*3\.0.* is not 0 or 1"):
        list(src.eval_batches(256))
    # In one file, a held-out row is named by its line in that file.
    tail = tmp_path / "tail"
    preprocessed.preprocess(criteo_ragged, tail, SIZES, progress=False)
    arr = np.frombuffer((tail / "labels.f32").read_bytes(), "<f4").copy()
    arr[950] = 3.0
    (tail / "labels.f32").write_bytes(arr.tobytes())
    with pytest.raises(CriteoFormatError, match=r"tail: row 950: label .*3\.0"):
        list(make_source(str(tail), SIZES, seed=0).eval_batches(64))


def test_eval_fraction_and_eval_data_together_are_refused() -> None:
    from recsz.config import TrainConfig

    with pytest.raises(ValueError, match="--eval-fraction splits --data; with --eval-data"):
        TrainConfig(data="a.tsv", eval_data="b.tsv", eval_fraction=0.1)
    with pytest.raises(ValueError, match=r"--eval-fraction must be > 0 and <= 0.99, got 1.0"):
        TrainConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="--eval-fraction, --data-order: for --data from a file"):
        TrainConfig(eval_fraction=0.1, data_order="batches")  # --data synthetic
    with pytest.raises(ValueError, match="--data-order 'blocks' is not one of"):
        TrainConfig(data="a.tsv", data_order="blocks")


def test_a_run_evaluates_on_eval_data(
    tmp_path: Path, criteo_10k: Path, criteo_ragged: Path
) -> None:
    import json

    from recsz.train import main

    out = tmp_path / "run"
    argv = ["--data", str(criteo_10k), "--eval-data", str(criteo_ragged), "--steps", "3"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_samples"] == 1000 and summary["config"]["eval_data"] == str(criteo_ragged)


def test_preprocess_reads_several_files_in_order_gzipped_or_not(
    tmp_path: Path, criteo_10k: Path, criteo_ragged: Path
) -> None:
    """Terabyte's days into one set: the rows of each file in order, .gz read as the text,
    a bad line named by its own file and line."""
    import gzip
    import json

    from recsz.cli import main as cli

    zipped = tmp_path / "day_1.gz"
    zipped.write_bytes(gzip.compress(criteo_ragged.read_bytes()))
    out = tmp_path / "days"
    assert cli(["preprocess", str(criteo_10k), str(zipped), str(out), "--preset", "tiny"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["rows"] == 10_999 and meta["rows_per_source"] == [9_999, 1_000]
    assert meta["source"] == [str(criteo_10k), str(zipped)]
    got, first, second = (
        preprocessed.load(out),
        criteo.read(criteo_10k, SIZES),
        criteo.read(zipped, SIZES),
    )
    np.testing.assert_array_equal(got.cats, np.concatenate([first.cats, second.cats]))
    np.testing.assert_array_equal(got.dense, np.concatenate([first.dense, second.dense]))
    np.testing.assert_array_equal(got.labels, np.concatenate([first.labels, second.labels]))
    lines = criteo_ragged.read_text().splitlines()
    lines[41] = "x" + lines[41][1:]
    bad = tmp_path / "day_2.gz"
    bad.write_bytes(gzip.compress("\n".join(lines).encode()))
    with pytest.raises(CriteoFormatError, match=r"day_2\.gz:42"):
        preprocessed.preprocess([criteo_ragged, bad], tmp_path / "bad", SIZES, progress=False)
    assert not list((tmp_path / "bad").glob("*")), "no partial output after a failure"
    # Several files at once (processes): the same bytes, the same failure, nothing left.
    jobs = tmp_path / "jobs"
    assert cli(["preprocess", str(criteo_10k), str(zipped), str(jobs), "--jobs", "2"]) == 0
    for name in ("dense.f32", "cats.i32", "labels.f32", "meta.json"):
        assert (jobs / name).read_bytes() == (out / name).read_bytes(), name
    assert sorted(p.name for p in jobs.iterdir()) == ["cats.i32", "dense.f32", "labels.f32",
                                                       "meta.json"]  # fmt: skip
    with pytest.raises(CriteoFormatError, match=r"day_2\.gz:42"):
        preprocessed.preprocess([criteo_ragged, bad], tmp_path / "bad", SIZES, False, False, jobs=2)
    assert not list((tmp_path / "bad").glob("*")), "no partial output after a failure"


def test_parallel_preprocess_holds_at_most_jobs_parts_on_the_disk(
    tmp_path: Path, criteo_ragged: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More files than jobs: the same bytes as one file at a time, each file's part joined
    and deleted as soon as it and those before it are done, while the next are parsed (at
    most ``jobs`` parts on the disk at once)."""
    import shutil

    days = []
    for i in range(5):
        day = tmp_path / f"day_{i}"
        lines = criteo_ragged.read_text().splitlines()
        day.write_text("\n".join(lines[i * 100 :]) + "\n")  # each its own rows
        days.append(day)
    one = tmp_path / "one"
    preprocessed.preprocess(days, one, SIZES, progress=False)
    seen: list[int] = []
    copy = shutil.copyfileobj

    def counting(src, dst, length=0):  # type: ignore[no-untyped-def]
        seen.append(len({p.suffix for p in (tmp_path / "jobs").glob("*.part*")}))
        return copy(src, dst, length)

    monkeypatch.setattr(shutil, "copyfileobj", counting)
    preprocessed.preprocess(days, tmp_path / "jobs", SIZES, progress=False, jobs=2)
    for name in ("dense.f32", "cats.i32", "labels.f32", "meta.json"):
        assert (tmp_path / "jobs" / name).read_bytes() == (one / name).read_bytes(), name
    assert len(seen) == 3 * 4  # three files a part, the first part renamed
    assert max(seen) <= 2, seen
    assert not list((tmp_path / "jobs").glob("*.part*"))


def test_a_raw_file_too_large_for_the_hosts_memory_is_refused_before_it_is_read(
    tmp_path: Path, criteo_10k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each local rank reads a raw file into its own arrays: where they would not fit, the
    error names the file, the memory and the way out (preprocess), before any parsing; a
    preprocessed directory (memory-mapped) is not refused."""
    import gzip

    import recsz.data.source as source
    from recsz import hostmemory

    out = tmp_path / "bin"
    preprocessed.preprocess(criteo_10k, out, SIZES, progress=False)
    zipped = tmp_path / "day_0.gz"
    zipped.write_bytes(gzip.compress(criteo_10k.read_bytes()))
    size = criteo_10k.stat().st_size
    need = source.RAW_READ_BYTES_PER_BYTE * size
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(hostmemory, "available", lambda: int(4 * need) + 1)
    assert len(source.make_source(str(criteo_10k), SIZES, seed=0).arrays) == 9_999
    monkeypatch.setattr(hostmemory, "available", lambda: int(4 * need) - 1)
    parsed = []
    monkeypatch.setattr(criteo, "read", lambda *a, **k: parsed.append(a))
    with pytest.raises(MemoryError, match=r"--data .*head10k\.tsv: .* 4 rank\(s\).*preprocess"):
        source.make_source(str(criteo_10k), SIZES, seed=0)
    gz_need = source.RAW_READ_BYTES_PER_BYTE * source.GZIP_TEXT_PER_BYTE * zipped.stat().st_size
    monkeypatch.setattr(hostmemory, "available", lambda: int(4 * gz_need) - 1)
    with pytest.raises(MemoryError, match=r"--eval-data .*day_0\.gz"):  # its text: 4x the file
        source.make_source(str(out), SIZES, seed=0, eval_data=str(zipped))
    both = need + gz_need  # each fits alone on the 4 ranks, not the two together
    monkeypatch.setattr(hostmemory, "available", lambda: int(4 * both) - 1)
    with pytest.raises(MemoryError, match=r"--data .*head10k\.tsv, --eval-data .*day_0\.gz"):
        source.make_source(str(criteo_10k), SIZES, seed=0, eval_data=str(zipped))
    assert not parsed
    assert len(source.make_source(str(out), SIZES, seed=0).arrays) == 9_999


def test_batches_order_reads_contiguous_batches_each_once_an_epoch(
    tmp_path: Path, criteo_10k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--data-order batches: an epoch is a permutation of its batches of contiguous rows
    (every full batch once, a new order each epoch, the same for the same seed); auto keeps
    the rows' permutation up to ROWS_ORDER_MAX training rows and takes batches above."""
    import torch

    import recsz.data.source as source

    out = tmp_path / "bin"
    preprocessed.preprocess(criteo_10k, out, SIZES, progress=False)
    arrays = preprocessed.load(out, SIZES)
    src = source.make_source(str(out), SIZES, seed=4, order="batches")
    spe = src.steps_per_epoch(500)
    assert src.order == "batches" and spe == 15
    for epoch in range(2):
        starts = []
        for k in range(epoch * spe, (epoch + 1) * spe):
            b = src.train_batch(k, 500)
            start = next(
                s for s in range(0, src.n_train - 499, 500)
                if np.array_equal(b.ids.numpy(), arrays.cats[s : s + 500])
            )  # fmt: skip
            np.testing.assert_array_equal(b.dense.numpy(), arrays.dense[start : start + 500])
            starts.append(start)
        assert sorted(starts) == list(range(0, spe * 500, 500))
        if epoch == 0:
            first = starts
    assert starts != first and starts != sorted(starts)
    again = source.make_source(str(out), SIZES, seed=4, order="batches")
    assert torch.equal(again.train_batch(3, 500).ids, src.train_batch(3, 500).ids)
    rows = source.make_source(str(out), SIZES, seed=4, order="rows")
    auto = source.make_source(str(out), SIZES, seed=4)
    assert auto.order == "rows" and torch.equal(
        auto.train_batch(5, 64).ids, rows.train_batch(5, 64).ids
    )
    monkeypatch.setattr(source, "ROWS_ORDER_MAX", 1000)
    assert source.make_source(str(out), SIZES, seed=4).order == "batches"
    with pytest.raises(
        ValueError, match="--data-order 'blocks' is not one of: auto, rows, batches"
    ):
        source.make_source(str(out), SIZES, seed=4, order="blocks")


@pytest.mark.parametrize("order", ["rows", "batches"])
def test_a_ranks_part_of_a_files_batch_is_the_batch_where_it_says(
    tmp_path: Path, criteo_10k: Path, order: str
) -> None:
    """Read from the raw file (in memory) or preprocessed (memory-mapped), in either order."""
    from recsz.data.source import Part, make_source
    from tests.common import check_part

    out = tmp_path / "bin"
    preprocessed.preprocess(criteo_10k, out, SIZES, progress=False)
    for data in (str(criteo_10k), str(out)):
        src = make_source(data, SIZES, seed=2, order=order)
        for step, (rank, world, tables) in enumerate(
            [(0, 1, ()), (1, 2, (0, 3)), (3, 4, tuple(range(26))), (2, 8, (25,))]
        ):
            check_part(src, step, 512, Part(rank, world, tables))


# ---- the compiled parser against parse_line ---------------------------------------------
def _label(y: float) -> float | None:
    return None if math.isnan(y) else float(y)  # NaN (no label) compares equal as None


def _by_parse_line(data: bytes, sizes: list[int], labeled: bool = True) -> tuple[list, list[str]]:
    """Every line of ``data`` through parse_line alone (the definition): the samples of the
    lines it takes, and the errors of the others, in order."""
    rows, errors = [], []
    for n, raw in enumerate(data.split(b"\n")[: data.count(b"\n") + (not data.endswith(b"\n"))]):
        if raw in (b"", b"\r"):
            continue
        try:
            y, d, c, _ = criteo.parse_line(raw.decode("ascii"), sizes, f"f:{n + 1}", labeled)
        except (CriteoFormatError, UnicodeDecodeError) as e:
            errors.append(type(e).__name__)
            continue
        rows.append((_label(y), np.float32(d).tolist(), c))
    return rows, errors


def _by_iter_blocks(
    tmp_path: Path,
    data: bytes,
    sizes: list[int],
    chunk: int,
    labeled: bool = True,
    threads: int = 1,
) -> list:
    p = tmp_path / "f.tsv"
    p.write_bytes(data)
    stats = criteo.ParseStats()
    blocks = criteo.iter_blocks(
        p, sizes, 7, True, stats, chunk_bytes=chunk, labeled=labeled, threads=threads
    )
    return [
        (_label(float(y)), d.tolist(), c.tolist())
        for b in blocks
        for y, d, c in zip(b.labels, b.dense, b.cats, strict=True)
    ]


@pytest.mark.parametrize("name", ["criteo_kaggle_head10k.tsv", "criteo_kaggle_200.tsv",
                                  "criteo_kaggle_head1k_ragged.tsv"])  # fmt: skip
def test_the_compiled_parser_reads_the_real_samples_as_parse_line(
    criteo_10k: Path, name: str, tmp_path: Path
) -> None:
    path = criteo_10k.parent / name
    if not path.exists():
        pytest.skip(f"{path} is not here")
    data = path.read_bytes()
    want, errors = _by_parse_line(data, SIZES)
    assert not errors
    assert _by_iter_blocks(tmp_path, data, SIZES, 1 << 16) == want
    assert _by_iter_blocks(tmp_path, data, SIZES, 1 << 14, threads=3) == want  # pieces at once


ODD = ["", "-", "+3", " 4", "1" * 19, "1" * 18, "-" + "9" * 18, "-" + "9" * 19, "0x1f", "1_0",
       "123456789", "12345678", "g1", "\r", "-0", "00", "5 ", ":", "/", "@", "`", "G", "g",
       "\xe9", "2", "01", "1-", "--1", "ffffffff", "FFFFFFFF0"]  # fmt: skip
_ODD = st.one_of(st.sampled_from(ODD), st.text("0123456789abcdefABCDEF-:/g@`G+ ", max_size=10))


def test_the_compiled_parser_takes_each_odd_field_as_parse_line(tmp_path: Path) -> None:
    """Each odd field in the label, in counts and in categories (first, middle, last) of
    an otherwise well-formed line: the samples are parse_line's (None where it refuses)."""
    base = ["1", *("7" for _ in range(13)), *("a3f" for _ in range(26))]
    lines = []
    for odd in ODD:
        for at in (0, 1, 7, 13, 14, 30, 39):
            fields = list(base)
            fields[at] = odd
            lines.append("\t".join(fields) + "\n")
    data = "".join(lines).encode("latin-1")
    want, _ = _by_parse_line(data, SIZES)
    assert _by_iter_blocks(tmp_path, data, SIZES, 1 << 16) == want


_COUNT = st.one_of(st.just(""), st.from_regex(r"-?[0-9]{1,18}", fullmatch=True))
_CATEGORY = st.one_of(st.just(""), st.from_regex(r"[0-9a-fA-F]{1,8}", fullmatch=True))


@st.composite
def _line(draw: st.DrawFn) -> str:
    """A well-formed line, or one with a field made odd, fields dropped or one added."""
    fields = [draw(st.sampled_from(["0", "1"]))]
    fields += [draw(_COUNT) for _ in range(13)] + [draw(_CATEGORY) for _ in range(26)]
    change = draw(st.sampled_from(["none", "none", "odd", "drop", "add"]))
    if change == "odd":
        fields[draw(st.integers(0, 39))] = draw(_ODD)
    elif change == "drop":
        fields = fields[: draw(st.integers(1, 39))]
    elif change == "add":
        fields.append(draw(_CATEGORY))
    return "\t".join(fields) + draw(st.sampled_from(["\n", "\n", "\r\n", "\r\r\n", "\n\n"]))


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(_line(), min_size=1, max_size=10),
    chunk=st.sampled_from([8, 300, 1 << 16]),
    labeled=st.booleans(),
    threads=st.sampled_from([1, 3]),
)
def test_the_compiled_parser_takes_what_parse_line_takes(
    lines, chunk, labeled, threads, tmp_path_factory
) -> None:
    """Generated lines, well-formed or not (signs, spaces, prefixes, long fields, stripped or
    extra fields, carriage returns, blank lines), in chunks that cut lines anywhere, with a
    label or in the test layout (the same lines, their first field cut): the samples are
    parse_line's, and a line it refuses is skipped (--skip-bad-lines); the same on several
    threads."""
    if not labeled:
        lines = [line.split("\t", 1)[1] if "\t" in line else line for line in lines]
    data = "".join(lines).encode()
    want, _ = _by_parse_line(data, SIZES, labeled)
    got = _by_iter_blocks(tmp_path_factory.mktemp("p"), data, SIZES, chunk, labeled, threads)
    assert got == want


def _unlabeled(path: Path, out: Path) -> Path:
    """``path``'s lines in Criteo's test layout: each line's first field (its label) cut."""
    lines = path.read_text().splitlines(keepends=True)
    out.write_text("".join(line.split("\t", 1)[1] for line in lines))
    return out


@pytest.mark.parametrize("name", ["criteo_kaggle_head10k.tsv", "criteo_kaggle_head1k_ragged.tsv"])
def test_the_test_layout_reads_as_its_labeled_lines(
    criteo_10k: Path, name: str, tmp_path: Path
) -> None:
    """The real samples with their labels cut (the test layout; the ragged sample's lines
    stripped of trailing fields) read as the labeled file does, but the labels, NaN."""
    path = criteo_10k.parent / name
    if not path.exists():
        pytest.skip(f"{path} is not here")
    want = criteo.read(path, SIZES)
    got = criteo.read(_unlabeled(path, tmp_path / "test.txt"), SIZES, labeled=False)
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.cats, want.cats)
    assert np.isnan(got.labels).all() and len(got) == len(want)


def test_the_layouts_name_each_others_lines(criteo_10k: Path, tmp_path: Path) -> None:
    """A labeled line read as the test layout has a field too many, and a test-layout line
    whose first count is not 0 or 1 read as labeled has no label: each named, with its
    line, and the command that reads it; a field is numbered as in its own layout."""
    with pytest.raises(CriteoFormatError, match=r"head10k\.tsv:1: 40 fields, expected at most 39 "
                       r"\(a labeled line\? `recsz evaluate`"):  # fmt: skip
        criteo.read(criteo_10k, SIZES, labeled=False)
    test = tmp_path / "test.txt"
    test.write_text("\t".join(["5", *["1"] * 12, *["a"] * 26]) + "\n")
    with pytest.raises(CriteoFormatError, match=r"test\.txt:1: field 1 \(label\): '5' is not 0 "
                       r"or 1 \(an unlabeled line, .*`recsz predict`"):  # fmt: skip
        criteo.read(test, SIZES)
    test.write_text("\t".join(["1", *["1"] * 12, *["a"] * 26]) + "\n")  # its I1 taken for a label
    with pytest.raises(CriteoFormatError, match=r"test\.txt:1: field 14 \(I13\): 'a' is not an "
                       r"integer \(an unlabeled line, .*`recsz predict`"):  # fmt: skip
        criteo.read(test, SIZES)
    test.write_text("\t".join(["5", "x", *["1"] * 11, *["a"] * 26]) + "\n")
    with pytest.raises(CriteoFormatError, match=r"test\.txt:1: field 2 \(I2\): 'x'"):
        criteo.read(test, SIZES, labeled=False)
    test.write_text("\t".join(["5", *["1"] * 12, "a", "zz", *["a"] * 24]) + "\n")
    with pytest.raises(CriteoFormatError, match=r"test\.txt:1: field 15 \(C2\): 'zz'"):
        criteo.read(test, SIZES, labeled=False)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("chunk", [100, 1000, 1 << 24])
def test_a_bad_line_is_named_by_its_line_whatever_the_chunks(
    tmp_path: Path, criteo_ragged: Path, chunk: int, threads: int
) -> None:
    lines = criteo_ragged.read_text().splitlines()
    lines[41] = "x" + lines[41][1:]
    lines[700] = "y" + lines[700][1:]  # the first bad line is named, on any thread
    bad = tmp_path / "b.tsv"
    bad.write_text("\n".join(lines))
    with pytest.raises(CriteoFormatError, match=r"b\.tsv:42: field 1 \(label\)"):
        list(criteo.iter_blocks(bad, SIZES, chunk_bytes=chunk, threads=threads))


def test_a_reader_left_early_ends_its_threads(criteo_10k: Path) -> None:
    """A consumer that stops after one block (an evaluation that fails, a --target-auc
    reached) leaves no parsing thread behind once the reader is closed."""
    import threading

    def parsing() -> int:
        return sum(t.name.startswith("recsz-parse") for t in threading.enumerate())

    blocks = criteo.iter_blocks(criteo_10k, SIZES, block_rows=100, chunk_bytes=1 << 12, threads=3)
    assert len(next(blocks)) == 100
    assert parsing() > 0
    blocks.close()
    assert parsing() == 0


def test_parse_threads_share_the_cores_among_a_hosts_ranks(monkeypatch) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert criteo.parse_threads() == min(criteo.PARSE_THREADS, cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))
    assert criteo.parse_threads() == 1


def test_a_damaged_or_truncated_gzip_file_is_named(criteo_10k: Path, tmp_path: Path) -> None:
    """A gzipped day cut short (a copy that did not finish) or not gzip at all: the file is
    named, with the line up to which it is whole (to within a 64 KB read, not the start of
    the 16 MB piece it fails in), as a format error (no traceback of the gzip
    module's); the lines before the damage were read as the whole file's are."""
    import gzip
    import re
    import zlib

    raw = criteo_10k.read_bytes()
    whole = gzip.compress(raw)
    cut = tmp_path / "day_0.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    readable = zlib.decompressobj(31).decompress(cut.read_bytes())  # all a reader can have
    got = []
    said = r"day_0\.gz: damaged or truncated gzip data: whole up to line \d+, damaged .* \(Com"
    with pytest.raises(CriteoFormatError, match=said) as e:
        got.extend(criteo.iter_blocks(cut, SIZES, block_rows=100, chunk_bytes=1 << 18))
    named = int(re.search(r"up to line (\d+)", str(e.value))[1])  # type: ignore[index]
    last = readable.count(b"\n")  # the last whole line
    assert raw.count(b"\n", 0, len(readable) - criteo.GZ_PIECE) <= named <= last
    want = criteo.read(criteo_10k, SIZES)
    n = sum(len(b) for b in got)
    assert 0 < n <= named
    np.testing.assert_array_equal(np.concatenate([b.cats for b in got]), want.cats[:n])
    plain = tmp_path / "day_1.gz"
    plain.write_bytes(raw[:1000])  # named .gz, not gzip
    with pytest.raises(CriteoFormatError, match=r"day_1\.gz: .*up to line 0, .*Not a gzipped"):
        criteo.read(plain, SIZES)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 30), limit=st.integers(1, 5), workers=st.integers(1, 4))
def test_in_order_yields_in_order_taking_at_most_its_limit_ahead(
    n: int, limit: int, workers: int
) -> None:
    """The ordered map under the parser's threads and `recsz preprocess --jobs`: every
    item's result in the items' order; while the consumer holds item k, exactly the items
    up to k + limit - 1 are taken (the disk's bound for preprocess's parts)."""
    from concurrent.futures import ThreadPoolExecutor

    taken: list[int] = []

    def items():  # type: ignore[no-untyped-def]
        for i in range(n):
            taken.append(i)
            yield i

    with ThreadPoolExecutor(workers) as pool:
        got = 0
        for k, (i, r) in enumerate(criteo.in_order(lambda x: x * x, items(), pool, limit)):
            assert (i, r) == (k, k * k)
            assert len(taken) == min(n, k + limit)
            got += 1
    assert got == n == len(taken)
