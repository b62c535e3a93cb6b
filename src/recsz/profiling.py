"""Where a run's steps spend their time: ``recsz train --profile N`` runs the torch
profiler over N steps after the first ones (kernel compiles, CUDA graph captures and caches
behind, the dual / table policies' first probe window, which codes some traffic at several
bounds, and ``--compress auto``'s first trial, which alternates the ways), writes each
rank's trace into the run directory (``profile/rank-R.json.gz``: open it in Perfetto or
chrome://tracing) and says, per stage of the step (the ``record_function`` ranges the
step's code marks), the milliseconds each rank spent on the host and, on a GPU, in kernels;
with the step's wall time and, on a GPU, how busy the GPU was (kernel time over wall time)
and the kernels a step launches. ``profile.json`` in the run directory holds every rank's
numbers. The profiler's own work is in the times (its hooks on every operator): compare
stages, not the wall time of an unprofiled run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from tqdm import tqdm

if TYPE_CHECKING:
    from recsz.ranks import Ranks

#: The stages of a step: their ``record_function`` labels (the rest of the step is "rest").
STAGES = {
    "data wait": ["recsz.data"],
    "embedding lookup": ["recsz.lookup"],
    "exchange encode": ["recsz.a2a_fwd.encode", "recsz.a2a_bwd.encode"],
    "exchange wait": ["recsz.a2a_fwd.wait", "recsz.a2a_bwd.wait"],
    "exchange decode": ["recsz.a2a_fwd.decode", "recsz.a2a_bwd.decode"],
    "table update (fused optimizer)": ["recsz.table_update"],
    "dense optimizer": ["recsz.dense_opt"],
}
REST = "rest: MLPs, interaction, loss, autograd"
#: The operators said by their own host time (the rest's, mostly).
TOP = 6
#: Kineto's (the profiler's backend) log level, read as a profile starts, and the level
#: that quiets it: torch 2.13 printed two lines of its own stages ("USDT: ...
#: profiler_start") each profile on each rank. A user's own setting stays (0: all of it).
KINETO_LOG_LEVEL, KINETO_QUIET = "KINETO_LOG_LEVEL", "6"


def quiet_kineto() -> None:
    """Before a profile starts: kineto's own stage lines quieted, unless the user set a
    level (:data:`KINETO_LOG_LEVEL`)."""
    os.environ.setdefault(KINETO_LOG_LEVEL, KINETO_QUIET)


#: Whether a profiler listens (torch's, or its NVTX / ITT ranges): torch's own test, private
#: (on a torch without it: always).
_listening = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def stage(name: str) -> contextlib.AbstractContextManager[Any]:
    """A step's stage ``name`` marked for a profiler (``record_function``) where one
    listens, else nothing: a range entered costs host time with no profiler too (the
    step's 10 ranges: 8% of a one-process step at batch 32, 2.28 against 2.10 ms here)."""
    return record_function(name) if _listening() else contextlib.nullcontext()


class StepProfiler:
    """The profiler over steps ``[first, first + count)`` of a run, on one rank: call
    :meth:`before` as a step begins (before its batch is fetched) and :meth:`after` as it
    ends; :attr:`result` holds the numbers once the last one ended, or once :meth:`close`
    ended it early (before an evaluation or a checkpoint, whose work is not a step's).

    ``first``: step ``after`` (past the first steps' compiles, captures and caches, a
    bound policy's first probes and ``--compress auto``'s first trial), or where the run
    resumed if later; earlier where the run would end before ``count`` more steps."""

    def __init__(self, count: int, start: int, steps: int, after: int, device: torch.device,
                 trace: Path | None) -> None:  # fmt: skip
        self.first = max(start, min(after, steps - count))
        self.count, self.device, self.trace = count, device, trace
        self.result: dict[str, Any] | None = None
        self._prof: Any = None
        self._began = 0.0
        self._steps = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if self.count and step == self.first and self._prof is None and self.result is None:
            quiet_kineto()
            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            # (one cycle: acc_events only quiets torch's warning that cycles are not kept)
            self._prof = profile(activities=[ProfilerActivity.CPU, *cuda], acc_events=True)
            self._sync()
            self._prof.start()
            self._began = time.perf_counter()

    def after(self, step: int) -> None:
        if self._prof is not None:
            self._steps += 1
            if step + 1 >= self.first + self.count:
                self.close()

    def close(self) -> None:
        """Stop the profiler (where it runs) and keep its numbers."""
        if self._prof is None:
            return
        self._sync()
        wall = time.perf_counter() - self._began
        prof, self._prof = self._prof, None
        prof.stop()
        if self._steps:
            self.result = summarize(prof, self._steps, wall, self.first)
            self.result.update(asked=self.count, device=self.device.type)
            if self.trace is not None:
                self.trace.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(self.trace))
                self.result["trace"] = str(self.trace)


def device_events(prof: Any) -> list[Any]:
    """The GPU's work a profiler recorded (kernels, copies, memsets), not the GPU side of
    the ``record_function`` ranges (an annotation spans its kernels: counted, it would
    count their time twice and the gaps between them as busy)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in prof.events()
            if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]  # fmt: skip


def summarize(prof: Any, steps: int, wall_s: float, first: int) -> dict[str, Any]:
    """Milliseconds a step per stage (host; ``gpu_ms``: the kernels each stage launched),
    the step's wall milliseconds, and on a GPU its busy share and kernels a step."""
    cpu = torch.autograd.DeviceType.CPU  # (a range's GPU side is an entry of its own)
    totals = {e.key: e for e in prof.key_averages() if e.device_type == cpu}

    def ms(names: list[str], attr: str) -> float:
        return sum(getattr(totals[n], attr) for n in names if n in totals) / 1e3 / steps

    wall_ms = wall_s * 1e3 / steps
    host = {k: ms(names, "cpu_time_total") for k, names in STAGES.items()}
    host[REST] = max(wall_ms - sum(host.values()), 0.0)
    out: dict[str, Any] = {"first_step": first, "steps": steps, "wall_ms": wall_ms, "host_ms": host}
    labels = {n for names in STAGES.values() for n in names}
    ops = sorted((e for e in totals.values() if e.key not in labels and e.self_cpu_time_total),
                 key=lambda e: -e.self_cpu_time_total)[:TOP]  # fmt: skip
    out["top_ops"] = [[e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps] for e in ops]
    kernels = device_events(prof)
    if kernels:
        out["gpu_ms"] = {k: ms(names, "device_time_total") for k, names in STAGES.items()}
        busy_ms = sum(e.device_time for e in kernels) / 1e3 / steps
        out["gpu_busy"] = busy_ms / wall_ms
        out["kernels_per_step"] = len(kernels) / steps
    return out


def gathered(profiler: StepProfiler, ranks: Ranks, out: Path | None) -> None:
    """Every rank's profile to rank 0, which writes ``out/profile.json`` and says the
    table (every rank calls it where the run profiles)."""
    profiler.close()
    results = ranks.gather(profiler.result)
    if ranks.rank == 0:
        if out is not None and any(results):
            (out / "profile.json").write_text(json.dumps({"ranks": results}, indent=2))
        tqdm.write(table(results, out))


def table(results: list[dict[str, Any] | None], out: Path | None) -> str:
    """The ranks' profiles (their numbers in rank order, None where a rank took none) as a
    table of each stage's mean and largest over the ranks (``out``: the run directory whose
    ``profile.json`` holds them)."""
    got = [(r, res) for r, res in enumerate(results) if res is not None]
    if not got:
        return "recsz: --profile: the run ended before its profiled steps"
    first = got[0][1]
    cuda = "gpu_ms" in first
    took, asked = first["steps"], first.get("asked", first["steps"])
    short = (f" ({took} of the {asked} asked: the run ended, or an evaluation or checkpoint "
             "came, before the rest)" if took < asked else "")  # fmt: skip
    lines = [
        f"recsz: profile of steps {first['first_step']}..{first['first_step'] + took}{short}"
        f" on {len(got)} rank(s) (torch profiler: its own hooks in the times), ms a step",
        "| stage | host, mean | host, most (rank) |" + (" GPU, mean |" if cuda else ""),
        "|---|---|---|" + ("---|" if cuda else ""),
    ]
    for stage in [*STAGES, REST]:
        vals = [(res["host_ms"][stage], r) for r, res in got]
        top, at = max(vals)
        row = f"| {stage} | {sum(v for v, _ in vals) / len(vals):.2f} | {top:.2f} ({at}) |"
        if cuda:
            gpu = [res.get("gpu_ms", {}).get(stage, 0.0) for _, res in got]
            row += f" {sum(gpu) / len(gpu):.2f} |" if stage in STAGES else " |"
        lines.append(row)
    walls = [(res["wall_ms"], r) for r, res in got]
    top, at = max(walls)
    lines.append(f"| step (wall) | {sum(w for w, _ in walls) / len(walls):.2f} | {top:.2f} ({at}) |"
                 + (" |" if cuda else ""))  # fmt: skip
    r0 = got[0][0]
    lines.append(f"rank {r0}'s top operators (self host ms a step): "
                 + ", ".join(f"{name} {ms:.2f}" for name, ms, _ in first["top_ops"]))  # fmt: skip
    if not cuda and any(res.get("device") == "cuda" for _, res in got):
        lines.append("recsz: the profiler recorded no GPU work (CUPTI unavailable to this "
                     f"process?): {KINETO_LOG_LEVEL}=0 shows the profiler's messages")  # fmt: skip
    if cuda:
        busy = [res["gpu_busy"] for _, res in got]
        lines.append(f"GPU busy (kernel time / wall): {min(busy):.2f}..{max(busy):.2f}; "
                     f"kernels a step: {first['kernels_per_step']:.0f} (rank {r0})")  # fmt: skip
    if "trace" in first:
        lines.append(f"traces: {Path(first['trace']).parent}/rank-*.json.gz (Perfetto, "
                     "chrome://tracing)")  # fmt: skip
    if out is not None:
        lines.append(f"numbers: {out / 'profile.json'}")
    return "\n".join(lines)
