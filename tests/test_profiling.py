"""`recsz train --profile N`: the torch profiler over N steps after the first ones, each
stage's time a step said and written (profile.json), each rank's trace in the run dir."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from recsz import profiling
from recsz.train import main

BASE = ["--batch-size", "64", "--synthetic-eval", "256", "--no-progress"]


def test_a_profiled_run_says_and_writes_each_stage(tmp_path: Path, capfd) -> None:
    out = tmp_path / "run"
    assert main([*BASE, "--steps", "8", "--profile", "3", "--checkpoint-every", "8", "--out",
                 str(out)]) == 0  # fmt: skip
    (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
    assert (prof["first_step"], prof["steps"]) == (3, 3)  # after the first 3 steps
    host = prof["host_ms"]
    assert list(host) == [*profiling.STAGES, profiling.REST]
    assert all(v >= 0 for v in host.values()) and host["embedding lookup"] > 0
    assert host["dense optimizer"] > 0 and host["table update (fused optimizer)"] > 0
    assert sum(host.values()) == pytest.approx(prof["wall_ms"], rel=1e-6)  # the rest: the gap
    assert prof["top_ops"] and all(ms > 0 for _, ms, _ in prof["top_ops"])
    assert "gpu_ms" not in prof  # (the CPU)
    with gzip.open(out / "profile" / "rank-0.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"recsz.lookup", "recsz.data", "recsz.dense_opt"} <= names
    said = "".join(capfd.readouterr())  # (the process's own stdout and stderr too)
    assert "recsz: profile of steps 3..6 on 1 rank(s)" in said
    assert "profiler_start" not in said and "profiler_stop" not in said  # (kineto's stages)
    assert "recorded no GPU work" not in said
    assert "| embedding lookup | " in said and f"numbers: {out / 'profile.json'}" in said
    # a resumed run does not take --profile from the run it resumes (a measurement, once)
    assert main(["--resume", str(out), "--steps", "9", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["config"]["profile"] == 0


def test_the_profile_ends_before_an_evaluation_and_fits_a_short_run(tmp_path: Path) -> None:
    """Steady steps only: an evaluation due inside the window ends the profile there (its
    lookups are not a step's); a run shorter than the first steps and N profiles its last N;
    a bound policy's first probes and --compress auto's first trial are left before it."""
    out = tmp_path / "eval"
    assert main([*BASE, "--steps", "8", "--eval-every", "4", "--profile", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
    assert (prof["first_step"], prof["steps"], prof["asked"]) == (3, 1, 3)
    assert "profile of steps 3..4 (1 of the 3 asked: the run ended, or an evaluation" in (
        profiling.table([prof], out)
    )
    # a GPU's run whose profile holds no GPU work (no CUPTI) says so, and how to see why
    assert "recorded no GPU work (CUPTI unavailable to this process?): KINETO_LOG_LEVEL=0" in (
        profiling.table([{**prof, "device": "cuda"}], out)
    )
    out = tmp_path / "short"
    assert main([*BASE, "--steps", "4", "--profile", "3", "--out", str(out)]) == 0
    (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
    assert (prof["first_step"], prof["steps"]) == (1, 3)
    first = profiling.StepProfiler(5, 10, 12, 13, torch.device("cpu"), None).first
    assert first == 10  # resumed at 10, 2 steps left: from where it resumed
    # the dual policy's first probe window (--hindex-probe-steps) is not a steady step
    out = tmp_path / "dual"
    dual = ["--fwd-codec", "hybrid", "--eb-policy", "dual", "--hindex-probe-steps", "5"]
    assert main([*BASE, *dual, "--steps", "9", "--profile", "2", "--out", str(out)]) == 0
    (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
    assert (prof["first_step"], prof["steps"]) == (5, 2)
    # nor --compress auto's first trial after it (2 warmup and 2 timed steps each way),
    # whose steps alternate the codecs' way and the plain one
    out = tmp_path / "auto"
    auto = [*dual, "--compress", "auto", "--compress-trial", "2"]
    assert main([*BASE, *auto, "--steps", "16", "--profile", "2", "--out", str(out)]) == 0
    (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
    assert (prof["first_step"], prof["steps"]) == (5 + 8, 2)
    trial = json.loads((out / "summary.json").read_text())["compress"]["trials"][0]
    assert trial["step"] + 8 <= prof["first_step"], trial
    # --profile-from: the first step told (a probe's or a trial's included), the run's end
    # still the last
    for at, first in ((1, 1), (15, 14)):
        out = tmp_path / f"from{at}"
        assert main([*BASE, *auto, "--steps", "16", "--profile", "2", "--profile-from",
                     str(at), "--out", str(out)]) == 0  # fmt: skip
        (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
        assert (prof["first_step"], prof["steps"]) == (first, 2)


def test_a_step_marks_its_stages_only_for_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a profiler a step enters no ``record_function`` range (each costs host time:
    8% of a small step); under one (torch's, or its ITT annotations) every stage is marked."""
    from torch.profiler import profile

    entered: list[str] = []
    marked = profiling.record_function

    def counted(name: str) -> object:
        entered.append(name)
        return marked(name)

    monkeypatch.setattr(profiling, "record_function", counted)
    assert main([*BASE, "--steps", "2", "--fwd-codec", "hybrid"]) == 0
    assert entered == []
    with profile(acc_events=True):
        assert main([*BASE, "--steps", "2", "--fwd-codec", "hybrid"]) == 0
    stages = {n for names in profiling.STAGES.values() for n in names}
    assert set(entered) == stages, set(entered) ^ stages
    entered.clear()
    with torch.autograd.profiler.emit_itt(), profiling.stage("recsz.x"):
        pass
    assert entered == ["recsz.x"]


def test_the_table_says_the_mean_and_the_slowest_rank() -> None:
    def rank(ms: float, gpu: bool) -> dict:
        stages = [*profiling.STAGES, profiling.REST]
        got = {"first_step": 3, "steps": 2, "wall_ms": 10 * ms, "host_ms":
               dict.fromkeys(stages, ms), "top_ops": [["aten::mm", ms, 3.0]]}  # fmt: skip
        if gpu:
            got |= {"gpu_ms": dict.fromkeys(profiling.STAGES, ms / 2), "gpu_busy": ms / 10,
                    "kernels_per_step": 40.0}  # fmt: skip
        return got

    said = profiling.table([rank(1.0, False), None, rank(3.0, False)], None)
    assert "on 2 rank(s)" in said and "| embedding lookup | 2.00 | 3.00 (2) |" in said
    assert "| step (wall) | 20.00 | 30.00 (2) |" in said and "GPU" not in said
    assert "rank 0's top operators (self host ms a step): aten::mm 1.00" in said
    said = profiling.table([rank(2.0, True), rank(4.0, True)], None)
    assert "| embedding lookup | 3.00 | 4.00 (1) | 1.50 |" in said
    assert "GPU busy (kernel time / wall): 0.20..0.40; kernels a step: 40 (rank 0)" in said
    assert profiling.table([None, None], None).endswith("ended before its profiled steps")


def test_a_ranges_gpu_side_is_neither_a_kernel_nor_its_host_time() -> None:
    """On a GPU a record_function range is two entries, its host side and its GPU side (an
    annotation spanning its kernels, no host time): a stage's host ms are the host side's,
    its GPU ms the kernels its host side launched; GPU busy and kernels a step count
    kernels only, not the annotations (counted, the gaps between kernels would be busy)."""
    from types import SimpleNamespace as E

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    host = E(key="recsz.lookup", device_type=cpu, cpu_time_total=4000.0,
             device_time_total=600.0, self_cpu_time_total=1000.0, count=2)  # fmt: skip
    gpu_side = E(key="recsz.lookup", device_type=cuda, cpu_time_total=0.0,
                 device_time_total=5000.0, self_cpu_time_total=0.0, count=2)  # fmt: skip
    kernel = E(device_type=cuda, device_time=300.0, is_user_annotation=False)
    annotation = E(device_type=cuda, device_time=5000.0, is_user_annotation=True)
    for averages in ([host, gpu_side], [gpu_side, host]):
        prof = E(key_averages=lambda a=averages: a, events=lambda: [kernel, kernel, annotation])
        got = profiling.summarize(prof, 2, 0.01, 3)  # 2 steps in 10 ms
        assert got["host_ms"]["embedding lookup"] == 2.0  # 4 ms over 2 steps
        assert got["gpu_ms"]["embedding lookup"] == 0.3
        assert got["kernels_per_step"] == 1.0 and got["gpu_busy"] == pytest.approx(0.06)
        assert got["top_ops"] == []  # (a stage's range is no operator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_profile_counts_kernels_not_their_ranges(tmp_path: Path) -> None:
    """On a GPU: each stage's kernel ms, GPU busy (at most 1: no range's annotation counted
    as a kernel, nor the gaps it spans), kernels a step; the host's stages as on the CPU."""
    out = tmp_path / "run"
    flags = ["--device", "cuda", "--steps", "8", "--profile", "3", "--out", str(out)]
    assert main([*BASE, *flags]) == 0  # (codec none: no kernel to compile in the GPU check)
    (prof,) = json.loads((out / "profile.json").read_text())["ranks"]
    assert 0 < prof["gpu_busy"] <= 1 and prof["kernels_per_step"] > 10
    gpu = prof["gpu_ms"]
    assert gpu["embedding lookup"] > 0 and gpu["table update (fused optimizer)"] > 0
    assert sum(gpu.values()) <= prof["wall_ms"] and prof["host_ms"]["embedding lookup"] > 0
