"""`recsz plot`, `recsz preprocess` and the benchmark scripts keep working."""

from __future__ import annotations

import importlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from recsz import launcher, ranks
from recsz.cli import main as cli_main
from recsz.plot import time_to

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str) -> ModuleType:
    """Import a benchmark script (benchmarks/ is not a package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_cli_reports_bad_input_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RECSZ_TRACEBACK", raising=False)
    assert cli_main(["train", "--dct-keep", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "recsz train: error: --dct-keep must be > 0 and <= 1, got 5" in err
    assert "Traceback" not in err
    assert cli_main(["train", "--data", "/nonexistent/x.tsv", "--no-progress"]) == 2
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setenv("RECSZ_TRACEBACK", "1")
    with pytest.raises(ValueError, match="dct-keep"):
        cli_main(["train", "--dct-keep", "5"])


def test_out_of_memory_is_said_with_what_to_change(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's out-of-memory error (and the host's) is bad input: the same settings fail
    the same way (a launched rank's is not restarted); said as a line, torch's message and
    then what to change, without a traceback. Other RuntimeErrors keep theirs."""
    monkeypatch.delenv("RECSZ_TRACEBACK", raising=False)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def step(*_a: object, **_kw: object) -> None:
        raise oom

    monkeypatch.setattr("recsz.train.train_step", step)
    assert cli_main(["train", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recsz train: error: CUDA out of memory. Tried to allocate 2.00 GiB ("
                          "recsz: a smaller --batch-size"), err  # fmt: skip
    assert "Traceback" not in err
    assert ranks.bad_input(oom) and ranks.bad_input(MemoryError())
    host = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                        "can't allocate memory: you tried to allocate 1468 bytes")  # fmt: skip
    assert ranks.bad_input(host) and ranks.said(host).endswith(f"({ranks.OOM_HINT})")
    assert not ranks.bad_input(RuntimeError("CUDA error: an illegal memory access"))
    monkeypatch.setattr("recsz.train.train_step", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli_main(["train", "--steps", "2", "--no-progress"])


def test_a_collectives_timeout_is_said_with_the_option_that_sets_it() -> None:
    """gloo's timeout (a peer stopped: SIGSTOP, a debugger, a hung call) and NCCL's
    watchdog name neither ``--dist-timeout`` nor the peer's part: said after them. Not bad
    input (a stuck peer need not be stuck again); other messages unchanged."""
    gloo = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
                        "20000ms for send operation to complete")  # fmt: skip
    nccl = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL("
                        "SeqNum=5, OpType=ALLTOALL_BASE) ran for 120000 milliseconds before "
                        "timing out.")  # fmt: skip
    for e in (gloo, nccl):
        assert ranks.said(e) == f"{e} ({ranks.TIMEOUT_HINT})"
        assert not ranks.bad_input(e)
    lost = RuntimeError("Connection reset by peer")
    assert ranks.said(lost) == "Connection reset by peer"


def test_the_launchers_line_names_the_kind_of_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each launched rank that fails on bad input notes its kind beside its line (out of
    memory, no room on disk, bad input), and the launcher's one line names the kinds, each
    message once with its ranks: "recsz: out of memory and bad input: ..." where it said
    "bad input" for all."""
    monkeypatch.delenv("RECSZ_TRACEBACK", raising=False)
    monkeypatch.setenv(ranks.FAILURES, str(tmp_path / "failures"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    full = OSError("cannot write /x: no space left on device")
    full.errno = 28
    raised = [torch.OutOfMemoryError("CUDA out of memory"), ValueError("bad flag"), full,
              torch.OutOfMemoryError("CUDA out of memory")]  # fmt: skip
    for rank, e in enumerate(raised):
        monkeypatch.setenv("RANK", str(rank))

        def body(e: Exception = e) -> int:
            raise e

        assert ranks.worker(body, as_main=False) == ranks.BAD_INPUT
    assert capsys.readouterr().err == ""  # (the launcher says it)
    kinds, said = launcher.noted(tmp_path / "failures") or ("", "")
    assert kinds == "out of memory, bad input and no room on disk"
    assert said == (f"ranks 0, 3: OutOfMemoryError: CUDA out of memory ({ranks.OOM_HINT}); "
                    "rank 1: ValueError: bad flag; rank 2: OSError: cannot write /x: no space "
                    "left on device")  # fmt: skip
    assert launcher.noted(tmp_path / "none") is None
    assert [ranks.failure_kind(e) for e in raised] == [
        "out of memory", "bad input", "no room on disk", "out of memory"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "missing", "said"),
    [
        (
            ["train", "--fwd-codec", "sz3", "--nproc", "2"],
            "pysz",
            "codec 'sz3' needs the optional package 'pysz': pip install pysz",
        ),
        (["train", "--bwd-codec", "zfp"], "zfpy", "codec 'zfp' needs the optional package"),
        (
            ["train", "--fwd-codec", "tr-fp8"],
            "fbgemm_gpu.quantize_comm",
            "codec 'tr-fp8' needs fbgemm: pip install --no-deps fbgemm-gpu-cpu==1.8.0",
        ),
        (["train", "--dp-comm", "eb", "--dp-codec", "sz3", "--nproc", "2"], "pysz", "'pysz'"),
        (["export", "run", "--out", "m.pt"], "torchrec", "needs TorchRec: pip install torchrec"),
    ],
)
def test_a_missing_optional_library_is_named_before_any_rank_starts(
    argv: list[str], missing: str, said: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Where an option needs a library that is not installed, the command says which and
    how to install it, exit 2, before a rank starts (a launched rank's ImportError would be
    restarted in vain); not a traceback from inside a codec at the first step."""
    monkeypatch.delenv("RECSZ_TRACEBACK", raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    launched: list[object] = []
    monkeypatch.setattr("recsz.train.launch", lambda *a, **kw: launched.append(a) or 0)
    assert cli_main([*argv, "--no-progress"] if argv[0] == "train" else argv) == 2
    err = capsys.readouterr().err
    assert f"recsz {argv[0]}: error: " in err and said in err, err
    assert "Traceback" not in err and not launched
    assert ranks.bad_input(ImportError(said))  # a launched rank's: not restarted


def test_recsz_warnings_are_said_as_its_lines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command's warnings of recsz's own (an absolute bound wider than the data) are one
    line, `recsz: warning: ...` (a rank of several: `recsz: warning: rank R: ...`), not
    Python's with the file, line and source line; others' (torch's) as Python says them."""
    import warnings

    from recsz.console import plain_warnings

    python: list[tuple] = []  # Python's own way (here a recorder)
    monkeypatch.setattr(warnings, "showwarning", lambda *a: python.append(a))
    plain_warnings()
    warnings.showwarning(UserWarning("bound 1e+30 is wide"), UserWarning,
                         os.path.join("x", "recsz", "policy", "base.py"), 199)  # fmt: skip
    warnings.showwarning(UserWarning("deprecated"), UserWarning, "/x/torch/nn.py", 7,
                         line="    call()")  # fmt: skip
    assert capsys.readouterr().err == "recsz: warning: bound 1e+30 is wide\n"
    assert [a[2:4] for a in python] == [("/x/torch/nn.py", 7)]
    # a rank of several names itself (each says its own tables' warnings)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    plain_warnings()
    warnings.showwarning(UserWarning("bound 1e+30 is wide"), UserWarning,
                         os.path.join("x", "recsz", "policy", "base.py"), 199)  # fmt: skip
    assert capsys.readouterr().err == "recsz: warning: rank 1: bound 1e+30 is wide\n"


def test_version_names_the_package_and_what_it_runs_on(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    import torch

    import recsz

    assert cli_main(["--version"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"recsz {recsz.__version__} (Python ")
    assert recsz.__version__ == version("recsz")  # the package's metadata, from one place
    assert f"torch {torch.__version__}" in said and "torchrec " in said


def test_launch_leaves_the_rank_count_to_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    class Agent:
        def __init__(self, cmd: list[str], **kw: object) -> None:
            seen.append(cmd)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", Agent)
    argv = ["--nproc", "2", "--steps", "3", "--nproc=2", "--out", "--nproc-x"]
    assert launcher.launch(2, argv) == 0
    cmd = seen[0]
    assert "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("recsz.train") + 1 :] == ["--steps", "3", "--out", "--nproc-x"]


def test_plot_writes_pngs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (
        cli_main(
            [
                "train",
                "--steps",
                "6",
                "--batch-size",
                "64",
                "--log-every",
                "2",
                "--eval-every",
                "4",
                "--synthetic-eval",
                "512",
                "--no-progress",
                "--fwd-codec",
                "hybrid",
                "--bwd-codec",
                "hybrid",
                "--eb-policy",
                "dual",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    assert cli_main(["plot", str(run)]) == 0
    for name in ("training.png", "tables_fwd.png", "tables_bwd.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG"


def test_plot_compares_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Several runs: one PNG of their curves (by step and by training time) and a table of
    their final numbers and the options in which they differ; a run without a summary (under
    way, or cut short) from its log, said unfinished; runs of one name by their paths."""
    base = ["train", "--steps", "6", "--batch-size", "64", "--log-every", "2", "--eval-every",
            "4", "--synthetic-eval", "512", "--no-progress"]  # fmt: skip
    runs = [tmp_path / "a" / "run", tmp_path / "b" / "run"]
    assert cli_main([*base, "--out", str(runs[0])]) == 0
    assert cli_main([*base, "--fwd-codec", "hybrid", "--lr", "0.05", "--out", str(runs[1])]) == 0
    (runs[1] / "summary.json").unlink()
    capsys.readouterr()
    assert cli_main(["plot", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    said = capsys.readouterr().out
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert table in said
    first, second = table.splitlines()[2:]
    assert first.startswith(f"| {runs[0]} | 6 | 0.") and second.startswith(f"| {runs[1]} | 6 (unf")
    assert first.endswith("| fwd_codec=none, lr=default |")
    assert second.endswith("| fwd_codec=hybrid, lr=0.05 |")
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert f"| {summary['auc']:.4f} | {summary['logloss']:.4f} |" in first
    # --target: each run's training seconds to an AUC (the first evaluation's own where it
    # reaches it: none is below), or that it did not
    rows = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    at_4 = next(r for r in rows if r["step"] == 4 and "eval_auc" in r)
    target = at_4["eval_auc"]
    cmp = ["plot", *map(str, runs), "--out", str(tmp_path / "cmp"), "--target"]
    assert cli_main([*cmp, str(target)]) == 0
    first = (tmp_path / "cmp" / "compare.md").read_text().splitlines()[2]
    assert f"| {summary['logloss']:.4f} | {at_4['train_s']:.2f} | " in first
    assert cli_main([*cmp, "0.9999"]) == 0
    assert "| not reached |" in (tmp_path / "cmp" / "compare.md").read_text()
    with pytest.raises(SystemExit) as refused:
        cli_main(["plot", str(runs[0]), "--target", "0.7"])
    assert refused.value.code == 2 and "--target compares runs" in capsys.readouterr().err
    assert cli_main(["plot", str(runs[0]), str(tmp_path), "--out", str(tmp_path / "cmp")]) == 2
    assert f"{tmp_path}: no metrics.jsonl (is this a run directory?)" in capsys.readouterr().err


def test_preprocess_cli(tmp_path: Path, criteo_ragged: Path) -> None:
    out = tmp_path / "bin"
    assert cli_main(["preprocess", str(criteo_ragged), str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["rows"] == 1000 and meta["padded_lines"] == 498
    run = tmp_path / "run"
    assert (
        cli_main(["train", "--data", str(out), "--steps", "5", "--no-progress", "--out", str(run)])
        == 0
    )
    assert json.loads((run / "summary.json").read_text())["eval_samples"] == 200


class _Log(io.StringIO):
    """A stream no terminal reads (a scheduler's log file)."""

    def isatty(self) -> bool:
        return False


def test_a_bar_written_to_a_file_is_a_line_each_line_s_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progress where no terminal reads it: tqdm's meter as whole lines (no redraws piling
    up on one line), none sooner than console.LINE_S after the last, the total at the end;
    what ends sooner says nothing; on a terminal, tqdm's bar; not shown: nothing."""
    from recsz import console

    monkeypatch.setattr(console, "LINE_S", 0.05)
    log = _Log()
    with console.bar(True, log, total=12, desc="preprocess", unit="B") as bar:
        for _ in range(12):
            time.sleep(0.02)  # 0.24 s in all: a line at the third update at the latest
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    assert 2 <= len(lines) <= 7, lines  # each >= 0.05 s (3 updates) after the last, the end
    assert all(line.startswith("preprocess: ") for line in lines)
    assert "12/12" in lines[-1] and "12/12" not in lines[0]
    monkeypatch.setattr(console, "LINE_S", 30.0)
    short = _Log()
    with console.bar(True, short, total=2, desc="evaluate", leave=False) as bar:
        bar.update(2)  # less than LINE_S
    assert short.getvalue() == ""
    term = _Log()
    term.isatty = lambda: True  # type: ignore[method-assign]
    with console.bar(True, term, total=2, desc="x") as bar:
        bar.update(2)
    assert "\r" in term.getvalue()
    hidden = _Log()
    with console.bar(False, hidden, total=2) as bar:
        bar.update(2)
    assert hidden.getvalue() == ""


def test_preprocess_and_evaluate_in_a_log_say_lines(
    tmp_path: Path, criteo_ragged: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`recsz preprocess` and a standalone `recsz evaluate` written to a file (here captured)
    say their progress as lines (a line a redraw, console.LINE_S 0 here), not a bar's
    redraws on one line; evaluate's --no-progress says none."""
    from recsz import console

    monkeypatch.setattr(console, "LINE_S", 0.0)
    assert cli_main(["preprocess", str(criteo_ragged), str(tmp_path / "bin")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"^preprocess: .*B/s\]$", err, re.M), err
    run = tmp_path / "run"
    flags = ["--steps", "2", "--synthetic-eval", "512", "--eval-batch-size", "64",
             "--checkpoint-every", "2"]  # fmt: skip
    assert cli_main(["train", *flags, "--out", str(run)]) == 0
    capsys.readouterr()
    assert cli_main(["evaluate", str(run)]) == 0  # (--progress: the run's)
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].startswith("evaluate: 512 samples"), err
    assert cli_main(["evaluate", str(run), "--no-progress"]) == 0
    assert "evaluate:" not in capsys.readouterr().err


def test_bench_codecs_quick(tmp_path: Path) -> None:
    bench_codecs = _bench("bench_codecs")
    out = tmp_path / "codecs.json"
    assert (
        bench_codecs.main(["--quick", "--codecs", "hybrid,none,fp16", "--json-out", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    need = {"codec", "data", "eb", "eb_mode", "ratio", "encode_MBps", "decode_MBps", "max_abs_err"}
    assert rows and all(need <= set(r) for r in rows)
    for r in rows:
        if r["codec"] == "hybrid":
            assert r["max_err_over_eb"] <= 1.0 and r["ratio"] > 5


def test_bench_data_times_each_source_and_the_trainer(tmp_path: Path) -> None:
    bench_data = _bench("bench_data")
    out = tmp_path / "data.json"
    argv = [
        "--batches",
        "256",
        "--steps",
        "3",
        "--train-steps",
        "2",
        "--parse-copies",
        "1",
        "--order-rows",
        "3000",
        "--worlds",
        "1,4",
        "--json-out",
        str(out),
    ]
    assert bench_data.main(argv) == 0
    rows = json.loads(out.read_text())
    made = {(r["part"], r["source"], r["way"]) for r in rows}
    assert ("making", "synthetic, kept", "thread") in made
    assert ("making", "synthetic, hashed", "loop") in made
    assert {("order", "rows"), ("order", "batches")} <= {(p, w) for p, _, w in made}
    assert {s for p, s, _ in made if p == "order"} == {
        f"{kind}, 2,400 rows"
        for kind in ("recsz preprocess", "TorchRec .npy days", "MLPerf .npz days")
    }
    for src in ("synthetic", "file, rows"):
        assert {("ranks", f"{src}, 4 ranks", w) for w in ("whole", "part")} <= made
    if (ROOT.parent / "shared" / "data").exists():
        parsed = {w for p, _, w in made if p == "parse"}
        from recsz.data.criteo import parse_threads

        many = parse_threads()  # one core: 1 thread timed once
        assert {"compiled, 1 thread", "parse_line"} <= parsed and len(parsed) == 2 + (many > 1)
    trained = [r for r in rows if r["part"] == "trainer"]
    assert len(trained) == 2 and trained[0]["auc"] == trained[1]["auc"]  # the same batches
    assert all(r["samples_per_s"] > 0 for r in rows)


def test_bench_accuracy_hook_sweep_plans_every_setting() -> None:
    """--hooks --sweep: each swept hook once per setting, with its flag and value, every
    other hook at its default, and the uncompressed run first for each seed; every run's
    flags parse as a training configuration."""
    from recsz.config import parse_train_args

    bench = _bench("bench_accuracy")
    runs = bench.plan_hooks(synthetic=True, sweep=True)
    by_seed = {seed: [r for r in runs if r.seed == seed] for seed in (0, 1, 2)}
    for seed_runs in by_seed.values():
        assert seed_runs[0].policy == "none"
        names = [r.direction for r in seed_runs[1:]]
        for mode, (flag, values) in bench.SWEEP.items():
            assert f"dp-{mode}" not in names
            for v in values:
                run = seed_runs[1 + names.index(f"dp-{mode}@{v}")]
                assert run.flags[run.flags.index(flag) + 1] == v
        assert {"dp-allreduce", "dp-fp16", "dp-bf16"} <= set(names)
    for r in runs:
        parse_train_args(list(r.flags))


def test_bench_gpu_dry_run_on_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's own logic, run on the CPU (the CPU coder), tiny."""
    bench_gpu = _bench("bench_gpu")
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--quick", "--batch", "128", "--json-out", str(out)]
    assert bench_gpu.main(argv) == 0
    result = json.loads(out.read_text())
    hybrid = next(r for r in result["codecs"] if r["codec"] == "hybrid")
    for key in ["device", "codec", "data", "batch", "encode_gbps", "decode_gbps", "ratio",
                "max_err_over_eb", "syncs_per_step", "break_even_gbit"]:  # fmt: skip
        assert key in hybrid, key
    assert hybrid["ratio"] > 5 and hybrid["same_bytes_as_cpu_reference"]
    assert 0 < hybrid["max_err_over_eb"] <= 1
    assert [r["config"] for r in result["train"]] == bench_gpu.TRAIN_CONFIGS
    assert all("step_ratio" in r and "gpu_busy" in r for r in result["train"])


def test_bench_checkpoint_tiny(tmp_path: Path) -> None:
    """Checkpoints' cost to the loop, both ways (tiny): rows, and the way at once took no
    thread."""
    bench = _bench("bench_checkpoint")
    out = tmp_path / "ck.json"
    argv = ["--preset", "tiny", "--steps", "2", "--every", "2", "--batch-size", "32"]
    assert bench.main([*argv, "--repeats", "1", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["way"] for r in rows] == list(bench.WAYS)
    assert all(r["checkpoints"] == 1 and r["file_gb"] > 0 and r["stall_s"] > 0 for r in rows)


def test_gpu_train_records_each_run_as_it_ends(tmp_path: Path) -> None:
    """The GPU check's trainer runs (tiny, on the CPU): a summary, an error or a skip a
    line, in the issues' order; a restarted process runs only what the log lacks."""
    gpu_train = _bench("gpu_train")
    names = [n for n, _ in gpu_train.runs()]
    assert names[:4] == ["none_fixed", "hybrid_fixed", "none_fixed_graph", "hybrid_fixed_graph"]
    only = ["--only", "hybrid_fixed,none_fixed_graph", "--dry", "--runs", str(tmp_path / "runs")]
    assert gpu_train.main([str(tmp_path), *only]) == 0
    log = tmp_path / "train.jsonl"
    assert (tmp_path / "runs" / "hybrid_fixed" / "summary.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "train.jsonl"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["hybrid_fixed", "none_fixed_graph"]
    assert rows[0]["summary"]["samples_per_s_steady"] > 0 and "per_table" not in rows[0]["summary"]
    assert "--cuda-graph" in rows[1]["error"]  # (a GPU's alone)
    assert rows[0]["profile"]["steps"] == 1  # profiled (--profile): its stages in the table
    assert "profile: wall" in gpu_train.table(log) and "profile" not in rows[1]
    late = ["--only", "hybrid_fixed,none,hybrid", "--dry", "--deadline", "0"]
    assert gpu_train.main([str(tmp_path), *late]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["name"] for r in rows[2:]] == ["none", "hybrid"]  # hybrid_fixed: done
    assert all("budget" in r["skipped"] for r in rows[2:])
    with pytest.raises(SystemExit):
        gpu_train.main([str(tmp_path), "--only", "nonesuch"])


def test_gpu_check_ends_within_its_budget_in_few_files(tmp_path: Path) -> None:
    """gpu_check.sh on the CPU (every run refused: no GPU): the device's limits hold, the
    whole check within BUDGET and at most 8 files back; a part the budget leaves out says so."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    out = tmp_path / "out"
    for budget, parts in [("60", "train"), ("25", "tests")]:
        env.update(BUDGET=budget, PARTS=parts)
        t0 = time.monotonic()
        subprocess.run(["bash", script, str(out)], cwd=ROOT, env=env, check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        assert time.monotonic() - t0 < int(budget) + 30  # (the end: the table, ~5 s)
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= 8, files
    env_txt = (out / "env.txt").read_text()
    assert "part train: rc 0" in env_txt and "part tests: skipped" in env_txt
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == len(_bench("gpu_train").runs())
    assert "no CUDA device" in rows[0]["error"]  # (a loaded machine may skip the last)
    assert all("no CUDA device" in r.get("error", "") or "budget" in r.get("skipped", "")
               for r in rows)  # fmt: skip
    assert rows[0]["name"] in (out / "train.log").read_text()  # the runs side by side


def test_bench_train_runs_torchrec_dmp_anchor(tmp_path: Path) -> None:
    """TorchRec's own DMP beside ours, same preset, data and steps (needs `make anchors`)."""
    bench_train = _bench("bench_train")
    if not bench_train.torchrec_available():
        pytest.skip("TorchRec not installed (make anchors)")
    out = tmp_path / "dmp.json"
    argv = ["--rates", "unshaped", "--worlds", "2", "--steps", "3", "--preset", "tiny"]
    argv += ["--batch-size", "256", "--configs", "trdmp-bf16", "--json-out", str(out)]
    assert bench_train.main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert rows["trdmp-bf16"]["samples_per_s"] > 0
    assert 0.0 < rows["trdmp-bf16"]["auc"] < 1.0
    assert rows["trdmp-bf16"]["fwd_ratio"] == 2.0


def test_bench_train_tiny(tmp_path: Path) -> None:
    """The end-to-end benchmark in miniature: unshaped, 2 ranks, 3 steps, two configs."""
    bench_train = _bench("bench_train")
    out = tmp_path / "train.json"
    assert (
        bench_train.main(
            [
                "--rates",
                "unshaped",
                "--worlds",
                "2",
                "--steps",
                "3",
                "--configs",
                "none,hybrid-dual+ids",
                "--preset",
                "tiny",
                "--batch-size",
                "256",
                "--json-out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    need = {
        "rate",
        "config",
        "world_size",
        "samples_per_s",
        "speedup",
        "auc",
        "auc_delta",
        "bytes_sent",
        "fwd_ratio",
        "bwd_ratio",
    }
    assert [r["config"] for r in rows] == ["none", "hybrid-dual+ids"]
    assert all(need <= set(r) for r in rows)
    assert rows[0]["speedup"] == 1.0 and rows[1]["bytes_sent"] < rows[0]["bytes_sent"] / 5
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "| unshaped | 2 | none |" in out.with_suffix(".md").read_text()


def test_bench_accuracy_a2a_plans_each_setting_with_eb() -> None:
    """--a2a: per seed the uncompressed run first, then every all-to-all setting once with
    the MLP gradients through eb; the scaled settings carry scaled class bounds; every
    run's flags parse as a training configuration."""
    from recsz.config import TrainConfig, parse_train_args

    bench = _bench("bench_accuracy")
    runs = bench.plan_a2a(synthetic=True, seeds=2)
    assert len(runs) == 2 * (1 + len(bench.A2A))
    for seed in (0, 1):
        seed_runs = [r for r in runs if r.seed == seed]
        assert seed_runs[0].policy == "none" and "--fwd-codec" not in seed_runs[0].flags
        assert [r.policy for r in seed_runs[1:]] == list(bench.A2A)
    for r in runs:
        cfg = parse_train_args(list(r.flags))
        assert cfg.dp_comm == ("allreduce" if r.policy == "none" else "eb")
        if r.policy == "dual/10":
            assert cfg.fwd_class_eb == cfg.bwd_class_eb == "0.001,0.003,0.005"
        if r.policy == "dual/3":  # the README calls this row the trainer's default
            default = TrainConfig()
            assert cfg.fwd_class_eb == default.fwd_class_eb
            assert cfg.bwd_class_eb == default.bwd_class_eb
        if r.policy == "dual-fwd":
            assert cfg.fwd_codec == "hybrid" and cfg.bwd_codec == "none"
        if r.policy == "dual/3+bwd/10":  # (the sequence sharder's gradients' default)
            assert cfg.fwd_class_eb == TrainConfig().fwd_class_eb
            assert cfg.bwd_class_eb == "0.000333,0.001,0.00167"


def test_bench_sequence_pairs_seeds_and_counts_torchrecs_bytes() -> None:
    """bench_sequence's summary over seeds: each config against stock-fp32 on the same seed
    (a seed stock lacks is left out); a row's bytes in TorchRec's comm precisions."""
    bench = _bench("bench_sequence")

    def row(config: str, seed: int, auc: float, loss: float) -> dict:
        return {"rate": "unshaped", "config": config, "seed": seed, "eval_auc": auc,
                "eval_logloss": loss}  # fmt: skip

    rows = [row("stock-fp32", 0, 0.90, 0.30), row("stock-fp32", 1, 0.80, 0.40),
            row("recsz", 0, 0.91, 0.32), row("recsz", 1, 0.78, 0.40),
            row("recsz", 2, 0.50, 0.90)]  # fmt: skip
    table = bench._by_seed(rows)
    assert "| unshaped | recsz | 3 | 0.7300 | -0.0050 (-0.0200..+0.0100) | 0.5400 " in table
    assert "| +0.0100 (+0.0000..+0.0200) |" in table
    assert "| unshaped | stock-fp32 | 2 | 0.8500 | +0.0000 (+0.0000..+0.0000) |" in table
    assert [bench._row_bytes(p, 64) for p in ("fp32", "bf16", "int8", "mx4")] == [256, 128, 72, 34]


def test_bench_accuracy_pairs_runs_by_seed(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary's differences are per seed (paired), against the uncompressed run of the
    same seed and, for --versus, between two settings; seeds one side lacks are left out."""
    bench = _bench("bench_accuracy")

    def res(direction: str, policy: str, seed: int, auc: float):  # type: ignore[no-untyped-def]
        return bench.Result("syn", policy, direction, seed, auc, 0.0, 0.0, None, None, 0.0)

    results = [
        *(res("-", "none", s, a) for s, a in [(0, 0.80), (1, 0.70), (2, 0.60)]),
        *(res("dp-eb@0.03", "dual", s, a) for s, a in [(0, 0.81), (1, 0.72), (2, 0.63)]),
        *(res("dp-powersgd@1", "dual", s, a) for s, a in [(0, 0.80), (1, 0.70)]),
    ]
    bench.print_paired(results, [("dp-eb@0.03", "dp-powersgd@1")])
    out = capsys.readouterr().out
    assert "| dual dp-eb@0.03 | syn | 3 | +0.0200 | 0.0100 | 0.0058 |" in out
    assert "| dual dp-powersgd@1 | syn | 2 | +0.0000 | 0.0000 | 0.0000 |" in out
    assert "| dual dp-eb@0.03 - dual dp-powersgd@1 | syn | 2 | +0.0150 | 0.0071 | 0.0050 |" in out
    # --a2a settings differ in the policy column (the direction is dp-eb for all)
    a2a = [
        *(res("-", "none", s, a) for s, a in [(0, 0.80), (1, 0.70)]),
        *(res("dp-eb", "dual/3", s, a) for s, a in [(0, 0.81), (1, 0.72)]),
        *(res("dp-eb", "dual/3+amp", s, a) for s, a in [(0, 0.80), (1, 0.70)]),
    ]
    bench.print_paired(a2a, [("dual/3+amp", "dual/3")])
    out = capsys.readouterr().out
    assert "| dual/3+amp dp-eb - dual/3 dp-eb | syn | 2 | -0.0150 | 0.0071 | 0.0050 |" in out


def test_bench_accuracy_refuses_a_pair_it_will_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    """--versus names settings --only left out: refused before any run, not an empty table
    hours later."""
    bench = _bench("bench_accuracy")
    argv = ["--hooks", "--synthetic", "--sweep", "--only", "dp-eb@0.03"]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--versus", "dp-eb@0.03:dp-powersgd@1"])
    assert "want A:B pairs of planned settings" in capsys.readouterr().err


def test_bench_syncs_counts_a_step_in_this_process_and_between_ranks(tmp_path: Path) -> None:
    """World size 1 (no process group), ``none`` both ways: nothing back, by either
    traffic (a lone rank without a codec sends no distinct ids: the same step; the counts
    tests/test_host_syncs.py asserts, as the table). Two ranks, hybrid both ways: the
    payloads' sizes once a direction, the checks' verdicts riding on those reads, and no
    format-3 plan made once the shapes are known."""
    bench = _bench("bench_syncs")
    out = tmp_path / "syncs.json"
    cases = "none, fixed-size;none, id-aware"
    before = dict(os.environ)
    assert bench.main(["--worlds", "1", "--cases", cases, "--json-out", str(out), "--quick"]) == 0
    assert dict(os.environ) == before  # the GPU's path was the benchmark's alone
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    fixed, ids = rows["none, fixed-size"], rows["none, id-aware"]
    assert fixed["reads_per_step"] == ids["reads_per_step"] == 0
    assert 0 < fixed["launches_per_step"] == ids["launches_per_step"]
    assert (
        f"| none, id-aware | 0 / {ids['launches_per_step']:g} / 0 |"
        in out.with_suffix(".md").read_text()
    )
    argv = ["--worlds", "2", "--cases", "hybrid, fixed-size", "--json-out", str(out), "--quick"]
    assert bench.main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert row["reads_per_step"] == 2, row["where_rank0"]
    assert row["plans_per_step"] == 0  # received buffers' places change, their layouts not
    assert row["where_rank0"].count("read_sizes") == 1  # 2 x, at one site


@pytest.mark.filterwarnings("ignore::FutureWarning")  # TorchRec's planner on its own defaults
@pytest.mark.filterwarnings("ignore::UserWarning")  # and on a topology built directly
def test_bench_draws_trains_ours_as_torchrecs_from_its_weights(tmp_path: Path) -> None:
    """bench_draws.py in miniature: from TorchRec's draw, our model ends where TorchRec's
    DLRM does (fbgemm's fused row-wise Adagrad beside ours); every run is in the table."""
    bench_draws = _bench("bench_draws")
    pytest.importorskip("torchrec")
    out = tmp_path / "draws.json"
    argv = ["--preset", "tiny", "--multi-hot", "2", "--draws", "1", "--steps", "3"]
    argv += ["--batch-size", "256", "--eval-samples", "2048", "--json-out", str(out)]
    assert bench_draws.main(argv) == 0
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"torchrec", "ours, torchrec's weights", "ours, torch init",
                         "ours, dlrm init"}  # fmt: skip
    same, theirs = rows["ours, torchrec's weights"], rows["torchrec"]
    assert abs(same["loss"] - theirs["loss"]) < 1e-4
    assert abs(same["auc"] - theirs["auc"]) < 1e-3
    assert rows["ours, dlrm init"]["loss"] != theirs["loss"]
    assert "| ours, torch init |" in out.with_suffix(".md").read_text()


def test_bench_tabledtype_quick_runs_each_variant_and_restores_the_rounding(
    tmp_path: Path,
) -> None:
    from recsz.model import rowopt

    stochastic = rowopt.round_stochastic
    out = tmp_path / "tabledtype.json"
    assert (
        _bench("bench_tabledtype").main(
            ["--quick", "--variants", "fp32,fp16-rne", "--json-out", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert {r["variant"] for r in rows} == {"fp32", "fp16-rne"}
    mb = {r["variant"]: r["embedding_mb"] for r in rows if r["data"] == "pace"}
    assert mb["fp16-rne"] == pytest.approx(mb["fp32"] / 2)
    assert rowopt.round_stochastic is stochastic


def test_bench_init_starts_tables_near_their_own_bytes(tmp_path: Path) -> None:
    """bench_init.py in miniature: each case in its own process, this checkout's recsz,
    a shard holding a quarter of the rows' bytes; the table is written."""
    out = tmp_path / "init.json"
    argv = ["--rows", "20000", "--dim", "16", "--json-out", str(out)]
    assert _bench("bench_init").main(argv) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"whole, fp32", "whole, fp16", "1 shard of 4, fp32"}
    whole = rows["whole, fp32"]["held_gb"]
    assert rows["1 shard of 4, fp32"]["held_gb"] == pytest.approx(whole / 4)
    assert all(r["recsz"].startswith(str(ROOT / "src")) for r in rows.values())
    assert "| whole, fp16 |" in out.with_suffix(".md").read_text()


def test_bench_mlpinit_trains_both_starts_and_pairs_them_by_seed(tmp_path: Path) -> None:
    """bench_mlpinit.py in miniature: each (shape, start, seed) trained, its tables counted;
    the table pairs the starts seed by seed."""
    out = tmp_path / "mlpinit.json"
    argv = ["--shapes", "criteo,30x50", "--seeds", "1", "--steps", "2", "--preset", "tiny",
            "--json-out", str(out)]  # fmt: skip
    bench = _bench("bench_mlpinit")
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    got = [(r["shape"], r["tables"], r["init"]) for r in rows]
    assert got == [(s, n, i) for s, n in (("criteo", 26), ("30x50", 30)) for i in ("dlrm", "torch")]
    made = [{"shape": "s", "init": i, "seed": k, "auc": a}
            for k, (d, t) in enumerate([(0.70, 0.75), (0.72, 0.71), (0.70, 0.74)])
            for i, a in (("dlrm", d), ("torch", t))]  # fmt: skip
    assert "| s | 0.7067 | 0.7333 | +0.0267 | 2 of 3 |" in bench.table(made)


def test_bench_patience_keeps_the_best_checkpoint_it_reports(tmp_path: Path) -> None:
    """bench_patience.py in miniature, on the real sample: each way's best checkpoint
    scored again gives the AUC its evaluation logged; the patience run trains no more."""
    data = ROOT.parent / "shared" / "data" / "criteo_kaggle_head10k.tsv"
    if not data.exists():
        pytest.skip("the real Criteo sample (../shared/data) is not here")
    out = tmp_path / "patience.json"
    argv = ["--data", str(data), "--steps", "20", "--eval-every", "10", "--patience", "1",
            "--seeds", "1", "--json-out", str(out)]  # fmt: skip
    assert _bench("bench_patience").main(argv) == 0
    full, early = json.loads(out.read_text())
    assert (full["way"], early["way"]) == ("full", "patience") and full["steps"] == 20
    assert early["steps"] <= 20 and early["best_step"] <= early["steps"]
    for r in (full, early):
        assert r["best_reevaluated"] == pytest.approx(r["best_auc"], abs=1e-6)


def test_bench_columns_plans_spread_the_large_tables(tmp_path: Path) -> None:
    """The plan part alone (arithmetic): at 64 ranks, 4 column shards leave no rank idle
    and hold a quarter of the whole tables' most a rank; the table is written."""
    out = tmp_path / "columns.json"
    argv = ["--no-pace", "--presets", "dcnv2", "--worlds", "64", "--shards", "1,4"]
    assert _bench("bench_columns").main([*argv, "--json-out", str(out)]) == 0
    rows = {r["shards"]: r for r in json.loads(out.read_text())}
    assert rows[1]["idle_ranks"] > 0 and rows[4]["idle_ranks"] == 0
    assert rows[4]["max_gb"] == pytest.approx(rows[1]["max_gb"] / 4)
    assert rows[4]["mean_gb"] == pytest.approx(rows[1]["mean_gb"])
    assert "| dcnv2 | 64 | 4 |" in out.with_suffix(".md").read_text()


def test_bench_eval_scores_a_raw_file_both_ways(tmp_path: Path, criteo_10k: Path) -> None:
    """Part (c) at a small size: `recsz evaluate --eval-data` and `recsz predict` of the
    same lines, each in a process of its own, timed with their peak memory, for the model
    asked for (``--raw-trained``: the flags of its training)."""
    out = tmp_path / "eval.json"
    argv = ["--sizes", "", "--worlds", "", "--raw-lines", "3000", "--repeats", "1",
            "--raw-trained", "--emb-optimizer sgd"]  # fmt: skip
    assert _bench("bench_eval").main([*argv, "--json-out", str(out)]) == 0
    rows = {(r["what"], r["trained"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {(w, "--emb-optimizer sgd") for w in ("evaluate", "predict")}
    assert all(r["lines"] == 3000 and r["new_peak_gb"] > 0 for r in rows.values())
    md = out.with_suffix(".md").read_text()
    assert "| `recsz predict` | `--emb-optimizer sgd` | 3,000 |" in md


def test_bench_warmstart_runs_each_day_and_exports(tmp_path: Path, criteo_ragged: Path) -> None:
    """bench_warmstart.py in miniature (the 1,000-row sample, one seed, large batches):
    every run in the table, the warm one started from yesterday's export (its first loss
    is not the cold one's)."""
    pytest.importorskip("torchrec")
    out = tmp_path / "warm.json"
    argv = ["--data", str(criteo_ragged), "--seeds", "0", "--batch-size", "100"]
    assert _bench("bench_warmstart").main([*argv, "--json-out", str(out)]) == 0
    rows = {r["run"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"yesterday", "cold", "warm", "both"}
    assert rows["warm"]["steps"] == rows["cold"]["steps"] == 3  # 300 rows, batches of 100
    assert rows["warm"]["auc"] != rows["cold"]["auc"]
    assert "warm - cold AUC per seed" in out.with_suffix(".md").read_text()


def test_bench_bags_draws_plans_and_looks_up_both_ways(tmp_path: Path) -> None:
    """bench_bags.py without its training runs: the draws' rate, dcnv2's plan by it (the
    rank of feature 20 holds its 40M x 99 draws), both lookups; the table is written."""
    out = tmp_path / "bags.json"
    assert _bench("bench_bags").main(["--quick", "--no-pace", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    plan = {r["world"]: r for r in rows if r["part"] == "plan"}
    assert plan[8]["max_held_gb"] == pytest.approx(40e6 * 99 * 4 / 1e9)
    assert plan[1]["max_held_gb"] == pytest.approx(plan[1]["total_gb"])
    looked = {r["draws"]: r for r in rows if r["part"] == "lookup"}
    assert looked["hash"]["draws_mb"] == 0 < looked["mlperf"]["draws_mb"]
    assert "| dcnv2 on W ranks |" in out.with_suffix(".md").read_text()


def test_bench_blockcpu_compares_the_coders_on_the_same_bytes(tmp_path: Path) -> None:
    """bench_blockcpu.py, tiny: each way within its bounds, the compiled coder's payloads
    the numpy reference's size (the same bytes), format 1 beside them."""
    out = tmp_path / "blockcpu.json"
    assert _bench("bench_blockcpu").main(["--quick", "--batch", "64", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["way"] for r in rows} == {"format 1 (hybrid)", "format 3 compiled",
                                        "format 3 numpy (before)"}  # fmt: skip
    assert all(r["max_err_over_eb"] <= 1.0 and r["ratio"] > 1 for r in rows)
    for rel in (0.01, 0.03):
        ratio = {r["way"]: r["ratio"] for r in rows if r["eb_rel"] == rel}
        assert ratio["format 3 compiled"] == ratio["format 3 numpy (before)"]


def test_bench_ids_times_both_sorts_on_the_same_answers(tmp_path: Path) -> None:
    out = tmp_path / "ids.json"
    assert _bench("bench_ids").main(["--batches", "64,300", "--repeats", "2",
                                      "--json-out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    real = (ROOT.parent / "shared" / "data").exists()
    assert len(rows) == 2 * (1 + real) and all(r["now_ms"] > 0 < r["distinct"] for r in rows)


def test_bench_load_restores_both_ways(tmp_path: Path) -> None:
    """bench_load.py in miniature (tiny, one repeat): a training run's checkpoint loaded into
    parts built for training and to score, each in a process of its own, timed with the
    memory it took."""
    out = tmp_path / "load.json"
    assert _bench("bench_load").main(["--repeats", "1", "--json-out", str(out)]) == 0
    rows = {r["way"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"train", "score"}
    assert all(r["new_s"] > 0 and r["new_hwm_gb"] > 0 and r["file_gb"] > 0 for r in rows.values())
    assert "| score | `(tiny)` (cpu) |" in out.with_suffix(".md").read_text()


def test_bench_stopping_times_the_agreement_and_a_preempted_job(tmp_path: Path) -> None:
    """bench_stopping.py in miniature (tiny, 50 agreements): the agreement's host time, and
    a 2-rank job sent SIGTERM stopping with its checkpoint, then going on from it; one whose
    rank 1 is stopped: rank 0's seconds from SIGTERM to its exit (STUCK_S or more). (The
    job stopped during an evaluation: tests/multiproc/test_preemption.py, the same steps.)"""
    out = tmp_path / "stopping.json"
    argv = ["--presets", "tiny", "--calls", "50", "--no-evaluating", "--json-out", str(out)]
    assert _bench("bench_stopping").main(argv) == 0
    agree, tiny, held = json.loads(out.read_text())
    assert agree["part"] == "agreement" and 0 < agree["median_us"] <= agree["p90_us"]
    assert tiny["preset"] == "tiny" and tiny["stopped_at_step"] >= 1
    assert tiny["stop_s"] > 0 and tiny["checkpoint_gb"] > 0 and tiny["go_on_s"] > 0
    assert held["part"] == "held" and held["stuck_s"] <= held["exit_s"]


@given(
    aucs=st.lists(st.floats(0.4, 0.9), min_size=1, max_size=8),
    gaps=st.lists(st.floats(0.01, 10.0), min_size=8, max_size=8),
    target=st.floats(0.4, 0.9),
)
def test_time_to_a_target_is_where_the_curve_crosses_it(
    aucs: list[float], gaps: list[float], target: float
) -> None:
    """The time to a target AUC (`recsz plot --target`, bench_tta.py): None where no
    evaluation reaches it; else within the seconds of the evaluations around the first that
    does, at that one's exactly where its AUC is the target or where none is below (the
    first evaluation)."""
    seconds = list(itertools.accumulate(gaps))[: len(aucs)]
    curve = [
        {"step": i, "train_s": t, "auc": a}
        for i, (t, a) in enumerate(zip(seconds, aucs, strict=True))
    ]
    got = time_to(curve, target)
    first = next((i for i, a in enumerate(aucs) if a >= target), None)
    if first is None:
        assert got is None
        return
    assert got is not None
    if first == 0 or aucs[first] == target:
        assert got == seconds[first]
    else:
        assert seconds[first - 1] <= got <= seconds[first]


def test_time_to_a_target_is_linear_between_evaluations() -> None:
    curve = [{"step": 10, "train_s": 10.0, "auc": 0.7}, {"step": 20, "train_s": 20.0, "auc": 0.9}]
    assert time_to(curve, 0.8) == pytest.approx(15.0)
    assert time_to(curve, 0.85) == pytest.approx(17.5)
    assert time_to(curve, 0.6) == 10.0 and time_to(curve, 0.95) is None


def test_bench_tta_stops_each_side_at_the_same_first_evaluation(tmp_path: Path) -> None:
    """Time to a target, ours and TorchRec's DMP (where installed) on equal terms: both
    evaluate every 2 steps and stop at the first evaluation reaching the target (here
    any: the first), each run's curve of training seconds and AUC kept."""
    bench_tta = _bench("bench_tta")
    configs = ["none", "none" + bench_tta.TORCH_INIT]
    if bench_tta.torchrec_available():
        configs.append("trdmp-bf16")
    out = tmp_path / "tta.json"
    argv = ["--rates", "unshaped", "--seeds", "0", "--target", "0.01", "--max-steps", "6"]
    argv += ["--eval-every", "2", "--eval-samples", "2048", "--preset", "tiny"]
    argv += ["--batch-size", "256", "--configs", ",".join(configs), "--json-out", str(out)]
    assert bench_tta.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == configs
    for r in rows:
        assert r["steps"] == 2 and [p["step"] for p in r["curve"]] == [2]
        assert r["time_to_target_s"] == r["curve"][0]["train_s"] > 0
        assert 0.0 < r["final_auc"] == r["curve"][0]["auc"] < 1.0
    assert "| unshaped | none |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_hosts_codes_the_same_bytes_between_hosts_either_scope(tmp_path: Path) -> None:
    """bench_hosts.py in miniature (two torchrun agents of 2 ranks): both scopes send about
    the same bytes between hosts (the runs part after the first step: the blocks within a
    host differ); coding only those, more bytes stay within the hosts."""
    out = tmp_path / "hosts.json"
    argv = ["--quick", "--configs", "hybrid-all,hybrid-between", "--json-out", str(out)]
    assert _bench("bench_hosts").main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    every, between = rows["hybrid-all"], rows["hybrid-between"]
    assert between["mb_between_hosts"] == pytest.approx(every["mb_between_hosts"], rel=0.05)
    assert between["mb_wire"] > every["mb_wire"] and every["fwd_ratio"] > between["fwd_ratio"]
