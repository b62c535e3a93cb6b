"""`recsz train`'s configuration: its flags, and `--config FILE` (a run's config.json or a
JSON / TOML file of options) under the flags given; bad files named by file and line or
option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.config import TrainConfig, parse_train_args
from recsz.train import main


def _toml(values: dict[str, object]) -> str:
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())  # scalars, lists


#: a few options of each type
OPTIONS = {
    "steps": st.integers(1, 10**6),
    "eb": st.floats(1e-6, 1.0, exclude_max=True),  # a relative bound: below 1
    "dedup": st.booleans(),
    "codec": st.sampled_from(["none", "hybrid", "fp16", "zstd"]),
}


@settings(max_examples=20, deadline=None)
@given(**OPTIONS)
def test_flags_round_trip_through_the_config(
    steps: int, eb: float, dedup: bool, codec: str
) -> None:
    argv = ["--steps", str(steps), "--fwd-eb", repr(eb), "--fwd-codec", codec]
    argv.append("--id-dedup" if dedup else "--no-id-dedup")
    cfg = parse_train_args(argv)
    assert (cfg.steps, cfg.fwd_eb, cfg.id_dedup, cfg.fwd_codec) == (steps, eb, dedup, codec)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@settings(max_examples=25, deadline=None)
@given(
    **OPTIONS,
    lr=st.one_of(st.none(), st.integers(1, 9), st.floats(1e-4, 10.0)),
    toml=st.booleans(),
    dashes=st.booleans(),
    overridden=st.sampled_from(["steps", "fwd_codec", None]),
)
def test_a_file_gives_what_its_flags_give_and_flags_override_it(
    tmp_path_factory: pytest.TempPathFactory, steps: int, eb: float, dedup: bool, codec: str,
    lr: float | None, toml: bool, dashes: bool, overridden: str | None,
) -> None:  # fmt: skip
    values: dict[str, object] = {"steps": steps, "fwd_eb": eb, "id_dedup": dedup,
                                 "fwd_codec": codec, "lr": lr}  # fmt: skip
    argv = ["--steps", str(steps), "--fwd-eb", repr(eb), "--fwd-codec", codec]
    argv += ["--id-dedup" if dedup else "--no-id-dedup"] + ([] if lr is None else ["--lr", str(lr)])
    named = {k.replace("_", "-") if dashes else k: v for k, v in values.items()}
    if toml:  # TOML has no null: an option left out keeps its default, as a flag not given
        named = {k: v for k, v in named.items() if v is not None}
    path = tmp_path_factory.mktemp("c") / ("c.toml" if toml else "c.json")
    path.write_text(_toml(named) if toml else json.dumps(named))
    assert parse_train_args(["--config", str(path)]) == parse_train_args(argv)
    flags = {"steps": ["--steps", "7"], "fwd_codec": ["--fwd-codec", "lz4"], None: []}
    cfg = parse_train_args(["--config", str(path), *flags[overridden]])
    want = {"steps": 7, "fwd_codec": "lz4", None: None}[overridden]
    if overridden:
        assert getattr(cfg, overridden) == want
    assert cfg.fwd_eb == eb and cfg.id_dedup == dedup and isinstance(cfg.lr, float | None)


def test_a_runs_config_json_trains_the_run_again(tmp_path: Path) -> None:
    """What a run wrote (config.json) trains the same run again, wherever --out says: the
    same configuration but for its directory, the same losses and AUC."""
    flags = ["--steps", "6", "--batch-size", "64", "--synthetic-eval", "512", "--log-every",
             "3", "--fwd-codec", "hybrid", "--bwd-codec", "fp16", "--lr", "0.3"]  # fmt: skip
    flags.append("--no-progress")
    assert main([*flags, "--out", str(tmp_path / "a")]) == 0
    record = str(tmp_path / "a" / "config.json")
    assert main(["--config", record, "--out", str(tmp_path / "b")]) == 0
    assert parse_train_args(["--config", str(tmp_path / "a")]) == parse_train_args(
        ["--config", record]
    )  # a run's directory: its record
    a, b = (json.loads((tmp_path / r / "config.json").read_text()) for r in "ab")
    assert a.pop("out") != b.pop("out") and a == b
    rows = {r: (tmp_path / r / "metrics.jsonl").read_text().splitlines() for r in "ab"}
    losses = {r: [json.loads(x).get("loss") for x in rows[r]] for r in "ab"}
    assert losses["a"] == losses["b"] and any(v is not None for v in losses["a"])
    auc = {r: json.loads((tmp_path / r / "summary.json").read_text())["auc"] for r in "ab"}
    assert auc["a"] == auc["b"]


def test_a_runs_own_places_are_not_taken_from_its_record(tmp_path: Path) -> None:
    """A run's config.json names its directory: a run from it writes where its own --out
    says (nowhere without one); a hand-written file may not name one."""
    record = {**TrainConfig(steps=3, out="runs/old", resume_fallback=True).to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(record))
    cfg = parse_train_args(["--config", str(tmp_path / "config.json")])
    assert cfg.out is None and cfg.steps == 3 and not cfg.resume_fallback
    (tmp_path / "mine.toml").write_text('steps = 3\nout = "runs/x"\n')
    with pytest.raises(ValueError, match=r"mine.toml: 'out' is the command line's \(--out\)"):
        parse_train_args(["--config", str(tmp_path / "mine.toml")])


@settings(max_examples=20, deadline=None)
@given(
    bottom=st.lists(st.integers(1, 64), min_size=0, max_size=3),
    top=st.lists(st.integers(1, 64), min_size=0, max_size=3),
    classes=st.lists(st.floats(1e-4, 0.5), min_size=3, max_size=3).map(sorted),
    toml=st.booleans(),
)
def test_a_file_gives_widths_and_bounds_as_lists(
    tmp_path_factory: pytest.TempPathFactory, bottom: list[int], top: list[int],
    classes: list[float], toml: bool,
) -> None:  # fmt: skip
    """A file's list of numbers gives what the flag's dash- or comma-separated string
    gives: MLP widths, class bounds."""
    values = {"bottom_mlp": [*bottom, 16], "top_mlp": [*top, 1], "fwd_class_eb": classes}
    path = tmp_path_factory.mktemp("c") / ("c.toml" if toml else "c.json")
    path.write_text(_toml(values) if toml else json.dumps(values))
    argv = ["--bottom-mlp", "-".join(map(str, values["bottom_mlp"])),
            "--top-mlp", "-".join(map(str, values["top_mlp"])),
            "--fwd-class-eb", ",".join(map(str, classes))]  # fmt: skip
    cfg = parse_train_args(["--config", str(path)])
    assert cfg == parse_train_args(argv)
    assert cfg.model().bottom_mlp == (*bottom, 16) and cfg.model().top_mlp == (*top, 1)
    assert list(cfg.class_eb("fwd").values()) == classes


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("a.toml", "batch_sise = 3\n", r"a.toml: 'batch_sise' is not an option \(did you mean "
         r"'batch_size'\?\)"),
        ("a.toml", 'batch-size = "64"\n', r"a.toml: batch-size: wants int or null, got '64'"),
        ("a.toml", "log_every = 2.5\n", r"a.toml: log_every: wants int, got 2.5"),
        ("a.toml", "id_dedup = 1\n", r"a.toml: id_dedup: wants bool, got 1"),
        ("a.json", '{"steps": 3,\n "lr": }', r"a.json: not JSON: .*line 2 column 8"),
        ("a.toml", "steps = 3\nlr = \n", r"a.toml: not TOML: .*line 2"),
        ("a.json", "[1, 2]", r"a.json: wants an object of options, got list"),
        ("a.toml", 'fwd_codec = "nope"\n', r"--fwd-codec 'nope' is not one of: .* \(--fwd-codec: "
         r".*a.toml\)"),
        ("a.toml", "emb_lr = -1\n", r"--emb-lr must be > 0, got -1.0 \(--emb-lr: .*a.toml\)"),
        ("a.toml", 'top_mlp = [4, "x"]\n', r"a.toml: top_mlp: wants a list of numbers or a "
         r"'-'-separated string, got \[4, 'x'\]"),
        ("a.json", '{"top_mlp": []}', r"a.json: top_mlp: wants a list of numbers or a '-'-"),
        ("a.toml", "steps = [3]\n", r"a.toml: steps: wants no list, got \[3\]"),
        ("a.toml", "top_mlp = [8, 2]\n", r"top MLP must end in 1 \(the logit\), got \(8, 2\) "
         r"\(--top-mlp: .*a.toml\)"),
    ],
)  # fmt: skip
def test_a_bad_file_is_named_with_its_line_or_option(
    tmp_path: Path, name: str, text: str, error: str
) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=error):
        parse_train_args(["--config", str(tmp_path / name)])


def test_a_flag_fixes_what_the_file_got_wrong_and_other_errors_stay_unblamed(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.toml").write_text('fwd_codec = "nope"\nsteps = 4\n')
    cfg = parse_train_args(["--config", str(tmp_path / "a.toml"), "--fwd-codec", "zstd"])
    assert (cfg.fwd_codec, cfg.steps) == ("zstd", 4)
    with pytest.raises(ValueError, match=r"^--batch-size must be >= 1, got 0$"):
        parse_train_args(["--config", str(tmp_path / "a.toml"), "--fwd-codec", "zstd",
                          "--batch-size", "0"])  # fmt: skip


def test_config_with_resume_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--config with --resume"):
        main(["--resume", str(tmp_path), "--config", str(tmp_path / "c.json")])
    with pytest.raises(FileNotFoundError, match=r"c\.json: No such file"):
        main(["--config", str(tmp_path / "c.json")])
