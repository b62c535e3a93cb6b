"""`recsz train` end to end in one process: files, keys, and the real-data AUC."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsz import checkpoint
from recsz.config import TrainConfig, parse_train_args
from recsz.evaluation import chosen
from recsz.train import main

REQUIRED = {
    "auc",
    "logloss",
    "accuracy",
    "ne",
    "calibration",
    "ctr",
    "steps",
    "samples_per_s",
    "samples_per_s_steady",
    "world_size",
    "fwd_ratio",
    "bwd_ratio",
    "bytes_sent",
    "a2a_fwd_s",
    "a2a_bwd_s",
    "codec_s",
    "data_s",
}


def test_main_writes_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = main(
        [
            "--steps",
            "12",
            "--batch-size",
            "64",
            "--log-every",
            "4",
            "--eval-every",
            "8",
            "--synthetic-eval",
            "1000",
            "--no-progress",
            "--fwd-codec",
            "hybrid",
            "--bwd-codec",
            "hybrid",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    cfg = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert cfg.fwd_codec == "hybrid" and cfg.steps == 12
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [4, 8, 12]
    assert any("eval_auc" in r for r in rows)
    s = json.loads((out / "summary.json").read_text())
    assert set(s) >= REQUIRED
    assert s["steps"] == 12 and s["world_size"] == 1 and 0.0 <= s["auc"] <= 1.0
    assert s["fwd_ratio"] > 2 and s["bwd_ratio"] > 2
    # samples/s counts training alone; generating the batches is timed apart
    assert s["data_s"] > 0 and s["train_s"] > 0
    assert s["samples_per_s"] == pytest.approx(12 * 64 / s["train_s"])
    # the pace after the first steps: 9 steps in less time than all 12 took
    assert s["samples_per_s_steady"] > 9 * 64 / s["train_s"]


def test_bad_flags_fail_loudly() -> None:
    with pytest.raises(ValueError, match="--fwd-codec 'gzip' is not one of"):
        main(["--fwd-codec", "gzip"])
    with pytest.raises(ValueError, match="batch-size"):
        main(["--batch-size", "0"])
    with pytest.raises(ValueError, match="not divisible by --nproc 2"):
        main(["--nproc", "2", "--batch-size", "33"])
    with pytest.raises(FileNotFoundError, match="no such file"):
        main(["--data", "/nonexistent/file.tsv", "--no-progress"])
    with pytest.raises(ValueError, match="--tt-cache-rows needs --tt-placement sharded"):
        main(["--tt-tables", "2", "--tt-placement", "replicated", "--tt-cache-rows", "4"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fwd-eb", "inf"], "--fwd-eb must be a finite number, got inf"),
        (["--dist-timeout", "nan"], "--dist-timeout must be a finite number"),
        (
            ["--eb-mode", "abs", "--bwd-eb", "1e300"],
            "--bwd-eb 1e\\+300 \\(--eb-mode abs\\) is outside",
        ),
        (["--eb-mode", "abs", "--fwd-class-eb", "1e-40,0.01,0.02"], "--fwd-class-eb tight 1e-40"),
        (["--fwd-class-eb", "0.1,0.2"], "--fwd-class-eb: expected three numbers"),
        (["--bwd-class-eb", "a,b,c"], "--bwd-class-eb: expected three numbers"),
        (["--fwd-class-eb", "0.01,-1,0.02"], "must be finite and > 0"),
        (["--fwd-class-eb", "0.01,inf,0.02"], "must be finite and > 0"),
        (["--fwd-class-eb", "0.05,0.01,0.02"], "tight <= base <= loose"),
        (["--fwd-eb", "10"], r"--fwd-eb 10 is not below 1: a relative bound is a fraction"),
        (["--bwd-class-eb", "0.1,0.5,1"], r"--bwd-class-eb loose 1 is not below 1"),
        (["--dp-eb", "2"], r"--dp-eb 2 is not below 1: .* each gradient bucket's range"),
        (["--synthetic-eval", "0"], "--synthetic-eval must be >= 1, got 0"),
        (["--hindex-probe-steps", "0"], "--hindex-probe-steps must be >= 1"),
        (["--hindex-every", "-1"], "--hindex-every must be >= 0"),
        (["--decay-c", "0.5"], "--decay-c must be >= 1"),
        (["--decay-t", "0"], "--decay-t must be >= 1"),
    ],
)
def test_values_that_mean_nothing_are_refused_before_any_rank_starts(
    flags: list[str], message: str
) -> None:
    """Each names its flag at parse time: an infinite bound, a relative one of the whole
    range or more (every value would go as about the same number), a class bound list that
    is not three ordered positive numbers (even where the policy would not read it), a
    window of no steps, an evaluation set of no samples."""
    with pytest.raises(ValueError, match=message):
        parse_train_args(["--fwd-codec", "hybrid", "--eb-policy", "dual", *flags])


def test_device_flag_is_checked() -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            TrainConfig(device="cuda")
    else:
        with pytest.raises(ValueError, match="dp-comm dct"):
            TrainConfig(device="cuda", dp_comm="dct")
    with pytest.raises(ValueError, match="--device 'tpu' is not one of: cpu, cuda"):
        TrainConfig(device="tpu")
    with pytest.raises(ValueError, match="--device 'tpu'"):
        main(["--device", "tpu"])


def test_tables_that_cannot_fit_are_refused_before_any_is_made(monkeypatch) -> None:
    """A host's ranks' tables are held to its memory (what they would hold: rows and the
    row optimizer's state, counted as the plan counts them), in the launcher before any
    rank starts, and in each rank before its tables are made (a torchrun job's ranks)."""
    from recsz import hostmemory
    from recsz.model import tt_parameters
    from recsz.ranks import Ranks
    from recsz.step import held_bytes, refuse_tables_that_cannot_fit, table_owners

    cfg = TrainConfig(preset="bench", nproc=2, emb_optimizer="rowwise_adagrad")
    owners = table_owners(cfg, 2)
    need = held_bytes(cfg, owners, 2)
    sizes = cfg.model().table_sizes
    assert sum(need) == sum(n * 64 * 4 + n * 4 for n in sizes)  # rows, and a float a row
    for r in (0, 1):
        assert need[r] == sum(sizes[t] * 260 for t, o in enumerate(owners) if o == r)
    tt_cfg = TrainConfig(preset="bench", tt_tables=3, emb_optimizer="rowwise_adagrad")
    spec = tt_cfg.tt_spec()
    assert spec is not None and len(spec.tables) == 3
    cores = sum(4 * tt_parameters(sizes[t], 64, spec.rank, spec.cores) for t in spec.tables)
    plain = sum(n * 260 for t, n in enumerate(sizes) if t not in spec.tables)
    assert sum(held_bytes(tt_cfg, table_owners(tt_cfg, 2), 2)) == plain + cores  # TT: cores
    # MLPerf's draws: a table's on the rank holding it, a replicated TT table's on every rank
    from recsz.model.multihot import draws_nbytes
    from recsz.step import rank_draws

    rep = TrainConfig(preset="bench", tt_tables=3, tt_placement="replicated",
                      multi_hot="mlperf", multi_hot_draws="mlperf")  # fmt: skip
    hot, everywhere = rep.hotness(), draws_nbytes(sizes, rep.hotness(), spec.tables)
    owned = table_owners(rep, 2)
    assert hot is not None and all(owned[t] == -1 for t in spec.tables)
    assert rank_draws(rep, owned, 2) == [
        everywhere + draws_nbytes(sizes, hot, [t for t, o in enumerate(owned) if o == r])
        for r in (0, 1)
    ]
    monkeypatch.setattr(hostmemory, "total", lambda: sum(need) - 1)  # a byte short
    made = []
    monkeypatch.setattr("recsz.step.SparseArch", lambda *a, **k: made.append(a))
    gb = f"{sum(need) / 1e9:.1f} GB"
    with pytest.raises(MemoryError, match=f"ranks 0-1 .* need {gb}, more than this host's"):
        main(["--preset", "bench", "--nproc", "2", "--steps", "1"])  # the launcher
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(MemoryError, match="--tt-tables K"):  # a rank of a torchrun job
        refuse_tables_that_cannot_fit(cfg, owners, Ranks(1, 2))
    # GPUs' rows are made on the GPU: the host holds none of them (each GPU is held to its
    # own memory, in a CUDA rank)
    with monkeypatch.context() as mp:
        mp.setattr("torch.cuda.is_available", lambda: True)
        on_gpus = dataclasses.replace(cfg, device="cuda")
    refuse_tables_that_cannot_fit(on_gpus, owners, Ranks(1, 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # alone on its host: it fits
    monkeypatch.setenv("LOCAL_RANK", "0")
    refuse_tables_that_cannot_fit(cfg, owners, Ranks(1, 2))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(MemoryError, match=f"rank 0's tables need {sum(need) / 1e9:.1f} GB"):
        main(["--preset", "bench", "--steps", "1"])  # one process: in the rank
    assert not made  # refused before any table was made


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_training_matches_cpu(tmp_path: Path) -> None:
    """The same run on the GPU and on the CPU, lossless codec: the same losses up to float
    rounding, and the compressed GPU run within the bound-driven AUC noise."""
    common = ["--steps", "20", "--preset", "tiny", "--no-progress", "--log-every", "5"]
    runs = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / dev
        assert (
            main(
                [
                    *common,
                    "--device",
                    dev,
                    "--fwd-codec",
                    "zstd",
                    "--bwd-codec",
                    "zstd",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        runs[dev] = json.loads((out / "summary.json").read_text())
    assert abs(runs["cpu"]["auc"] - runs["cuda"]["auc"]) < 2e-3
    out = tmp_path / "hybrid"
    args = [*common, "--device", "cuda", "--fwd-codec", "hybrid", "--bwd-codec", "hybrid"]
    assert main([*args, "--eb-policy", "dual", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["fwd_ratio"] > 5 and abs(s["auc"] - runs["cuda"]["auc"]) < 0.02


def test_a_diverging_run_stops_at_its_first_row(tmp_path: Path) -> None:
    """A NaN or infinite loss is not trained on silently: the first metrics row that sees it
    stops the run, naming the ranks and the step."""
    flags = ["--steps", "20", "--lr", "1e30", "--log-every", "5", "--no-progress"]
    with pytest.raises(FloatingPointError, match=r"not finite on rank\(s\) \[0\] by step 5"):
        main([*flags, "--out", str(tmp_path)])
    cmd = [sys.executable, "-m", "recsz.cli", "train", *flags]  # said as a bad flag is
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("recsz train: error: the loss is not")


def test_progress_written_to_a_file_is_a_line_a_row_not_a_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Progress where no terminal reads it (here captured; a scheduler's log file): no bar,
    whose redraws would pile up on one line, but a metrics row's line: the first, those of
    an evaluation and the last, the others at most one each console.LINE_S seconds (30: none
    in a 4-step run), each but the last with the time the pace leaves; --no-progress: none."""
    flags = ["--steps", "4", "--batch-size", "32", "--log-every", "1", "--eval-every", "2",
             "--synthetic-eval", "64"]  # fmt: skip
    main(flags)
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 1/4", "step 2/4", "step 4/4"]
    assert re.fullmatch(r"step 2/4  loss \d\.\d{4}  [\d,]+ samples/s  fwd [\d.]+x  bwd [\d.]+x  "
                        r"auc \d\.\d{4}  left \d\d:\d\d", lines[1]), lines  # fmt: skip
    assert "left" not in lines[-1]  # (the last step: none)
    assert "\r" not in err and "train:" not in err and "evaluate:" not in err
    main([*flags, "--no-progress"])
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]


def test_a_run_too_short_for_a_steady_pace_prints_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three steps are all warm-up: the summary keeps NaN, the printout says nothing of it."""
    main(["--steps", "3", "--no-progress", "--synthetic-eval", "64", "--out", str(tmp_path)])
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["samples_per_s_steady"] != s["samples_per_s_steady"]  # NaN
    out = capsys.readouterr().out
    assert "samples/s" in out and "nan" not in out and "after the first steps" not in out


def test_the_progress_bar_shows_the_last_loss_and_auc(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation's row holds no loss: the bar (on a terminal: here the captured stream
    says it is one) keeps the last loss beside the AUC, never "nan" (it showed loss=nan after
    each mid-run evaluation); an evaluation counts its samples on a bar of its own."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    main(["--steps", "5", "--eval-every", "2", "--log-every", "3", "--synthetic-eval", "64"])
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "nan" not in bar
    assert re.search(r"step/s, auc=0\.\d{4}\]", bar)  # step 2: an evaluation's row alone
    assert re.search(r"step/s, loss=\d\.\d{4}, auc=0\.\d{4}\]", bar)  # step 4: both
    assert "evaluate: " in bar and " samples" in bar  # an evaluation's count of its samples


def test_bounded_codec_without_policy_is_refused(tmp_path: Path) -> None:
    """Up front, by its configuration (it was refused at the first step's exchange)."""
    for d in ("fwd", "bwd"):
        with pytest.raises(ValueError, match=f"--{d}-codec quant needs an error bound"):
            TrainConfig(**{f"{d}_codec": "quant", "eb_policy": "none"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs an error bound"):
        main(["--steps", "1", "--fwd-codec", "hybrid", "--eb-policy", "none", "--no-progress",
              "--out", str(tmp_path / "run")])  # fmt: skip
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dense_dtype", ["fp32", "bf16"])
def test_real_sample_reaches_auc(criteo_10k: Path, tmp_path: Path, dense_dtype: str) -> None:
    """Default flags, first 8,000 rows train, last 1,999 evaluate: AUC >= 0.70 (with the
    MLPs in bfloat16 too)."""
    flags = ["--data", str(criteo_10k), "--dense-dtype", dense_dtype]
    main([*flags, "--no-progress", "--out", str(tmp_path)])
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["eval_samples"] == 2000 or s["eval_samples"] == 1999 + 1 or s["eval_samples"] > 1900
    assert s["auc"] >= 0.70, s["auc"]


def test_fiited_with_a_masked_backward_beside_tt_tables(tmp_path: Path) -> None:
    """FIITED prunes the dense tables only; the TT tables, named in no chunk count, keep
    their whole gradient (this combination once raised a KeyError in the backward)."""
    flags = ["--steps", "6", "--batch-size", "64", "--synthetic-eval", "256", "--no-progress"]
    fiited = ["--fiited-budget", "0.5", "--fiited-interval", "2", "--fiited-mask-backward"]
    assert main([*flags, "--tt-tables", "2", *fiited, "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    tt = TrainConfig(tt_tables=2).tt_spec()
    assert tt is not None
    assert set(s["fiited_kept"]) == {str(t) for t in range(26) if t not in tt.tables}


def test_ddp_without_buffer_sync_warns_nothing(tmp_path: Path) -> None:
    """The MLPs' DDP skips the per-step buffer broadcast with the keyword this torch knows,
    without its deprecation warning (pytest turns warnings into errors), and keeps the
    buffer as it was at init."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recsz.step import DDP_NO_BUFFER_SYNC

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        m = torch.nn.Linear(2, 2)
        m.register_buffer("c", torch.arange(3.0))
        ddp = DDP(m, **DDP_NO_BUFFER_SYNC)
        ddp(torch.ones(1, 2)).sum().backward()
        assert not ddp.will_sync_module_buffers()
        assert torch.equal(ddp.module.c, torch.arange(3.0))
        # Gloo's teardown, once the group is gone, joins its work thread holding the GIL,
        # which that thread may need to free the all-reduce's work: a deadlock (seen
        # once). The DDP (the group's last holder) goes while the group is registered,
        # the thread freeing the work meanwhile.
        dist.barrier()
        del ddp
        time.sleep(0.1)
    finally:
        dist.destroy_process_group()


_MALLINFO = """
import ctypes, sys, torch
from recsz.ranks import keep_freed_memory
names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
took = keep_freed_memory() if sys.argv[1] == "keep" else None
blocks = [torch.ones(30 << 18) for _ in range(3)]  # 3 x 30 MiB
alive = libc.mallinfo2()
del blocks
print(took, alive.hblkhd >> 20, libc.mallinfo2().fordblks >> 20)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_freed_host_memory_stays_for_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--host-memory keep (the default): glibc's malloc serves a step's large tensors from
    its heap and keeps them when freed (by default it maps each afresh and gives it back,
    so the next step faults its pages in again); --host-memory return leaves glibc as is."""

    def run(mode: str) -> list[str]:
        cmd = [sys.executable, "-c", _MALLINFO, mode]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()

    took, mapped, kept = run("keep")
    if took != "True":
        pytest.skip("not glibc")
    assert int(mapped) < 30 and int(kept) >= 90  # from the heap, and kept there
    _, mapped, _ = run("default")
    assert int(mapped) >= 90  # glibc's own: each block mapped afresh

    calls: list[int] = []
    monkeypatch.setattr("recsz.train.keep_freed_memory", lambda: calls.append(1))
    for mode in ("return", "keep"):
        flags = ["--steps", "2", "--batch-size", "64", "--no-progress", "--host-memory", mode]
        assert main([*flags, "--out", str(tmp_path / mode)]) == 0
    assert calls == [1]
    assert TrainConfig().host_memory == "keep"


def test_a_run_stops_at_its_target_auc_and_resuming_it_does_nothing(tmp_path: Path) -> None:
    """--target-auc: the first evaluation that reaches it ends the run there (its summary,
    its checkpoint, the time it took); resuming it does nothing, unless the target is
    raised (a target is no part of the fingerprint)."""
    out = tmp_path / "run"
    argv = ["--steps", "300", "--batch-size", "64", "--eval-every", "20", "--target-auc",
            "0.7", "--synthetic-eval", "2000", "--no-progress", "--checkpoint-every", "1000",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    at = s["reached_target_at"]
    assert at is not None and 0 < at < 300 and at % 20 == 0 and s["steps"] == at
    assert s["auc"] >= 0.7 and s["time_to_target_s"] >= s["eval_s_total"] > 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_auc"]) for r in rows if "eval_auc" in r]
    assert evals[-1] == (at, s["auc"]) and all(auc < 0.7 for _, auc in evals[:-1])
    assert [p.name for p in checkpoint.complete(out)] == [f"step-{at:09d}"]
    assert main([*argv, "--resume", str(out)]) == 0  # already there: nothing to do
    assert json.loads((out / "summary.json").read_text()) == s
    higher = [*("0.999" if a == "0.7" else a for a in argv), "--resume", str(out)]
    assert main(higher) == 0  # goes on to --steps
    assert json.loads((out / "summary.json").read_text())["steps"] == 300
    with pytest.raises(ValueError, match="--target-auc is checked at each evaluation"):
        parse_train_args(["--target-auc", "0.8"])


def test_patience_stops_a_run_whose_auc_stopped_rising_and_keeps_its_best(
    tmp_path: Path, monkeypatch
) -> None:
    """--patience 2: the second evaluation in a row that does not beat the best ends the run
    there (summary, checkpoint); the checkpoint evaluated best stays beside the newest
    (--keep-checkpoints 1) and the summary names it; resuming does nothing, unless the
    patience is raised (the evaluations before are counted from the log)."""
    import recsz.train as train

    scripted = {10: 0.70, 20: 0.72, 30: 0.71, 40: 0.715, 50: 0.70, 60: 0.73}
    real = train.evaluate

    def evaluate(*a, **kw):  # the real evaluation, its AUC the script's
        ev = real(*a, **kw)
        return ev | {"auc": scripted[a[3]]}

    monkeypatch.setattr(train, "evaluate", evaluate)
    out = tmp_path / "run"
    argv = ["--steps", "60", "--batch-size", "32", "--eval-every", "10", "--patience", "2",
            "--synthetic-eval", "256", "--no-progress", "--checkpoint-every", "10",
            "--keep-checkpoints", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped_early_at"] == 40 == s["steps"] and s["auc"] == 0.715
    assert s["reached_target_at"] is None
    best = str(out / "checkpoints" / "step-000000020")
    assert s["best_checkpoint"] == {"step": 20, "auc": 0.72, "path": best}
    assert chosen(out / "best")[0] == Path(best)  # `recsz evaluate RUN/best` and the rest
    assert [p.name for p in checkpoint.complete(out)] == ["step-000000020", "step-000000040"]
    assert main([*argv, "--resume", str(out)]) == 0  # its patience spent: nothing to do
    assert json.loads((out / "summary.json").read_text()) == s
    assert main([*argv, "--patience", "3", "--resume", str(out)]) == 0  # goes on to 50
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped_early_at"] == 50 == s["steps"] and s["best_checkpoint"]["step"] == 20
    assert [p.name for p in checkpoint.complete(out)] == ["step-000000020", "step-000000050"]
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval_auc"]) for r in rows if "eval_auc" in r] == [
        (k, scripted[k]) for k in (10, 20, 30, 40, 50)
    ]
    assert main([*argv, "--patience", "0", "--resume", str(out)]) == 0  # none: to the end
    s = json.loads((out / "summary.json").read_text())  # its final evaluation, the best
    assert s["stopped_early_at"] is None and s["steps"] == 60
    assert s["best_checkpoint"] == {"step": 60, "auc": 0.73, "path": best[:-2] + "60"}
    assert chosen(out / "best")[1]["step"] == 60
    with pytest.raises(ValueError, match="--patience is checked at each evaluation"):
        parse_train_args(["--patience", "2"])


def test_run_best_names_no_checkpoint_where_none_was_evaluated(tmp_path: Path) -> None:
    """RUN/best of a run whose checkpoints no evaluation scored: an error naming the run,
    not its newest checkpoint taken for the best."""
    out = tmp_path / "run"
    argv = ["--steps", "4", "--batch-size", "32", "--synthetic-eval", "64", "--no-progress",
            "--checkpoint-every", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (out / "metrics.jsonl").write_text("")  # the final evaluation's row gone
    with pytest.raises(FileNotFoundError, match=f"{out}/best: no kept checkpoint of {out}"):
        chosen(out / "best")


def test_a_target_met_by_the_final_evaluation_is_reached(tmp_path: Path) -> None:
    """The final evaluation is an evaluation too: where it meets --target-auc the summary
    says so (the step, the time to it), its row logged once (before, neither was said)."""
    out = tmp_path / "run"
    argv = ["--steps", "6", "--batch-size", "64", "--eval-every", "4", "--target-auc", "0.01",
            "--synthetic-eval", "256", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["reached_target_at"] == 4 == s["steps"]  # (the first evaluation: mid-run)
    keep = ["--checkpoint-every", "6"]  # (kept to resume below)
    assert main([*argv, "--eval-every", "6", *keep, "--out", str(tmp_path / "final")]) == 0
    s = json.loads((tmp_path / "final" / "summary.json").read_text())
    assert s["reached_target_at"] == 6 == s["steps"] and s["time_to_target_s"] > 0
    rows = [json.loads(r) for r in (tmp_path / "final" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_auc" in r] == [6]
    # Resumed for more steps, it has met its target at 6, where a run of more steps stopped:
    # nothing to do (it trained on to the new --steps before; hypothesis found it).
    final = tmp_path / "final"
    more = ["--eval-every", "6", *keep, "--steps", "12", "--resume", str(final)]
    assert main([*argv[:-2], *more]) == 0
    again = json.loads((final / "summary.json").read_text())
    assert again["steps"] == 6 and again == s


def test_a_launched_jobs_failure_names_its_cause(tmp_path: Path) -> None:
    """What the launcher's agent says of a failed attempt, from torchrun's failures: a rank a
    signal killed is the cause (SIGKILL: the out-of-memory killer's, said so), the other's
    lost peer not shown; else the traceback of the rank that recorded its exception first,
    once; the ranks the agent closed (SIGTERM) left out, but one it then killed (stuck); a
    rank with no record, its status."""
    import json
    import os
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from recsz.launcher import _report

    def recorded(name: str, trace: str, at_ns: int) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"message": {"message": trace.splitlines()[-1], "extraInfo":
                                    {"py_callstack": trace, "timestamp": "1"}}}))  # fmt: skip
        os.utime(path, ns=(at_ns, at_ns))
        return str(path)

    peer = recorded("0.json", "Traceback ...\nRuntimeError: Connection closed by peer\n", 2)
    bug = recorded("1.json", "Traceback ...\nIndexError: list index out of range\n", 1)
    none = str(tmp_path / "absent.json")
    killed = ProcessFailure(1, 41, -signal.SIGKILL, none)
    said = _report({0: ProcessFailure(0, 40, 1, peer), 1: killed})
    assert said == ("recsz: rank 1 (pid 41) was killed by SIGKILL (the kernel's out-of-memory "
                    "killer sends it: see `dmesg`)")  # fmt: skip
    said = _report({0: ProcessFailure(0, 40, 1, peer), 1: ProcessFailure(1, 41, 1, bug),
                    2: ProcessFailure(2, 42, -signal.SIGTERM, none)})  # fmt: skip
    assert said == ("recsz: rank 1 failed first; its traceback:\nTraceback ...\n"
                    "IndexError: list index out of range")  # fmt: skip
    said = _report({3: ProcessFailure(3, 43, 7, none), 2: ProcessFailure(2, 42, -15, none),
                    4: ProcessFailure(4, 44, 128 + signal.SIGTERM, none)})  # fmt: skip
    assert said == "recsz: rank 3 (pid 43) exited with status 7"
    # only a lost peer here (a node of a multi-node job whose peer failed on another):
    # said as the peer's failure, which its own node's log holds
    said = _report({0: ProcessFailure(0, 40, 1, peer)})
    assert said.endswith("recsz: rank 0 lost a peer, and no rank of this node failed "
                         "before it: on a job of several nodes, the cause is in another "
                         "node's log")  # fmt: skip
    said = _report({0: ProcessFailure(0, 40, 1, peer), 1: ProcessFailure(1, 41, 7, none)})
    assert "lost a peer" not in said  # (rank 1 failed here, without a record)
    # a rank the agent killed when it did not stop (stuck): not the cause, said after it
    said = _report({0: ProcessFailure(0, 40, 1, peer), 1: killed}, forced={41})
    assert said.startswith("recsz: rank 0 failed first; its traceback:\nTraceback ...\n")
    assert said.endswith("\nrecsz: rank 1 (pid 41) did not stop when the job's ranks were "
                         "closed, and was killed (stuck in a call?)")  # fmt: skip


_CLOSED_WHILE_RECORDING = """
import json, os, pathlib, signal, sys
from recsz import ranks
# a rank's SIGINT is Python's (a test runner's worker may start this one with it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
def closed_meanwhile(write):  # the agent's signal, come as a file for it is written
    def written(*args, **kwargs):
        os.kill(os.getpid(), int(os.environ["SIGNAL"]))
        return write(*args, **kwargs)
    return written
json.dump = closed_meanwhile(json.dump)  # (the record: torchrun's ErrorHandler)
pathlib.Path.write_text = closed_meanwhile(pathlib.Path.write_text)  # (bad input's note)
try:
    if os.environ["BAD"]:
        raise ValueError("data.tsv:3: field 2 is not a number")
    raise RuntimeError("Connection reset by peer")
except Exception as e:
    sys.exit(ranks._failed(e, "0"))
"""


def test_a_rank_closed_while_it_records_its_failure_leaves_a_whole_record(
    tmp_path: Path,
) -> None:
    """A rank that fails as its peer dies is closed by torchrun's agent (SIGTERM; SIGINT
    passed on) while it may be writing its exception's record: the record is there whole
    (the agent parses it; an empty one failed its parse, with a traceback of its own in
    place of the report), and the signal is still taken after it. Likewise bad input's
    note for the launcher (:func:`recsz.launcher.noted`)."""
    import os
    import signal

    from recsz.launcher import noted

    for sig in (signal.SIGTERM, signal.SIGINT):
        for bad in ("", "1"):
            folder = tmp_path / f"{sig.name}{bad}"
            folder.mkdir()
            target = folder / "error.json"
            env = {**os.environ, "RECSZ_AGENT": "1", "TORCHELASTIC_ERROR_FILE": str(target),
                   "RECSZ_FAILURES": str(folder / "notes"), "SIGNAL": str(int(sig)),
                   "BAD": bad}  # fmt: skip
            done = subprocess.run([sys.executable, "-c", _CLOSED_WHILE_RECORDING], env=env,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == -sig, done.stderr
            assert "Traceback" not in done.stderr  # (SIGINT: no KeyboardInterrupt raised)
            if bad:
                assert noted(folder / "notes") == (
                    "bad input",
                    "rank 0: ValueError: data.tsv:3: field 2 is not a number",
                )
                assert [f.name for f in (folder / "notes").iterdir()] == ["rank-0"]
                continue
            said = json.loads(target.read_text())["message"]
            assert said["message"] == "RuntimeError: Connection reset by peer"
            assert "Traceback" in said["extraInfo"]["py_callstack"]
            assert [f.name for f in folder.iterdir()] == ["error.json"]  # (nothing beside)


def test_bad_input_is_a_value_error_not_a_damaged_payload() -> None:
    """What a launched rank ends on without restarts: a ValueError (a data line, a flag, a
    checkpoint), unless a PayloadError (bytes damaged on their way) is in its chain; a
    diverged loss; a missing path, not any OSError."""
    from recsz.codecs.payload import PayloadError
    from recsz.ranks import bad_input

    def chained(outer: type[Exception], inner: Exception) -> Exception:
        try:
            raise outer("rank 1: fwd payloads from ranks [0]") from inner
        except Exception as e:
            return e

    assert bad_input(ValueError("data.tsv:3: field 2"))
    assert bad_input(chained(ValueError, KeyError("x")))
    assert not bad_input(PayloadError("checksum"))
    assert not bad_input(chained(ValueError, PayloadError("checksum")))
    assert bad_input(FloatingPointError("the loss is not finite on rank(s) [1] by step 5"))
    assert not bad_input(RuntimeError("Connection closed by peer"))
    assert bad_input(FileNotFoundError("--data /x.tsv: no such file or directory"))
    assert not bad_input(OSError(5, "Input/output error"))
