"""A batch's distinct ids on the CPU, as id-aware traffic finds them every step: seconds.

    python benchmarks/bench_ids.py [--batches 1024,2048,16384] [--repeats 30] [--json-out ...]

``recsz.comm.ids.distinct_pairs`` of a (b, 26) slice of ids (the bench preset's tables): each
table's sorted distinct ids, each one's first position and every position's index among them
(``unique_first`` over keys ``table << 40 | id``), on the generator's ids and on the real
sample's (``../shared/data``, repeated to the batch), against the stable argsort it used
before the forty-first session (kept here as the reference: the same three arrays, checked
equal). A rank at W ranks finds 2 W - 1 such slices of b = B / W samples a step. Median of
``--repeats`` in one process, the ways in turn. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import write_results  # noqa: E402

from recsz.comm import ids as ids_module  # noqa: E402
from recsz.data import criteo  # noqa: E402
from recsz.data.source import make_source  # noqa: E402
from recsz.model import get_preset  # noqa: E402

SAMPLE = HERE.parents[1] / "shared" / "data" / "criteo_kaggle_head10k.tsv"


def stable_unique_first(col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``unique_first`` as it was: a stable argsort, a group's first entry its first id."""
    a = col.numpy()
    order = np.argsort(a, kind="stable")
    s = a[order]
    new = np.empty(len(a), dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    inv = np.empty(len(a), dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return torch.from_numpy(inv), torch.from_numpy(order[new]), torch.from_numpy(s[new])


def sources(batch: int) -> dict[str, torch.Tensor]:
    sizes = get_preset("bench").model.table_sizes
    out = {"synthetic": make_source("synthetic", sizes, 0).train_batch(0, batch).ids}
    if SAMPLE.exists():
        real = torch.from_numpy(criteo.read(SAMPLE, sizes).cats)  # (n, 26) ids
        out["real sample"] = real.repeat(-(-batch // len(real)), 1)[:batch]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1024,2048,16384")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json-out", default=str(HERE / "results" / "ids.json"))
    a = ap.parse_args(argv)
    ways = {"stable argsort (before)": stable_unique_first, "now": ids_module.unique_first}
    now, rows = ids_module.unique_first, []
    try:
        for batch in (int(b) for b in a.batches.split(",")):
            for data, ids in sources(batch).items():
                got, times = {}, {w: [] for w in ways}
                for _ in range(a.repeats):
                    for way, fn in ways.items():  # in turn
                        ids_module.unique_first = fn
                        t = time.perf_counter()
                        got[way] = ids_module.distinct_pairs(ids)
                        times[way].append(time.perf_counter() - t)
                ref, new = got["stable argsort (before)"], got["now"]
                same = torch.equal(ref.inverse, new.inverse) and torch.equal(ref.first, new.first)
                assert same and ref.counts == new.counts, (batch, data)
                ms = {w: 1e3 * statistics.median(t) for w, t in times.items()}
                before = ms["stable argsort (before)"]
                rows.append({"batch": batch, "data": data, "distinct": len(got["now"].first),
                             "before_ms": before, "now_ms": ms["now"],
                             "speedup": before / ms["now"]})  # fmt: skip
    finally:
        ids_module.unique_first = now
    head = "| ids | batch (x 26) | distinct | before | now | speedup |\n|---|---|---|---|---|---|\n"
    table = head + "".join(
        f"| {r['data']} | {r['batch']:,} | {r['distinct']:,} | {r['before_ms']:.2f} ms | "
        f"{r['now_ms']:.2f} ms | **{r['speedup']:.2f}x** |\n"
        for r in rows
    )
    write_results(rows, a.json_out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
