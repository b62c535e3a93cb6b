"""The plain torch quantizer that the fused CPU kernels (recsz.codecs.kernels) are held to,
value for value (tests/test_kernels.py); its own properties: tests/test_stages.py. And
one table's bound from a policy (the trainer asks for many tables at once), and MLPerf's
reference's bags."""

from __future__ import annotations

import numpy as np
import torch

from recsz.codecs import blockformat as bf
from recsz.codecs import blockplan as bp
from recsz.codecs import kernels
from recsz.policy import BoundPolicy


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def bound_below(eb: float, wd: torch.dtype) -> torch.Tensor:
    """The largest value of dtype ``wd`` that is <= eb (comparisons against it are safe)."""
    t = torch.tensor(eb, dtype=wd)
    if float(t) > eb:
        t = torch.nextafter(t, torch.zeros_like(t))
    return t


def quantize(x: torch.Tensor, eb: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q = round(x / (2 eb)) and the flat positions that must travel exactly.

    Computed in float32 (float64 for float64 input) for speed. Whatever that can get
    wrong — a code off by one near a rounding boundary, a reconstruction that rounds an
    ulp beyond eb, a code too large to be exact — shows in the check of every
    reconstruction: ``|x' - x| >= eb_w`` with eb_w the largest working value <= eb. A
    true error above eb can never compute below eb_w (rounding is monotonic), so every
    element that would miss the bound is caught; such elements (rare: the check is
    conservative by at most an ulp) are returned as outliers and travel exactly.

    Args:
        x: finite (N, D) float tensor.
        eb: absolute error bound, > 0.
    Returns:
        codes (N, D) int32 (0 at outliers), outlier positions (K,) int64 into x.view(-1).
    """
    wd = work_dtype(x.dtype)
    qmax = kernels.QMAX64 if wd == torch.float64 else kernels.QMAX32  # beyond: outliers
    xs = x if x.dtype == wd else x.to(wd)
    q = torch.mul(xs, 1.0 / (2.0 * eb)).round_().clamp_(-qmax, qmax)
    y = dequantize(q, eb, x.dtype)
    if y.dtype != wd:
        y = y.to(wd)
    bad = y.sub_(xs).abs_().ge_(bound_below(eb, wd)).view(-1)
    codes = q.to(torch.int32)
    if bool(bad.any()):
        pos = torch.nonzero(bad).view(-1)
        codes.view(-1)[pos] = 0
        return codes, pos
    return codes, torch.zeros(0, dtype=torch.int64, device=x.device)


def dequantize(q: torch.Tensor, eb: float, dtype: torch.dtype) -> torch.Tensor:
    """x' = q * 2 eb in the working precision, rounded once to ``dtype``.

    Encoder and decoder run this same computation (an integral float times the same
    rounded step; IEEE multiplication is exactly rounded on every device), so the
    encoder's check of every reconstruction is a check of what the decoder produces.
    """
    wd = work_dtype(dtype)
    y = torch.mul(q if q.dtype == wd else q.to(wd), torch.tensor(2.0 * eb, dtype=wd))
    return y if dtype == wd else y.to(dtype)


def one_bound(policy: BoundPolicy, table: int, step: int, x: torch.Tensor) -> float | None:
    """One table's bound as a float: the policy's ``bounds`` of that table alone."""
    b = policy.bounds([table], step, x.unsqueeze(0))
    return None if b is None else float(b[0])


def plan_indices(p: bp.Plan) -> dict[str, torch.Tensor]:
    """The per-row and per-block indices ``blockplan.build`` derives for plan ``p``, in
    torch operations: each row's index, group, segment (-1: pad), its piece's first row and
    reference slot; each block's and each reference block's group."""
    t, rows = p.t, p.rows
    r = torch.arange(rows, device=p.dev)
    groups = torch.arange(p.g, device=p.dev)
    rgroup = bp.group_of(t["npad"], rows)
    counts = torch.diff(t["pfirst"], append=t["pfirst"].new_tensor([rows]))  # rows a piece

    def spread(v: torch.Tensor, n: torch.Tensor, total: int) -> torch.Tensor:
        return torch.repeat_interleave(v, n, output_size=total)

    return {
        "arange": r,
        "rgroup": rgroup.to(torch.int32),
        "rseg": spread(t["pseg"], counts, rows).to(torch.int32),
        "rfirst": spread(t["pfirst"], counts, rows),
        "rslot": t["rb0"][rgroup] * bf.LANES + r - t["row0"][rgroup],
        "bgid": spread(groups, t["nb"], p.blocks).to(torch.int32),
        "refg": spread(groups, t["nrb"], p.ref_blocks).to(torch.int32),
    }


def reference_bags(sizes: tuple[int, ...], hotness: tuple[int, ...]) -> list[np.ndarray]:
    """MLPerf's reference's one-hot-to-multi-hot tables as its ``Multihot`` makes them
    (uniform): numpy's global generator seeded 0, each table's ids then its draws."""
    np.random.seed(0)
    out = []
    for rows, h in zip(sizes, hotness, strict=True):
        drawn = np.random.randint(0, rows, size=(rows, h - 1))
        out.append(np.concatenate((np.arange(rows)[:, None], drawn), axis=-1))
    return out
