"""The codec contract at the edges: random small tensors of every dtype, with values from
subnormal to each dtype's largest finite magnitude (and NaN/Inf), under bounds from 1e-45
to 3.4e38, through every codec.

    python benchmarks/bench_bounds.py [--bounded N] [--unbounded N] [--jobs J] [--json-out PATH]

A bounded codec must keep |x - x'| <= eb for every finite element, or refuse the bound with
a ValueError stating the accepted range, and send no more than the values stored and a
header (``oversized_payload`` in ``tests/common.py``; DCT's threshold excepted); every
codec must bring NaN/Inf back exactly and keep finite values finite. Counts violations
(0 is the only passing count) and refusals, per codec. The cases come from
``tests/common.py`` (``extreme_case``), which the unit tests run on a smaller sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recsz.codecs import available_codecs, get_codec  # noqa: E402
from tests.common import bound_violation, extreme_case  # noqa: E402


def run(job: tuple[str, int, int]) -> dict:
    name, n, seed = job
    codec = get_codec(name)
    rng = np.random.default_rng([seed, sum(name.encode())])
    bad: Counter[str] = Counter()
    refused = 0
    first = ""
    for _ in range(n):
        x, eb = extreme_case(rng)
        try:
            codec._validated(x, eb)
        except ValueError:
            refused += 1
        v = bound_violation(codec, x, eb)
        if v:
            bad[str(x.dtype)] += 1
            first = first or f"{x.dtype} {tuple(x.shape)} eb={eb!r}: {v}"
    return {"codec": name, "tensors": n, "violations": sum(bad.values()), "refused": refused,
            "by_dtype": dict(bad), "first": first}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounded", type=int, default=1_000_000, help="tensors over bounded codecs")
    ap.add_argument("--unbounded", type=int, default=200_000, help="over the others")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json-out", default="bench_out/bounds.json")
    a = ap.parse_args(argv)
    names = available_codecs()
    bounded = [n for n in names if get_codec(n).error_bounded]
    others = [n for n in names if n not in bounded]
    jobs = []
    for group, total in ((bounded, a.bounded), (others, a.unbounded)):
        per = -(-total // (len(group) * a.jobs))
        jobs += [(n, per, s) for n in group for s in range(a.jobs)]
    t = time.perf_counter()
    with ProcessPoolExecutor(a.jobs) as pool:
        parts = list(pool.map(run, jobs))
    rows: dict[str, dict] = {}
    for p in parts:
        r = rows.setdefault(p["codec"], {**p, "tensors": 0, "violations": 0, "refused": 0})
        for k in ("tensors", "violations", "refused"):
            r[k] += p[k] if r is not p else 0
        r["first"] = r["first"] or p["first"]
    print("| codec | bounded | tensors | violations | bound refused |\n|---|---|---|---|---|")
    for name in names:
        r = rows[name]
        print(
            f"| {name} | {name in bounded} | {r['tensors']} | {r['violations']} | {r['refused']} |"
        )
        if r["first"]:
            print(f"|   first: {r['first']} | | | | |")
    total = {
        k: sum(r[k] for r in rows.values() if r["codec"] in bounded)
        for k in ("tensors", "violations")
    }
    print(f"\nbounded codecs: {total['violations']} violations in {total['tensors']} tensors "
          f"({time.perf_counter() - t:.0f} s)")  # fmt: skip
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bounded_total": total, "rows": list(rows.values())}, indent=1))
    print(f"wrote {out}")
    return 1 if any(r["violations"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
