"""The GPU codec (format 3, Triton kernels) on a step's traffic, and a one-GPU training step.

    python benchmarks/bench_gpu.py [--quick] [--traffic FILE] [--json-out PATH]
    python benchmarks/bench_gpu.py --save-traffic FILE   # here, where ../shared/data is

Per data (synthetic: the bench preset's 26 tables x dim 64 looked up by the synthetic
generator; real: a dim-64 DLRM trained briefly on the real Criteo sample; until the
seventh session's last GPU call it was dim 32, half the bytes per launch) and batch
(2048, 8192), the step buffer (batch x 26 tables x dim rows, one group of 26 segments,
as the exchange codes a direction at one rank) is coded under the published dual policy's
base bound (relative 0.03 per table; kept so that GPU runs compare across sessions, although
the trainer's default classes are a third of the published ones since the eleventh session):

- encode / decode GB/s (fp32 bytes in; CUDA events, median of 50), the bare
  ``x.half()`` / ``.float()`` as the floor; bound computation timed apart;
- ratio, the CPU ``hybrid`` codec's ratio on the same data, max error / bound;
- host syncs per encode + decode (``torch.cuda.set_sync_debug_mode``) and CUDA kernel
  launches per call (profiler);
- break-even link rate: bytes saved / codec seconds (Gbit/s);
- a one-GPU training step (the real ``EmbeddingExchange`` at world size 1, bench
  preset) with the codec both ways, over the same step with codec ``none`` (the issue's
  ratio) and over the step without the exchange (``direct``: the pooled embeddings go
  straight to the MLPs); its host syncs, and how busy the GPU is.

Needs a CUDA device; without one it says so and exits 0 (CI has none).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recsz import stepgraph
from recsz.codecs import blockcpu, get_codec
from recsz.codecs import blockformat as bf
from recsz.comm import EmbeddingExchange
from recsz.comm.direction import Direction
from recsz.comm.stats import ShardPlan
from recsz.data.source import Batch
from recsz.data.synthetic import SyntheticCriteo
from recsz.model import DenseArch, RowOptimizer, SparseArch, get_preset
from recsz.policy import BoundPolicy
from recsz.policy.adaptive import DualBound
from recsz.policy.base import absolute_bounds
from recsz.profiling import device_events

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEV = torch.device("cuda")
REL = 0.03


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of fn (CUDA events on a GPU, wall clock on the CPU)."""
    fn()
    _sync()
    ts = []
    for _ in range(repeats):
        if DEV.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def count_syncs(fn: Any) -> int:
    """Host synchronizations inside fn, as torch's sync debug mode reports them."""
    if DEV.type != "cuda":
        return -1
    _sync()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Each sync warns "called a synchronizing CUDA operation"; the mode itself warns once
    # that it is a prototype ("Synchronization debug mode ..."), which is not a sync.
    return sum("called a synchronizing" in str(w.message) for w in caught)


def profiled(fn: Any, cuda: bool = True) -> Any:
    """The torch profiler over one call of fn (after one unprofiled call), recording the
    GPU's kernels (``cuda``) or the host's operators."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        fn()
        _sync()
    return p


def count_launches(fn: Any) -> int:
    """CUDA kernels (and memcpy/memset) one call of fn launches (torch profiler)."""
    return len(device_events(profiled(fn))) if DEV.type == "cuda" else -1


def top_kernels(fn: Any, n: int = 12) -> list[tuple[str, float]]:
    """The n GPU kernels one call of fn spends most time in (name, microseconds)."""
    if DEV.type != "cuda":
        return []
    times: dict[str, float] = {}
    for e in device_events(profiled(fn)):
        times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.device_time
    return sorted(times.items(), key=lambda kv: -kv[1])[:n]


def synthetic_step(batch: int) -> torch.Tensor:
    from bench_codecs import BenchConfig, synth_traffic

    return torch.stack(synth_traffic(64, BenchConfig(synth_batch=batch)), 1)  # (B, 26, 64)


def cpu_hybrid_ratio(step: torch.Tensor) -> float:
    """The CPU hybrid codec (format 1), per table chunk, under the same bounds."""
    codec = get_codec("hybrid")
    t = step.transpose(0, 1).contiguous()
    ebs = absolute_bounds([REL] * t.shape[0], "rel", t).tolist()
    sent = sum(int(codec.encode(t[j], e).numel()) for j, e in enumerate(ebs))
    return step.numel() * 4 / sent


def codec_rows(
    step_cpu: torch.Tensor, data: str, repeats: int, cpu_ratio: float, probes: list
) -> list[dict]:
    """Every timed number of the codec on one step buffer; ``probes`` gets :func:`probe`
    of each codec, run after every timing (the profiler's hooks can slow what runs after
    it)."""
    b, n_tables, dim = step_cpu.shape
    step = step_cpu.to(DEV)
    t = step.transpose(0, 1)  # table-major view, as the exchange hands it to the policy
    rows_in = t.reshape(n_tables * b, dim)  # the group's rows: table after table
    raw = rows_in.numel() * 4
    sizes = [b] * n_tables
    ebs = absolute_bounds([REL] * n_tables, "rel", t)
    out = []
    t_half = timed(lambda: rows_in.half(), repeats)
    h = rows_in.half()
    t_float = timed(lambda: h.float(), repeats)
    out.append(
        {
            "codec": "x.half() (floor)",
            "encode_gbps": raw / t_half / 1e9,
            "decode_gbps": raw / t_float / 1e9,
            "ratio": 2.0,
        }
    )
    t_bounds = timed(lambda: absolute_bounds([REL] * n_tables, "rel", t), repeats)
    for name in ["hybrid", "quant"]:
        # On the CPU (a dry run) the codec's format-3 path is the CPU coder (blockcpu).
        codec = get_codec(name) if DEV.type == "cuda" else get_codec(name, coder="blocks")
        groups = [(rows_in, sizes)]

        def enc(codec: Any = codec, groups: Any = groups) -> Any:
            return codec.encode_segments(groups, ebs, trim=False)

        pays, used = enc()

        def dec(codec: Any = codec, pays: Any = pays) -> Any:
            return codec.decode_segments(pays, [sizes], dim, check=False)

        t_enc, t_dec = timed(enc, repeats), timed(dec, repeats)
        t_trim = timed(
            lambda codec=codec, groups=groups: codec.encode_segments(groups, ebs), repeats
        )
        sent = int(used.sum())
        y = dec()[0]
        eb_row = torch.repeat_interleave(ebs, b)
        err = ((y.double() - rows_in.double()).abs().amax(1) / eb_row).max()
        trimmed, _ = codec.encode_segments(groups, ebs)  # the CPU coder's bytes?
        lay = bf.Layout(name, 0, dim, tuple(sizes), codec.dedup != "off")
        ref = blockcpu.encode_group(lay, rows_in.cpu().numpy(), ebs.cpu().numpy())
        same = trimmed[0].cpu().numpy().tobytes() == ref
        saved = raw - sent
        out.append(
            {
                "codec": name,
                "encode_gbps": raw / t_enc / 1e9,
                "decode_gbps": raw / t_dec / 1e9,
                "encode_trimmed_gbps": raw / t_trim / 1e9,
                "bounds_ms": t_bounds * 1e3,
                "ratio": raw / sent,
                "cpu_hybrid_ratio": cpu_ratio,
                "max_err_over_eb": float(err),
                "same_bytes_as_cpu_reference": same,
                "break_even_gbit": saved * 8 / (t_enc + t_dec) / 1e9,
            }
        )
        probes.append(functools.partial(probe, out[-1], enc, dec))
    for r in out:
        r.update({"data": data, "batch": b, "tables": n_tables, "dim": dim, "raw_MB": raw / 1e6})
    return out


#: The coder's launch shapes tried by --sweep (module constants of blockcoder): blocks per
#: pack/unpack program, elements per quantize program. (Moving every plane of a block at
#: once, one 3D reduction, lost to plane after plane on the H100: decode 43 vs 250 GB/s.)
SWEEP = [
    {"BLOCKS": 64, "ELEMS": 2048},
    {"BLOCKS": 128, "ELEMS": 2048},
    {"BLOCKS": 256, "ELEMS": 2048},
    {"BLOCKS": 128, "ELEMS": 1024},
    {"BLOCKS": 128, "ELEMS": 4096},
]


def probe(row: dict, enc: Any, dec: Any) -> None:
    """Host syncs, launches and the top kernels of one codec's calls (into ``row``)."""
    row["syncs_per_step"] = count_syncs(lambda: (enc(), dec()))
    row["launches_encode"] = count_launches(enc)
    row["launches_decode"] = count_launches(dec)
    row["top_kernels_encode"] = top_kernels(enc)
    row["top_kernels_decode"] = top_kernels(dec)


def sweep_rows(step_cpu: torch.Tensor, data: str, repeats: int) -> list[dict]:
    """The hybrid and quant codecs' encode/decode GB/s at each launch shape of SWEEP
    (each shape gets new plans and graphs)."""
    from recsz.codecs import blockcoder

    b, n_tables, dim = step_cpu.shape
    rows_in = step_cpu.to(DEV).transpose(0, 1).reshape(n_tables * b, dim)
    ebs = absolute_bounds([REL] * n_tables, "rel", rows_in.view(n_tables, b, dim))
    groups, raw, out = [(rows_in, [b] * n_tables)], rows_in.numel() * 4, []
    saved = {k: getattr(blockcoder, k) for k in SWEEP[0]}
    try:
        for shape, name in [(sh, n) for sh in SWEEP for n in ("hybrid", "quant")]:
            codec = get_codec(name) if DEV.type == "cuda" else get_codec(name, coder="blocks")
            for k, v in shape.items():
                setattr(blockcoder, k, v)
            blockcoder.clear_plans()
            pays, _ = codec.encode_segments(groups, ebs, trim=False)
            t_enc = timed(lambda c=codec: c.encode_segments(groups, ebs, trim=False), repeats)
            t_dec = timed(
                lambda c=codec, p=pays: c.decode_segments(p, [[b] * n_tables], dim, check=False),
                repeats,
            )
            gb = {"encode_gbps": raw / t_enc / 1e9, "decode_gbps": raw / t_dec / 1e9}
            out.append({"data": data, "batch": b, "codec": name, **shape, **gb})
            print(
                f"sweep {data:10} b={b:5} {name:6} {shape} "
                f"enc {gb['encode_gbps']:7.1f} dec {gb['decode_gbps']:7.1f} GB/s"
            )
    finally:
        for k, v in saved.items():
            setattr(blockcoder, k, v)
        blockcoder.clear_plans()
    return out


#: Training-step configurations: the codec both ways, "+ids" with id-aware traffic (sizes
#: change every step, so the coder runs eagerly, as in the trainer by default).
TRAIN_CONFIGS = ["direct", "none", "fp16", "hybrid", "quant", "hybrid+ids"]
#: At the largest batch only: "+graph" replays the whole step as one CUDA graph
#: (``--cuda-graph``, :mod:`recsz.stepgraph`); "+compile" puts the MLPs and the interaction
#: under torch.compile (each compiles the dense part); "+bf16" runs them under bfloat16
#: autocast (``--dense-dtype bf16``).
LARGEST_BATCH_CONFIGS = [
    "direct+graph",
    "none+graph",
    "hybrid+graph",
    "direct+compile",
    "none+compile",
    "hybrid+compile",
    "direct+bf16",
    "none+bf16",
    "hybrid+bf16",
]


def train_rows(batch: int, steps: int, probes: list, largest: bool = False) -> list[dict]:
    """One GPU, the bench preset, the real exchange at world size 1 in both directions:
    step time (each timed step on a new batch), host syncs; ``probes`` gets how busy the
    GPU is (profiled after every timing)."""
    cfg = get_preset("bench").model
    gen = SyntheticCriteo(cfg.table_sizes, seed=0)
    data = []
    for i in range(steps + 8):  # distinct batches: "+ids" sizes never repeat a step's
        blk = gen.block(0, i * batch, batch)
        data.append(
            (
                torch.from_numpy(blk.dense).float().to(DEV),
                torch.from_numpy(blk.cats).to(DEV),
                torch.from_numpy(blk.labels).float().to(DEV),
            )
        )
    rows = []
    for name in TRAIN_CONFIGS + (LARGEST_BATCH_CONFIGS if largest else []):
        sparse = SparseArch(cfg, range(cfg.n_tables), 0, RowOptimizer("rowwise_adagrad", 0.05))
        sparse = sparse.to(DEV)
        compute = torch.bfloat16 if name.endswith("+bf16") else None
        dense = DenseArch(cfg, 0, compute=compute).to(DEV)
        opt = torch.optim.SGD(dense.parameters(), lr=0.05)
        if name.endswith("+compile"):
            dense = torch.compile(dense)
        codec_name, direct = name.split("+")[0], name.startswith("direct")
        codec = get_codec("none" if direct else codec_name)

        def policy(codec: Any = codec) -> BoundPolicy:
            if not codec.error_bounded:
                return BoundPolicy()
            return DualBound(
                cfg.n_tables, {"tight": 0.01, "base": 0.03, "loose": 0.05}, probe_steps=2, every=0
            )

        ids_aware = name.endswith("+ids")
        ex = EmbeddingExchange(
            ShardPlan([0] * cfg.n_tables, 1),
            0,
            Direction("fwd", codec, policy()),
            Direction("bwd", codec, policy()),
            id_dedup=ids_aware,
            coalesce=ids_aware,
        )
        at = [0]

        def body(
            b: Batch,
            k: int,
            sparse: Any = sparse,
            dense: Any = dense,
            opt: Any = opt,
            ex: Any = ex,
            name: str = name,
        ) -> torch.Tensor:
            pooled = sparse(b.ids, checked=True)  # as the trainer: ids made for these tables
            emb = pooled if name.startswith("direct") else ex.start_forward(pooled, k, b.ids)
            loss = nn.functional.binary_cross_entropy_with_logits(dense(b.dense, emb), b.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()

        run = stepgraph.graphed(body, ex, 1) if name.endswith("+graph") else body

        def step(run: Any = run, at: list[int] = at) -> None:
            k = at[0]
            at[0] += 1
            run(Batch(*data[k % len(data)]), k)

        try:
            for _ in range(6):  # past the probe window, kernels compiled, graphs captured
                step()
            ms = timed(step, steps) * 1e3
        except Exception as e:  # one configuration failing keeps the others' numbers
            print(f"train b={batch} {name}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(
            {
                "config": name,
                "batch": batch,
                "step_ms": ms,
                "syncs_per_step": count_syncs(step),
            }
        )
        row = rows[-1]
        probes.append(lambda row=row, step=step: row.update(gpu_busy=gpu_busy(step, 5)))
        if name in ("none", "hybrid") and largest:
            probes.append(
                lambda row=row, step=step: row.update(
                    top_kernels=top_kernels(step, 15), top_host_ops=host_ops(step, 15)
                )
            )
    ms = {r["config"]: r["step_ms"] for r in rows}
    for r in rows:  # the ratio: over the same step with codec none both ways
        plain = next((x for x in ("+graph", "+compile", "+bf16") if r["config"].endswith(x)), "")
        nan = float("nan")  # where the base configuration failed
        r["step_ratio"] = r["step_ms"] / ms.get("none" + plain, nan)
        r["ratio_vs_direct"] = r["step_ms"] / ms.get("direct" + plain, nan)
    return rows


def host_ops(fn: Any, n: int) -> list[tuple[str, float, int]]:
    """The n operators one call of fn spends most host time in (name, self CPU
    microseconds, calls), torch profiler."""
    ev = sorted(profiled(fn, cuda=False).key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [(e.key[:60], e.self_cpu_time_total, e.count) for e in ev[:n]]


def gpu_busy(fn: Any, calls: int) -> float:
    """Share of the wall time of ``calls`` calls of fn in which a GPU kernel ran (kernel
    times summed, torch profiler; nan on the CPU)."""
    if DEV.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        wall = time.perf_counter() - t
    return sum(e.device_time for e in device_events(p)) / 1e6 / wall


def save_traffic(path: Path) -> int:
    """Real pooled embeddings (8192 samples x 26 tables x 64, the issue's step buffer) and
    the CPU ratio on them."""
    from bench_codecs import BenchConfig, real_model

    setup = real_model(dim=64)
    if setup is None:
        print("no real data (../shared/data) here")
        return 1
    model, src, opt = setup
    for s in range(BenchConfig().train_steps):
        b = src.train_batch(s, 32)
        loss = nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.ids), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pooled = torch.cat([model.sparse(src.train_batch(i, 2048).ids) for i in range(4)])
    ratios = {n: cpu_hybrid_ratio(pooled[:n]) for n in (2048, 8192)}
    # Each table's distinct rows and where each sample's row is among them: the same
    # values, a third of the bytes (it travels with the working tree, 64 MiB in all).
    distinct = [torch.unique(pooled[:, t], dim=0, return_inverse=True) for t in range(26)]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rows": [u.contiguous() for u, _ in distinct],
            "at": torch.stack([i.int() for _, i in distinct], 1),
            "cpu_hybrid_ratio": ratios,
        },
        path,
    )
    assert torch.equal(load_traffic(path)["pooled"], pooled)
    print(f"saved {tuple(pooled.shape)} to {path}; CPU hybrid ratios {ratios}")
    return 0


def load_traffic(path: Path) -> dict[str, Any]:
    """What :func:`save_traffic` wrote, the step buffer made whole again (``pooled``)."""
    saved = torch.load(path)
    at = saved["at"].long()
    saved["pooled"] = torch.stack([r[at[:, t]] for t, r in enumerate(saved["rows"])], 1)
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, batch 2048 only")
    ap.add_argument("--traffic", type=Path, help="real traffic saved by --save-traffic")
    ap.add_argument("--save-traffic", type=Path, help="capture real Criteo traffic and exit")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--batch", type=int, help="this batch size only")
    ap.add_argument("--sweep", action="store_true", help="also try the coder's launch shapes")
    ap.add_argument("--no-train", action="store_true", help="the codec only, no training step")
    args = ap.parse_args(argv)
    global DEV
    DEV = torch.device(args.device)
    if args.save_traffic:
        return save_traffic(args.save_traffic)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return 0
    repeats = 2 if DEV.type == "cpu" else 10 if args.quick else 50
    batches = [256] if DEV.type == "cpu" else [2048] if args.quick else [2048, 8192]
    batches = [args.batch] if args.batch else batches
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "eb_rel": REL,
    }
    real = load_traffic(args.traffic) if args.traffic and args.traffic.exists() else None
    rows: list[dict] = []
    probes: list = []
    printed = 0  # rows printed as they came
    result["codecs"] = rows
    result["train"] = []

    def save() -> None:
        """The rows so far (a check cut short by its time limit keeps them)."""
        for r in [*rows, *result["train"]]:
            r["device"] = result["device"]
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))

    for bs in batches:
        synth = synthetic_step(bs)
        rows += codec_rows(synth, "synthetic", repeats, cpu_hybrid_ratio(synth), probes)
        if real is not None and bs <= real["pooled"].shape[0]:
            cpu_ratio = real["cpu_hybrid_ratio"].get(bs, float("nan"))
            rows += codec_rows(real["pooled"][:bs], "real Criteo", repeats, cpu_ratio, probes)
        print_rows(rows[-(len(rows) - printed) :])
        printed = len(rows)
        if args.sweep:
            result.setdefault("sweep", []).extend(sweep_rows(synth, "synthetic", repeats))
        save()
    for bs in [] if args.no_train else batches:
        steps = 3 if DEV.type == "cpu" else 20
        largest = bs == max(batches) and DEV.type == "cuda"  # compiling on a CPU: minutes
        result["train"] += train_rows(bs, steps, probes, largest=largest)
        save()
    for run in probes:  # last: the profiler's hooks may slow whatever runs after it
        run()
        save()
    for r in result["train"]:
        print(
            f"train b={r['batch']:5} {r['config']:10} {r['step_ms']:8.2f} ms "
            f"x{r['step_ratio']:.3f} of none (x{r['ratio_vs_direct']:.3f} of direct) "
            f"syncs {r['syncs_per_step']} "
            f"GPU busy {r.get('gpu_busy', float('nan')):.2f}"
        )
    print_rows(rows)  # (again, the probes' columns with them)
    save()
    return 0


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"{r['data']:12} b={r['batch']:5} {r['codec']:17} enc {r['encode_gbps']:8.1f} "
            f"dec {r['decode_gbps']:8.1f} GB/s ratio {r['ratio']:6.2f}"
            + (
                f" (cpu {r['cpu_hybrid_ratio']:.2f}) err/eb {r['max_err_over_eb']:.3f} "
                f"syncs {r.get('syncs_per_step', '-')} launches {r.get('launches_encode', '-')}/"
                f"{r.get('launches_decode', '-')} break-even {r['break_even_gbit']:.0f} Gbit/s "
                f"same-bytes {r['same_bytes_as_cpu_reference']}"
                if "bounds_ms" in r
                else ""
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
