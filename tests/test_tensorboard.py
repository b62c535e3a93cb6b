"""`--tensorboard`: a run's metrics rows as TensorBoard scalars beside metrics.jsonl, the
same numbers at the same steps; a resumed run hides the steps it trains again, as it drops
their rows."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from recsz.report import TENSORBOARD, scalars
from recsz.train import main

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo_kaggle_200.tsv"
FLAGS = ["--batch-size", "32", "--synthetic-eval", "64", "--no-progress", "--log-every", "2",
         "--eval-every", "4", "--checkpoint-every", "4", "--fwd-codec", "hybrid",
         "--bwd-codec", "hybrid", "--eb-policy", "dual", "--tensorboard"]  # fmt: skip


def board(run: Path, under: str = TENSORBOARD) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``run`` (its board in ``run / under``): tag ->
    (step, value) in step order."""
    acc = EventAccumulator(str(run / under), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_board_is_the_log(run: Path) -> None:
    """Each tag's points are its number in each metrics row, step by step (float32)."""
    want: dict[str, list[tuple[int, float]]] = {}
    for row in rows(run):
        for tag, value in scalars(row).items():
            want.setdefault(tag, []).append((row["step"], value))
    got = board(run)
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got[tag], points, strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-30), tag


def test_the_board_holds_the_logs_numbers_and_a_resume_hides_what_it_reruns(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    assert main([*FLAGS, "--steps", "6", "--out", str(run)]) == 0
    assert_board_is_the_log(run)
    tags = board(run)
    assert [s for s, _ in tags["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in tags["eval/auc"]] == [4, 6]
    assert len([t for t in tags if t.startswith("fwd_eb/table_")]) == 26  # each table's bound
    assert "fwd_eb/table_07" in tags and "fwd_class/table_07" not in tags  # (a name: no number)
    # cut after its checkpoint at step 4 (the one at 6 lost), resumed to step 8: steps 5-8
    # trained again, the first attempt's points after step 4 hidden
    shutil.rmtree(run / "checkpoints" / "step-000000006")
    assert main(["--resume", str(run), "--steps", "8", "--no-progress"]) == 0
    assert len(list((run / TENSORBOARD).glob("events.out.tfevents.*"))) == 2
    assert_board_is_the_log(run)
    assert [s for s, _ in board(run)["train/loss"]] == [2, 4, 6, 8]
    assert [s for s, _ in board(run)["eval/auc"]] == [4, 8]


def test_a_rows_numbers_become_tags_and_the_rest_is_left() -> None:
    row = {"step": 3, "loss": 0.5, "bytes_sent": 7, "dp_ratio": math.nan, "eval_auc": 0.75,
           "ok": True, "tables": {"0": {"fwd_eb": 0.01, "fwd_class": "base"},
                                  "10": {"bwd_ratio": 9.5}}}  # fmt: skip
    assert scalars(row) == {"train/loss": 0.5, "train/bytes_sent": 7.0, "eval/auc": 0.75,
                            "fwd_eb/table_00": 0.01, "bwd_ratio/table_10": 9.5}  # fmt: skip


def test_without_the_package_it_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else found(name, *a),
    )
    with pytest.raises(ImportError, match="--tensorboard needs the tensorboard package"):
        main([*FLAGS, "--steps", "2", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_boards_run_is_scored_and_planned_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What only reads a run (`recsz evaluate`, `recsz plan --config RUN`) writes no board,
    so it needs no package where the run had one (an inference machine's)."""
    from recsz.cli import main as cli
    from recsz.evaluation import main as evaluate

    run = tmp_path / "run"
    assert main([*FLAGS, "--steps", "4", "--out", str(run)]) == 0
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else found(name, *a),
    )
    assert evaluate([str(run), "--json", str(tmp_path / "ev.json")]) == 0
    assert json.loads((tmp_path / "ev.json").read_text())["step"] == 4
    assert cli(["plan", "--config", str(run), "--nproc", "2"]) == 0
    with pytest.raises(ImportError, match="--tensorboard needs the tensorboard package"):
        evaluate([str(run), "--tensorboard"])  # (asked for: refused before any work)


def test_recsz_evaluate_adds_its_numbers_beside_the_training_board(tmp_path: Path) -> None:
    """`recsz evaluate --tensorboard`: the numbers at the checkpoint's step, a board of
    their own a data set (the held-out set; an --eval-data file by its name), the same tags
    as the training's evaluations; the training's board left as it was."""
    from recsz.evaluation import main as evaluate

    run = tmp_path / "run"
    assert main([*FLAGS, "--steps", "8", "--out", str(run)]) == 0
    for extra, name in (([], "held-out"), (["--eval-data", str(SAMPLE)], "criteo_kaggle_200.tsv")):
        if extra and not SAMPLE.exists():
            continue
        out = tmp_path / f"{name}.json"
        argv = [str(run / "checkpoints" / "step-000000004"), "--tensorboard", "--json", str(out)]
        assert evaluate([*argv, *extra]) == 0
        ev = json.loads(out.read_text())
        got = board(run / TENSORBOARD / f"evaluate-{name}", "")
        assert got["eval/auc"] == [(4, pytest.approx(ev["auc"], rel=1e-6))]
        assert {t for t in got if not t.startswith("eval/")} == set()
    assert_board_is_the_log(run)
