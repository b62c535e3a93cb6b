"""What it takes to start a rank's tables: peak host memory and seconds.

    python benchmarks/bench_init.py [--rows 4000000] [--dim 128] [--json-out ...]

Each case builds one ``SparseArch`` in a fresh process (its peak resident memory from
``getrusage``, less the same process's before it built anything) holding one table of
``--rows`` x ``--dim``: whole in float32 (the floor: the rows themselves), whole in float16,
and one column shard of 4 (what a rank of ``--column-shards 4`` holds of MLPerf's large
tables). The rows' own bytes are the least any start can take. To compare a revision, run
this script with ``PYTHONPATH=<its checkout>/src`` (the cases import that recsz; the
``recsz`` column says which). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

CASES = {  # name -> (dtype, column shards)
    "whole, fp32": ("float32", 1),
    "whole, fp16": ("float16", 1),
    "1 shard of 4, fp32": ("float32", 4),
}

_CHILD = """
import json, resource, sys, time
import torch
import recsz
from recsz.model import ModelConfig, SparseArch
rows, dim, k = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
dtype = getattr(torch, sys.argv[3])
cfg = ModelConfig((rows,), dim, bottom_mlp=(dim,), top_mlp=(1,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
kw = {"dtype": dtype} if dtype != torch.float32 else {}
s = SparseArch(cfg, [0], 0, None, shards=k, **kw)
secs = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
held = s.weight.numel() * s.weight.element_size()
print(json.dumps({"peak_gb": (peak - before) / 2**20, "held_gb": held / 2**30, "s": secs,
                  "recsz": str(recsz.__file__)}))
"""


def case(name: str, rows: int, dim: int) -> dict:
    dtype, k = CASES[name]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(rows), str(dim), dtype, str(k)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"case": name, "rows": rows, "dim": dim, **got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--json-out", default=str(HERE / "results" / "init.json"))
    args = ap.parse_args(argv)
    rows = [case(name, args.rows, args.dim) for name in CASES]
    lines = ["| case | rows held (GB) | peak to start (GB) | peak / held | seconds |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['case']} | {r['held_gb']:.2f} | {r['peak_gb']:.2f} | "
                     f"{r['peak_gb'] / r['held_gb']:.2f} | {r['s']:.1f} |")  # fmt: skip
    where = rows[0]["recsz"]
    head = f"One table of {args.rows:,} x {args.dim}, started in a fresh process ({where})\n\n"
    write_results(rows, args.json_out, head + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
