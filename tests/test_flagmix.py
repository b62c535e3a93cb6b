"""Any mix of `recsz train`'s options (every option with a set of values or on/off, and the
table kinds' numbers, drawn by hypothesis) either trains or is refused before any rank
starts with a ValueError, never another exception mid-run; resumes as it would have run;
and with lossless codecs trains on 2 ranks as on one process."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from recsz.config import TrainConfig
from recsz.fields import flag
from recsz.train import main

#: not drawn: the model's size (tiny only), what needs a GPU or compiles for long, what
#: names files or other runs, the output
LEFT = {"preset", "device", "cuda_graph", "compile", "resume", "init_from", "inject_failure",
        "out", "progress", "data", "eval_data", "nproc"}  # fmt: skip
#: numbers whose values make other kinds of tables or steps
NUMBERS = {
    "column_shards": ["1", "2", "4"],
    "tt_tables": ["0", "1", "3"],
    "tt_cache_rows": ["0", "8"],
    "fiited_budget": ["0.5", "1.0"],
    "fiited_chunk": ["4", "8"],
    "fiited_interval": ["1", "100"],
    "multi_hot": ["", "2", "1,3," * 12 + "2,2", "mlperf"],
    "lr_warmup_steps": ["0", "2"],
    "lr_decay_steps": ["0", "2"],
    "prefetch": ["0", "2"],
    "eval_every": ["0", "2"],
    "checkpoint_every": ["0", "2"],
    "hindex_probe_steps": ["1", "2"],
    "hindex_every": ["0", "2"],
    "compress_trial": ["1", "2"],
    "compress_every": ["2"],
    "decay_t": ["2"],
    "dct_refresh": ["1"],
    "dcn_layers": ["1"],
    "dcn_rank": ["4"],
    "fwd_eb": ["1e-6", "0.5"],
    "target_auc": ["0.5"],
    "patience": ["0", "1"],
    "emb_dim": ["8", "16"],
    "bottom_mlp": ["32-16"],
    "top_mlp": ["8-1"],
    "max_rows": ["50"],
    "profile": ["0", "2"],
}


def _values() -> dict[str, list[str | None]]:
    """Each drawn option's values as flags take them (None: its --no- form)."""
    out: dict[str, list[str | None]] = {}
    for f in fields(TrainConfig):
        if f.name in LEFT or not f.metadata["cli"]:
            continue
        if f.metadata["choices"]:
            out[f.name] = list(f.metadata["choices"])
        elif f.type == "bool":
            out[f.name] = ["on", None]
        elif f.name in NUMBERS:
            out[f.name] = list(NUMBERS[f.name])
    return out


VALUES = _values()


def train(argv: list[str]) -> int:
    """`recsz train` of ``argv``; an absolute bound wider than the data it bounds (a
    warning recsz gives once, as it should) is not an error here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="absolute error bound", category=UserWarning)
        return main(argv)


@st.composite
def option_mixes(draw: st.DrawFn) -> list[str]:
    names = draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=8, unique=True))
    argv = []
    for name in names:
        v = draw(st.sampled_from(VALUES[name]))
        if v == "on":
            argv.append(flag(name))
        elif v is None:
            argv.append("--no-" + flag(name)[2:])
        else:
            argv += [flag(name), v]
    return argv


def test_the_drawn_options_cover_the_choices_and_switches() -> None:
    """Every option with fixed values or on/off is drawn (a new one joins by itself)."""
    assert {"fwd_codec", "eb_policy", "dp_comm", "emb_optimizer", "table_dtype",
            "multi_hot_draws", "compress", "id_dedup", "check_bounds"} <= set(VALUES)  # fmt: skip
    assert all(VALUES.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=option_mixes())
@example(mix=["--dp-comm", "dct"])  # one rank: no hook, no refreshes (crashed at the report)
@example(mix=["--bwd-codec", "hybrid", "--eb-policy", "none"])  # refused at the first step
def test_any_mix_of_options_trains_or_is_refused_up_front(
    mix: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("mix")
    argv = ["--steps", "3", "--batch-size", "32", "--synthetic-eval", "64", "--no-progress",
            "--log-every", "1", "--out", str(out), *mix]  # fmt: skip
    try:
        rc = train(argv)
    except (ValueError, ImportError) as e:  # (ImportError: an optional library not here)
        assert not isinstance(e, ImportError) or " needs " in str(e), e
        assert not (out / "metrics.jsonl").exists(), "refused after training began"
        return
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["logloss"]) and 0 <= summary["auc"] <= 1


def _losses(run: Path) -> list[float]:
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if "loss" in r]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=option_mixes())
def test_any_mix_of_options_resumes_as_it_would_have_run(
    mix: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A run of any mix stopped at its checkpoint (step 2) and resumed to step 4 logs the
    losses and ends at the AUC of the same run straight through (``--compress auto``
    left out: its way follows the steps' timings, which differ run to run)."""
    for name in ("--checkpoint-every", "--compress"):
        if name in mix:
            at = mix.index(name)
            del mix[at : at + 2]
    straight, halves = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("halves")
    flags = ["--batch-size", "32", "--synthetic-eval", "64", "--no-progress", "--log-every",
             "1", "--checkpoint-every", "2", *mix]  # fmt: skip
    try:
        train(["--steps", "4", "--out", str(straight), *flags])
    except (ValueError, ImportError):
        return  # refused (the test above holds it to that)
    assert train(["--steps", "2", "--out", str(halves), *flags]) == 0
    assert train(["--resume", str(halves), "--steps", "4", "--no-progress"]) == 0
    assert _losses(halves) == _losses(straight)
    want, got = (json.loads((r / "summary.json").read_text()) for r in (straight, halves))
    assert got["auc"] == want["auc"] and got["steps"] == want["steps"]  # (--target-auc: fewer)


#: options whose values make two ranks differ from one by design: lossy codecs and hooks,
#: bfloat16 MLPs (the codecs are drawn lossless below)
_NOT_LOSSLESS = {"--fwd-codec", "--bwd-codec", "--dp-comm", "--dp-codec", "--dense-dtype"}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mix=option_mixes(),
    codecs=st.tuples(*[st.sampled_from(["none", "zstd", "lz4"])] * 2),
)
@example(
    mix=["--tt-tables", "3", "--multi-hot", "2", "--tt-cache-rows", "8"], codecs=("none", "zstd")
)
@example(mix=["--tt-tables", "3", "--multi-hot", "mlperf", "--tt-placement", "replicated"],
         codecs=("lz4", "none"))  # fmt: skip
def test_two_ranks_train_any_lossless_mix_as_one_process_does(
    mix: list[str], codecs: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any mix of options with lossless codecs: 2 ranks log the losses and reach the AUC of
    one process (within float32 sums' order: 1e-4; with half-precision tables, whose
    stochastic rounding draws from each value's bits, a last-bit difference of a sum may
    round a row the other way: 1e-3 and an AUC within 2e-3, a few of 128 samples' pairs)."""
    for name in _NOT_LOSSLESS & set(mix):
        at = mix.index(name)
        del mix[at : at + 2]
    flags = ["--steps", "4", "--batch-size", "64", "--synthetic-eval", "128", "--no-progress",
             "--log-every", "1", "--fwd-codec", codecs[0], "--bwd-codec", codecs[1]]  # fmt: skip
    flags += mix
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    try:
        train([*flags, "--out", str(one)])
    except ValueError:
        return  # refused
    assert train([*flags, "--out", str(two), "--nproc", "2"]) == 0
    half = "--table-dtype" in mix and mix[mix.index("--table-dtype") + 1] != "fp32"
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-3 if half else 1e-4, abs=1e-5)
    want, got = (json.loads((r / "summary.json").read_text()) for r in (one, two))
    assert got["auc"] == pytest.approx(want["auc"], abs=2e-3 if half else 1e-4)
