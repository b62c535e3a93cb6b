"""Format 3 on the CPU: the compiled coder (recsz.codecs.blockcpu) against the numpy
reference it replaced, and against format 1 (the CPU's own hybrid payloads), on one thread.

    python benchmarks/bench_blockcpu.py [--quick] [--json-out PATH]

A group is what one destination gets in a step: several tables' rows in one call, each
table under its own absolute bound (``rel`` x its range). Traffic:
- ``real``: pooled embeddings (dim 32) of a DLRM trained briefly on the real Criteo sample
  (``../shared/data``), a batch of 1024 samples of its 26 tables a group;
- ``synth``: the bench preset's tables (dim 64) at batch 2048, the generator's ids, one
  group of all 26 tables.
MB/s are of fp32 input, the median of the repeats; ratio: fp32 bytes over payload bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from bench_codecs import BenchConfig, real_traffic, synth_traffic  # noqa: E402
from results_io import write_results  # noqa: E402

from recsz.codecs import blockformat as bf  # noqa: E402
from recsz.codecs import get_codec  # noqa: E402
from recsz.policy import to_absolute  # noqa: E402
from tests import blockref  # noqa: E402

WAYS = ("format 1 (hybrid)", "format 3 compiled", "format 3 numpy (before)")


def groups_of(chunks: list[torch.Tensor], per: int) -> list[list[torch.Tensor]]:
    return [chunks[i : i + per] for i in range(0, len(chunks), per)]


def timed(f, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    ts, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def measure(way: str, groups: list[list[torch.Tensor]], rel: float, repeats: int) -> dict:
    ins = [(torch.cat(g), [c.shape[0] for c in g]) for g in groups]
    ebs = [
        torch.tensor([to_absolute(rel, "rel", c) for c in g], dtype=torch.float64) for g in groups
    ]
    dim = groups[0][0].shape[1]
    if way.startswith("format 3 numpy"):
        lays = [bf.Layout("hybrid", 0, dim, tuple(s), True) for _, s in ins]

        def enc():  # type: ignore[no-untyped-def]
            return [
                np.frombuffer(blockref.encode_group(lay, x.numpy(), e.numpy()), np.uint8)
                for lay, (x, _), e in zip(lays, ins, ebs, strict=True)
            ]

        def dec(ps):  # type: ignore[no-untyped-def]
            return [torch.from_numpy(blockref.decode_group(p)[1]) for p in ps]

        sizes = len
    else:
        codec = get_codec("hybrid", coder="blocks" if "format 3" in way else "auto")

        def enc():  # type: ignore[no-untyped-def]
            return [codec.encode_segments([g], e)[0][0] for g, e in zip(ins, ebs, strict=True)]

        def dec(ps):  # type: ignore[no-untyped-def]
            return [
                codec.decode_segments([p], [s], dim)[0] for p, (_, s) in zip(ps, ins, strict=True)
            ]

        sizes = torch.Tensor.numel
    dec(enc())  # warm up: numba loads its kernels
    t_enc, ps = timed(enc, repeats)
    t_dec, ys = timed(lambda: dec(ps), repeats)
    raw = sum(x.numel() * 4 for x, _ in ins)
    over = max(
        float(
            (
                (y.double() - x.double()).abs().amax(1)
                / torch.repeat_interleave(e, torch.tensor(s))
            ).max()
        )
        for y, (x, s), e in zip(ys, ins, ebs, strict=True)
    )
    return {
        "way": way,
        "eb_rel": rel,
        "ratio": raw / sum(sizes(p) for p in ps),
        "encode_MBps": raw / 1e6 / t_enc,
        "decode_MBps": raw / 1e6 / t_dec,
        "max_err_over_eb": over,
        "fp32_MB": raw / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="synthetic traffic, 2 repeats")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2048, help="the synthetic group's rows a table")
    ap.add_argument("--json-out", default="bench_out/blockcpu.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = BenchConfig(quick=a.quick, synth_batch=a.batch)
    traffic = {"synth": groups_of(synth_traffic(64, cfg), 26)}
    real = None if a.quick else real_traffic(cfg)
    if real is not None:
        traffic["real"] = groups_of(real, 26)
    repeats = 2 if a.quick else a.repeats
    rows = []
    for data, groups in traffic.items():
        for rel in (0.01, 0.03):
            for way in WAYS:
                r = {"data": data, **measure(way, groups, rel, repeats)}
                rows.append(r)
                print(
                    f"{data:6} rel {rel:<5} {way:24} ratio {r['ratio']:7.2f}  "
                    f"enc {r['encode_MBps']:8.1f} MB/s  dec {r['decode_MBps']:8.1f} MB/s  "
                    f"err/eb {r['max_err_over_eb']:.4f}",
                    flush=True,
                )
    table = ["| data | rel eb | way | ratio | encode MB/s | decode MB/s | max err / eb |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    table += [
        f"| {r['data']} | {r['eb_rel']} | {r['way']} | {r['ratio']:.2f} | "
        f"{r['encode_MBps']:.1f} | {r['decode_MBps']:.1f} | {r['max_err_over_eb']:.4f} |"
        for r in rows
    ]
    write_results(rows, a.json_out, "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
