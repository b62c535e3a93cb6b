"""Options the rest of a configuration leaves idle (`configcheck.idle`): each is said, and
a run with it set trains exactly as the run without it; an option that acts is not said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsz.config import TrainConfig, configured, given_args
from recsz.configcheck import idle
from recsz.train import main

BASE = ["--steps", "2", "--batch-size", "32", "--synthetic-eval", "256", "--no-progress",
        "--log-every", "1"]  # fmt: skip
HYBRID = ["--fwd-codec", "hybrid", "--bwd-codec", "hybrid"]

#: (the run's flags, the idle option's flags): options with nothing to act on
CASES = [
    ([], ["--eb-policy", "dual"]), ([], ["--eb-mode", "abs"]), ([], ["--fwd-eb", "0.1"]),
    ([], ["--bwd-eb", "0.1"]), ([], ["--coder", "blocks"]), ([], ["--compress-trial", "3"]),
    ([], ["--compress-every", "40"]), ([], ["--compress-scope", "between-hosts"]),
    ([], ["--powersgd-rank", "4"]),
    ([], ["--powersgd-warmup", "3"]), ([], ["--dp-codec", "fp16"]), ([], ["--dp-eb", "0.1"]),
    ([], ["--dp-eb-collective", "rsag"]), ([], ["--dct-keep", "0.5"]),
    ([], ["--dct-refresh", "3"]), ([], ["--dcn-layers", "2"]), ([], ["--dcn-rank", "4"]),
    ([], ["--lr-decay-start", "1"]), ([], ["--lr-decay-power", "1.0"]),
    ([], ["--checkpoint-every", "1"]), ([], ["--tensorboard"]), ([], ["--resume-fallback"]),
    ([], ["--tt-rank", "4"]),
    ([], ["--max-restarts", "2"]), ([], ["--profile-from", "1"]),
    ([], ["--tt-cores", "2"]), ([], ["--tt-init", "normal"]), ([], ["--tt-lr", "0.5"]),
    ([], ["--tt-cache-rows", "10"]), ([], ["--tt-placement", "replicated"]),
    ([], ["--fiited-chunk", "4"]), ([], ["--fiited-interval", "1"]),
    ([], ["--fiited-decay", "0.1"]), ([], ["--fiited-mask-backward"]),
    ([], ["--fiited-rule", "uniform"]),
    # bounded codecs, each policy leaving some bounds idle
    ([*HYBRID, "--eb-policy", "dual"], ["--fwd-eb", "0.1"]),
    ([*HYBRID, "--eb-policy", "dual"], ["--bwd-eb", "0.1"]),
    ([*HYBRID, "--eb-policy", "fixed"], ["--fwd-class-eb", "0.01,0.02,0.04"]),
    ([*HYBRID, "--eb-policy", "fixed"], ["--bwd-class-eb", "0.01,0.02,0.04"]),
    ([*HYBRID, "--eb-policy", "fixed"], ["--hindex-probe-steps", "1"]),
    ([*HYBRID, "--eb-policy", "fixed"], ["--hindex-every", "1"]),
    ([*HYBRID, "--eb-policy", "table"], ["--decay-schedule", "constant"]),
    ([*HYBRID, "--eb-policy", "table"], ["--decay-c", "4"]),
    ([*HYBRID, "--eb-policy", "table"], ["--decay-t", "1"]),
    (["--fwd-codec", "hybrid", "--eb-policy", "fixed"], ["--bwd-eb", "0.1"]),
    (["--tt-tables", "2"], ["--tt-cache-interval", "1"]),
]  # fmt: skip
#: the same options where they act: not said
ACTING = [
    [*HYBRID, "--eb-policy", "dual", "--decay-c", "4", "--fwd-class-eb", "0.01,0.02,0.04",
     "--hindex-every", "5", "--eb-mode", "abs", "--coder", "blocks"],
    ["--fwd-codec", "hybrid", "--fwd-eb", "0.1", "--compress", "auto", "--compress-every", "40",
     "--compress-scope", "all"],
    ["--dp-comm", "eb", "--dp-codec", "fp16", "--dp-eb", "0.1"],
    ["--dp-comm", "dct", "--dct-keep", "0.5"], ["--fwd-codec", "dct", "--dct-refresh", "3"],
    ["--dp-comm", "powersgd", "--powersgd-rank", "4"], ["--interaction", "dcn", "--dcn-rank", "4"],
    ["--lr-decay-steps", "4", "--lr-decay-power", "1.0"],
    ["--tt-tables", "2", "--tt-rank", "4", "--tt-cache-rows", "10", "--tt-cache-interval", "1"],
    ["--fiited-budget", "0.5", "--fiited-chunk", "4"],
    ["--resume", "RUN", "--resume-fallback", "--checkpoint-every", "1", "--tensorboard"],
    ["--nproc", "2", "--max-restarts", "2"], ["--profile", "2", "--profile-from", "1"],
]  # fmt: skip


def summary(tmp: Path, name: str, flags: list[str]) -> dict:
    out = tmp / name
    assert main([*BASE, *flags, "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("base", sorted({tuple(b) for b, _ in CASES}))
def test_an_idle_option_is_said_and_trains_as_its_default(tmp_path: Path, base: tuple) -> None:
    plain = summary(tmp_path, "plain", list(base))
    for i, (flags, option) in enumerate(c for c in CASES if tuple(c[0]) == base):
        said = idle(configured(given_args([*BASE, *flags, *option])))
        assert len(said) == 1 and said[0].startswith(f"{option[0]} "), (option, said)
        if option[0] in ("--checkpoint-every", "--tensorboard"):  # idle without a run dir
            assert main([*BASE, *flags, *option]) == 0
            continue
        run = summary(tmp_path, str(i), [*flags, *option])
        for key in ("auc", "logloss", "bytes_payload", "fwd_ratio", "bwd_ratio"):
            assert run[key] == plain[key], (option, key)


@pytest.mark.parametrize("flags", ACTING, ids=lambda f: " ".join(f[:2]))
def test_an_option_that_acts_is_not_said(flags: list[str]) -> None:
    assert idle(configured(given_args(flags))) == []


def test_a_run_says_its_idle_options_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BASE, "--dct-keep", "0.5", "--tt-rank", "4"]) == 0
    err = capsys.readouterr().err
    assert err.count("recsz: warning:") == 2
    assert "--dct-keep 0.5 does nothing without --dp-comm dct" in err
    assert "--tt-rank 4 does nothing without --tt-tables" in err
    assert idle(TrainConfig()) == []


@pytest.mark.parametrize("hook", [["--dp-comm", "eb", "--dp-eb", "0.1"],
                                  ["--dp-comm", "powersgd", "--powersgd-rank", "4"]])  # fmt: skip
def test_the_mlp_hooks_are_idle_on_one_rank(tmp_path: Path, hook: list[str]) -> None:
    """One rank holds the only copy of the MLPs: the gradients' hook and its options are said
    (both), the run trains as without them; on 2 ranks they act."""
    cfg = configured(given_args([*BASE, *hook]))
    said = idle(cfg, world=1)
    assert [line.split()[0] for line in said] == [hook[0], hook[2]], said
    assert said[1].endswith(f"without --dp-comm {hook[1]} on 2 or more ranks")
    assert idle(cfg, world=2) == idle(cfg) == []
    plain, run = summary(tmp_path, "plain", []), summary(tmp_path, "hook", hook)
    for key in ("auc", "logloss", "bytes_payload", "allreduce_bytes"):
        assert run.get(key) == plain.get(key), key
