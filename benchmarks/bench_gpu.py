"""GPU measurements: the hybrid codec on CUDA tensors, and a one-GPU training step.

    python benchmarks/bench_gpu.py [--quick] [--traffic FILE] [--json-out PATH]
    python benchmarks/bench_gpu.py --save-traffic FILE   # on a machine with ../shared/data

1. Checks: a CUDA payload is format 2, has the same bytes as the device path run on the
   CPU (``coder="huffman"``), decodes to the same values, within the bound; host syncs
   per encode/decode are counted with torch's sync debug mode (the data never crosses).
2. Codec throughput on CUDA (per-table chunks of one batch, as the exchange codes them,
   and the same batch as one chunk under the median table's bound, to show how the
   per-chunk overhead amortizes), ratio beside the CPU hybrid codec on the same data.
3. One DLRM training step on one GPU (the ``bench`` preset, batch 2048): embedding
   outputs and their gradients go through the codec as the exchange would send them.

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

from recsz.codecs import get_codec
from recsz.data.synthetic import SyntheticCriteo
from recsz.model import DenseArch, RowOptimizer, SparseArch, get_preset
from recsz.policy import to_absolute

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEV = torch.device("cuda")


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


@functools.cache
def _device_codec(name: str) -> Any:
    """The codec as it runs on DEV (on the CPU, the device path is forced: a dry run)."""
    if DEV.type == "cpu" and name in ("hybrid", "quant", "quant+lz"):
        return get_codec(name, coder="huffman")
    return get_codec(name)


def _timed(fn: Any, repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up
    _sync()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        _sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def synth_chunks(dim: int, batch: int) -> list[torch.Tensor]:
    from bench_codecs import BenchConfig, synth_traffic

    return synth_traffic(dim, BenchConfig(synth_batch=batch))


def count_syncs(fn: Any) -> int:
    """Host synchronizations inside fn, as torch's sync debug mode reports them."""
    if DEV.type != "cuda":
        return -1
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def checks(chunks: list[torch.Tensor], rel: float) -> dict[str, Any]:
    # One configuration on both sides: the header carries it.
    gpu = get_codec("hybrid", coder="huffman")
    cpu = get_codec("hybrid", coder="huffman")
    same = bound = 0
    for c in chunks:
        eb = to_absolute(rel, "rel", c)
        pg = gpu.encode(c.to(DEV), eb)
        pc = cpu.encode(c, eb)
        same += int(torch.equal(pg.cpu(), pc) and int(pg[3]) == 2)
        yg = gpu.decode(pg)
        ok = yg.device.type == DEV.type and torch.equal(yg.cpu(), cpu.decode(pc))
        bound += int(ok and float((yg.cpu().double() - c.double()).abs().max()) <= eb)
    x = chunks[0].to(DEV)
    eb = to_absolute(rel, "rel", chunks[0])
    p = gpu.encode(x, eb)
    return {
        "chunks": len(chunks),
        "same_bytes_as_cpu": same,
        "decoded_equal_and_bounded": bound,
        "syncs_per_encode": count_syncs(lambda: gpu.encode(x, eb)),
        "syncs_per_decode": count_syncs(lambda: gpu.decode(p)),
    }


def _time_codec(
    codec: Any, chunks: list[torch.Tensor], ebs: list[float | None], repeats: int, batch: bool
) -> tuple[float, float, int]:
    """Median encode and decode seconds over all chunks, and the bytes sent: one call
    per chunk, or one call for all (``batch``: what the exchange does)."""
    if batch:
        t_enc, pays = _timed(lambda: codec.encode_batch(chunks, ebs), repeats)
        t_dec, _ = _timed(lambda: codec.decode_batch(pays), repeats)
    else:
        t_enc, pays = _timed(
            lambda: [codec.encode(c, b) for c, b in zip(chunks, ebs, strict=True)], repeats
        )
        t_dec, _ = _timed(lambda: [codec.decode(p) for p in pays], repeats)
    return t_enc, t_dec, sum(int(p.numel()) for p in pays)


def profile(chunks: list[torch.Tensor], rel: float) -> str:
    """Where a batched encode and decode of the chunks spend their time (torch profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    codec = _device_codec("hybrid")
    dev_chunks = [c.to(DEV) for c in chunks]
    ebs = [to_absolute(rel, "rel", c) for c in chunks]
    pays = codec.encode_batch(dev_chunks, ebs)
    codec.decode_batch(pays)
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    out = []
    for name, fn in [
        ("encode", lambda: codec.encode_batch(dev_chunks, ebs)),
        ("decode", lambda: codec.decode_batch(pays)),
    ]:
        with prof(activities=acts, with_stack=False) as p:
            fn()
            _sync()
        key = "self_cuda_time_total" if DEV.type == "cuda" else "self_cpu_time_total"
        out.append(f"== {name}\n" + p.key_averages().table(sort_by=key, row_limit=14))
        out.append(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    return "\n".join(out)


def codec_rows(chunks: list[torch.Tensor], data: str, rel: float, repeats: int) -> list[dict]:
    rows = []
    raw = sum(c.numel() * 4 for c in chunks)
    ebs: list[float | None] = [to_absolute(rel, "rel", c) for c in chunks]
    whole = torch.cat(chunks)
    eb_whole = statistics.median(e for e in ebs if e is not None)  # the typical table's
    dev_chunks = [c.to(DEV) for c in chunks]
    for name in ["hybrid", "quant+huffman", "quant", "fp16", "bf16", "none"]:
        codec = _device_codec(name)
        bounded = codec.error_bounded
        e = ebs if bounded else [None] * len(chunks)
        t_enc, t_dec, sent = _time_codec(codec, dev_chunks, e, repeats, batch=False)
        t_encb, t_decb, _ = _time_codec(codec, dev_chunks, e, repeats, batch=True)
        t_enc1, t_dec1, sent1 = _time_codec(
            codec, [whole.to(DEV)], [eb_whole if bounded else None], repeats, batch=False
        )
        rows.append(
            {
                "codec": name,
                "device": DEV.type,
                "data": data,
                "eb_rel": rel if bounded else None,
                "ratio": raw / sent,
                "encode_MBps": raw / 1e6 / t_enc,
                "decode_MBps": raw / 1e6 / t_dec,
                "encode_MBps_batched": raw / 1e6 / t_encb,
                "decode_MBps_batched": raw / 1e6 / t_decb,
                "ratio_one_chunk": raw / sent1,
                "encode_MBps_one_chunk": raw / 1e6 / t_enc1,
                "decode_MBps_one_chunk": raw / 1e6 / t_dec1,
            }
        )
    cpu = get_codec("hybrid")
    cpu.warm_up()
    t_enc, t_dec, sent = _time_codec(cpu, chunks, ebs, repeats, batch=False)
    rows.append(
        {
            "codec": "hybrid",
            "device": "cpu (1 thread)",
            "data": data,
            "eb_rel": rel,
            "ratio": raw / sent,
            "encode_MBps": raw / 1e6 / t_enc,
            "decode_MBps": raw / 1e6 / t_dec,
        }
    )
    return rows


class _Through(torch.autograd.Function):
    """Forward: each table's (B, D) slice through the codec; backward: its gradient."""

    @staticmethod
    def forward(ctx: Any, pooled: torch.Tensor, name: str, fwd: float, bwd: float) -> torch.Tensor:
        ctx.name, ctx.bwd = name, bwd
        return _roundtrip(pooled, name, fwd)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _roundtrip(grad, ctx.name, ctx.bwd), None, None, None


def _roundtrip(x: torch.Tensor, name: str, rel: float) -> torch.Tensor:
    """Every table's slice through the codec in one batched call, as the exchange would."""
    codec = _device_codec(name)
    chunks = [x[:, t].contiguous() for t in range(x.shape[1])]
    ebs = [to_absolute(rel, "rel", c) if codec.error_bounded else None for c in chunks]
    return torch.stack(codec.decode_batch(codec.encode_batch(chunks, ebs)), 1)


def train_rows(steps: int, batch: int) -> list[dict]:
    preset = get_preset("bench")
    cfg = preset.model
    gen = SyntheticCriteo(cfg.table_sizes, seed=0)
    blocks = [gen.block(0, i * batch, batch) for i in range(4)]
    data = [
        (
            torch.from_numpy(b.dense).float().to(DEV),
            torch.from_numpy(b.cats).to(DEV),
            torch.from_numpy(b.labels).float().to(DEV),
        )
        for b in blocks
    ]
    rows = []
    for name in ["none", "fp16", "hybrid"]:
        sparse = SparseArch(cfg, range(cfg.n_tables), 0, RowOptimizer("sgd", 0.05)).to(DEV)
        dense = DenseArch(cfg, 0).to(DEV)
        opt = torch.optim.SGD(dense.parameters(), lr=0.05)

        def step(
            k: int,
            sparse: SparseArch = sparse,
            dense: DenseArch = dense,
            opt: Any = opt,
            name: str = name,
        ) -> float:
            d, ids, y = data[k % len(data)]
            pooled = sparse(ids)
            if name != "none":
                pooled = _Through.apply(pooled, name, 0.03, 0.05)
            loss = nn.functional.binary_cross_entropy_with_logits(dense(d, pooled), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return float(loss.detach())

        for k in range(3):
            step(k)
        _sync()
        ts = []
        for k in range(steps):
            t = time.perf_counter()
            step(k)
            _sync()
            ts.append(time.perf_counter() - t)
        rows.append({"config": name, "batch": batch, "step_ms": 1e3 * statistics.median(ts)})
    base = rows[0]["step_ms"]
    for r in rows:
        r["vs_none"] = r["step_ms"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--traffic", type=Path, help="real traffic saved by --save-traffic")
    ap.add_argument("--save-traffic", type=Path, help="capture real Criteo traffic and exit")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--profile", type=Path, help="write a profile of batched hybrid here, exit")
    ap.add_argument("--batch", type=int, default=2048, help="samples per batch (synthetic, train)")
    args = ap.parse_args(argv)
    global DEV
    DEV = torch.device(args.device)
    if args.save_traffic:
        from bench_codecs import BenchConfig, real_traffic

        chunks = real_traffic(BenchConfig())
        if chunks is None:
            print("no real data (../shared/data) here")
            return 1
        torch.save([c.clone() for c in chunks], args.save_traffic)
        print(f"saved {len(chunks)} chunks to {args.save_traffic}")
        return 0
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return 0
    repeats = 1 if DEV.type == "cpu" else 5 if args.quick else 20
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    synth = synth_chunks(64, args.batch)
    if args.profile:
        args.profile.write_text(profile(synth, 0.03))
        print(args.profile.read_text()[-6000:])
        return 0
    real = torch.load(args.traffic) if args.traffic and args.traffic.exists() else None
    result["checks"] = checks(synth[:8] + (real[:8] if real else []), 0.03)
    print("checks:", json.dumps(result["checks"]))
    rows = codec_rows(synth, "synthetic d64 b2048", 0.03, repeats)
    if real:
        rows += codec_rows(real[:26], "real Criteo lookups", 0.03, repeats)
    result["codecs"] = rows
    result["train"] = train_rows(2 if DEV.type == "cpu" else 10 if args.quick else 30, args.batch)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    hdr = f"{'codec':14} {'device':15} {'data':22} {'ratio':>7} {'enc MB/s':>9} {'dec MB/s':>9}"
    print(hdr + f" {'batched enc':>11} {'dec':>7} {'1-chunk ratio':>13} {'enc':>7} {'dec':>7}")
    for r in rows:
        one = (
            f" {r['encode_MBps_batched']:11.0f} {r['decode_MBps_batched']:7.0f}"
            f" {r['ratio_one_chunk']:13.2f} {r['encode_MBps_one_chunk']:7.0f}"
            f" {r['decode_MBps_one_chunk']:7.0f}"
            if "ratio_one_chunk" in r
            else ""
        )
        print(
            f"{r['codec']:14} {r['device']:15} {r['data']:22} {r['ratio']:7.2f}"
            f" {r['encode_MBps']:9.0f} {r['decode_MBps']:9.0f}{one}"
        )
    for r in result["train"]:
        print(f"train step {r['config']:8} {r['step_ms']:8.2f} ms  ({r['vs_none']:.2f}x none)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
