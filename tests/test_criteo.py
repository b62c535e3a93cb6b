"""The Criteo reader on the real samples, ragged lines, and malformed input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from recsz.data import criteo
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


def test_preprocess_then_load_matches_read(tmp_path: Path, criteo_ragged: Path) -> None:
    out = tmp_path / "bin"
    stats = criteo.preprocess(criteo_ragged, out, SIZES, progress=False)
    assert stats.lines == 1000
    m = criteo.load(out, SIZES)
    a = criteo.read(criteo_ragged, SIZES)
    np.testing.assert_array_equal(np.asarray(m.cats), a.cats)
    np.testing.assert_array_equal(np.asarray(m.dense), a.dense)
    with pytest.raises(ValueError, match="hashed into table sizes"):
        criteo.load(out, get_preset("kaggle").model.table_sizes)


def test_iter_blocks_streams_in_bounded_blocks(criteo_10k: Path) -> None:
    sizes = [len(b) for b in criteo.iter_blocks(criteo_10k, SIZES, block_rows=4000)]
    assert sizes == [4000, 4000, 1999]
