"""A table's initial weights, made where the table lives.

Uniform in +-sqrt(1/rows), as facebookresearch/dlrm starts its tables. Each value is a hash
of (seed, table, row, column) (splitmix64 over the element's place), not a generator's next
draw, so a table's start depends on nothing but (seed, table): not on which rank owns it,
how its columns are split into shards (a shard makes only its columns), how many rows are
made at once, or the device. On the CPU a compiled loop, blocks of rows on as many threads
as torch uses (Python threads: the loop releases the GIL; not numba's ``parallel=True``,
whose OpenMP runtime, a second one beside torch's, kept a thread spinning through every
step after the tables were made: 2 ranks on 2 cores trained 4x slower); on a GPU (and on
the CPU's device path, `RECSZ_DEVICE_PATH_ON_CPU=1`) torch's integer operations on the
table's own memory, so a GPU's tables never pass through the host. Both write the same bits
(tested against each other and a numpy reference): the integer steps are exact, and the
float steps are one float32 multiply and one subtract, each correctly rounded everywhere.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from recsz.devicepath import device_path

#: rows made at a time: the torch path's int64 temporaries stay ~70 MB at dim 128
INIT_ROWS = 1 << 16

_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
#: the hash's top 24 bits make a float32 in [0, 1) exactly
_UNIT = 2.0**-24


def _splitmix(x: int) -> int:
    """splitmix64's finalizer of one uint64 (Python's exact integers)."""
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    return x ^ (x >> 31)


def table_key(seed: int, table: int) -> int:
    """The uint64 every value of table ``table`` under ``seed`` is hashed with."""
    return _splitmix((seed * 1_000_003 + table) & _MASK)


def _signed(x: int) -> int:
    """A uint64 as the int64 of the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >> 63 else x


def init_table(
    rows: int,
    dim: int,
    seed: int,
    table: int,
    columns: slice = slice(None),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The initial weights of table ``table`` (``rows`` x ``dim``), its ``columns`` only (a
    column shard's), written into ``out`` (rows x the columns, any float dtype and device:
    each value rounded to its dtype once) or a new float32 CPU tensor."""
    cols = range(dim)[columns]
    if cols.step != 1:
        raise ValueError(f"columns {columns}: a table's columns are a contiguous range")
    if out is None:
        out = torch.empty(rows, len(cols))
    if tuple(out.shape) != (rows, len(cols)):
        raise ValueError(f"out is {tuple(out.shape)}, the table's columns {(rows, len(cols))}")
    bound = (1.0 / rows) ** 0.5  # the float32 steps' two constants, both paths':
    scale, lo = np.float32(2 * bound * _UNIT), np.float32(bound)
    key = table_key(seed, table)
    compiled = not device_path(out.device)

    def made(a: int) -> None:  # rows a .. a + INIT_ROWS
        dst = out[a : a + INIT_ROWS]
        if compiled:
            direct = dst.dtype == torch.float32 and dst.is_contiguous()
            block = dst if direct else torch.empty(dst.shape)
            _fill(block.detach().numpy(), a, dim, cols.start, np.uint64(key), scale, lo)
        else:
            block = _values(a, len(dst), dim, cols, key, scale, lo, out.device)
        if block is not dst:
            dst.copy_(block)

    starts = range(0, rows, INIT_ROWS)
    # as many threads as torch's (torchrun: 1 a rank where a host has several)
    threads = min(torch.get_num_threads(), len(starts)) if compiled else 1
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="recsz-tableinit") as pool:
            list(pool.map(made, starts))
    else:
        for a in starts:
            made(a)
    return out


def _values(
    row0: int, n: int, dim: int, cols: range, key: int, scale: np.float32, lo: np.float32,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Rows ``row0 .. row0 + n`` (float32, the columns ``cols``) by torch's operations on
    ``device``: int64 arithmetic wraps as uint64's does; shifts are made logical by masks."""
    at = torch.arange(row0, row0 + n, dtype=torch.int64, device=device).mul_(dim).unsqueeze(1)
    x = at + torch.arange(cols.start, cols.stop, dtype=torch.int64, device=device)
    x.mul_(_signed(_GOLDEN)).add_(_signed(key))
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        x ^= (x >> shift) & ((1 << (64 - shift)) - 1)
        x.mul_(_signed(mult))
    x ^= (x >> 31) & ((1 << 33) - 1)
    top = ((x >> 40) & 0xFFFFFF).float()  # exact: 24 bits
    # float32 steps, each rounded once (the scalars are float32 in torch's kernels)
    return top.mul_(float(scale)).sub_(float(lo))


@njit(cache=True, nogil=True)
def _fill(
    out: np.ndarray, row0: int, dim: int, col0: int, key: np.uint64, scale: np.float32,
    lo: np.float32,
) -> None:  # fmt: skip
    """The compiled :func:`_values`, written into ``out`` (float32, rows x columns)."""
    n, c = out.shape
    for i in range(n):
        first = np.uint64((row0 + i) * dim + col0)
        for j in range(c):
            x = (first + np.uint64(j)) * np.uint64(_GOLDEN) + key
            x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX1)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX2)
            x = x ^ (x >> np.uint64(31))
            out[i, j] = np.float32(x >> np.uint64(40)) * scale - lo
