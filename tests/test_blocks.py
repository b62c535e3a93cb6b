"""Format 3 (bit-plane blocks, one payload per group of tables): the Triton kernels
(under ``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU) write the bytes of the numpy
reference, both decode within every bound, NaN/Inf come back exactly, damaged payloads
are rejected, and the exchange codes a step through it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.codecs import PayloadError, blockcoder, blockcpu, get_codec
from recsz.codecs import blockformat as bf
from recsz.codecs.blocks import decode_segments, encode_segments
from recsz.comm import EmbeddingExchange
from recsz.comm.direction import Direction
from recsz.comm.stats import ShardPlan
from recsz.policy import FixedBound, rangekernel
from recsz.policy.adaptive import DualBound
from recsz.policy.base import absolute_bounds, to_absolute
from tests import blockref
from tests.blockref import adversarial
from tests.common import bound_violation, extreme_case, run_without_host_sync
from tests.reference import one_bound, plan_indices

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: The kernels' work per program (and the range kernel's rows): the GPU's, the
#: interpreter's, and one so small that these tests' chunks cross many programs.
LAUNCHES = {
    "gpu": (blockcoder.GPU, rangekernel.GPU_ROWS),
    "wide": (blockcoder.WIDE, rangekernel.WIDE_ROWS),
    "tiny": (blockcoder.Launch(elems=64, blocks=2, rows=4, rows_b=8), 4),
}


@contextlib.contextmanager
def launched(name: str) -> Iterator[None]:
    """The kernels launched with ``LAUNCHES[name]`` (plans made afresh, before and after)."""
    saved = blockcoder.LAUNCH, rangekernel.ROWS
    blockcoder.LAUNCH, rangekernel.ROWS = LAUNCHES[name]
    blockcoder.clear_plans()
    try:
        yield
    finally:
        blockcoder.LAUNCH, rangekernel.ROWS = saved
        blockcoder.clear_plans()


def kernels(lays, xs, ebs, device):
    """Payloads by the Triton kernels (trimmed to their used length)."""
    xt = [torch.from_numpy(x).to(device) for x in xs]
    buf, base, used = blockcoder.encode(lays, xt, torch.from_numpy(ebs).to(device))
    return [buf[b : b + int(n)] for b, n in zip(base, used.tolist(), strict=True)]


def check_within(x: np.ndarray, y: np.ndarray, eb_row: np.ndarray) -> None:
    assert np.array_equal(np.isnan(x), np.isnan(y))
    inf = np.isinf(x)
    assert np.array_equal(x[inf], y[inf])
    fin = np.isfinite(x)
    err = np.abs(np.where(fin, y, 0).astype(np.float64) - np.where(fin, x, 0).astype(np.float64))
    assert (err <= eb_row[:, None]).all()


@pytest.mark.parametrize(
    ("device", "launch", "dim"),
    [("cpu", launch, dim) for launch in ("gpu", "wide") for dim in (1, 7, 16, 31, 32, 33, 64)]
    + [("cpu", "tiny", 7), ("cpu", "tiny", 33)]  # many programs a chunk: slow interpreted
    # a GPU compiles each launch and width anew: its own launch only
    + [("cuda", "gpu", dim) for dim in (1, 7, 16, 31, 32, 33, 64) if "cuda" in DEVICES],
)
@pytest.mark.parametrize("dedup", [True, False])
def test_kernels_write_the_reference_bytes_on_adversarial_groups(
    device: str, dim: int, dedup: bool, launch: str
) -> None:
    with launched(launch):
        adversarial_groups(device, dim, dedup)


def adversarial_groups(device: str, dim: int, dedup: bool) -> None:
    rng = np.random.default_rng(dim * 2 + dedup)
    seg_sets = [[9, 0, 23], [0], [1], [40]]  # empty groups and tables, one row, more
    lays, xs, ebl = [], [], []
    for segs in seg_sets:
        ebs = 10.0 ** rng.uniform(-4, 0, len(segs))
        parts = [adversarial(rng, n, dim, e) for n, e in zip(segs, ebs, strict=True)]
        xs.append(np.concatenate(parts) if parts else np.zeros((0, dim), np.float32))
        lays.append(bf.Layout("hybrid", 0, dim, tuple(segs), dedup))
        ebl.append(ebs)
    got = kernels(lays, xs, np.concatenate(ebl), device)
    for lay, x, ebs, p in zip(lays, xs, ebl, got, strict=True):
        ref = blockcpu.encode_group(lay, x, ebs)
        assert p.cpu().numpy().tobytes() == ref
        _, y, _ = blockcpu.decode_group(np.frombuffer(ref, np.uint8))
        check_within(x, y, np.repeat(ebs, lay.seg_rows))
    rows, _, ok = blockcoder.decode(got, lays)
    assert ok.all()
    for p, r in zip(got, rows, strict=True):
        _, y, _ = blockcpu.decode_group(p.cpu().numpy())
        assert np.array_equal(r.cpu().numpy().view(np.uint32), y.view(np.uint32))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_kernels_match_the_reference_on_random_extreme_chunks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, eb = extreme_case(rng)
    x = x.float().numpy()
    eb = min(max(eb, bf_eb_min()), 1e38)
    lay = bf.Layout("hybrid", 0, x.shape[1], (x.shape[0],), bool(rng.integers(2)))
    ebs = np.array([eb])
    with launched("tiny"):
        (p,) = kernels([lay], [x], ebs, "cpu")
    ref = blockcpu.encode_group(lay, x, ebs)
    assert p.numpy().tobytes() == ref
    _, y, _ = blockcpu.decode_group(np.frombuffer(ref, np.uint8))
    check_within(x, y, np.full(x.shape[0], eb))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 70), max_size=4), min_size=1, max_size=5),
    st.sampled_from([1, 7, 32, 33]),
    st.booleans(),
    st.sampled_from([16, 1024]),
)
def test_the_plan_kernel_derives_what_torch_does(
    groups: list[list[int]], dim: int, dedup: bool, per_program: int
) -> None:
    """One launch writes a plan's row, block and reference-block indices as the torch
    operations did (empty groups and segments, pad rows, programs' edges: 16 indices a
    program crosses many)."""
    from recsz.codecs import blockplan as bp

    lays = [bf.Layout("hybrid", 0, dim, tuple(segs), dedup) for segs in groups]
    base = np.cumsum([0] + [lay.capacity for lay in lays])[:-1].tolist()
    ends = [b + lay.capacity for b, lay in zip(base, lays, strict=True)]
    saved = bp.PLAN_ROWS
    bp.PLAN_ROWS = per_program
    try:
        p = bp.build(lays, base, ends, torch.device("cpu"))
    finally:
        bp.PLAN_ROWS = saved
    for name, want in plan_indices(p).items():
        got = p.t[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name


def bf_eb_min() -> float:
    return float(torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("dim", [5, 64])
def test_all_duplicate_rows_cost_little_and_decode_exactly(dim: int) -> None:
    """Every row the same (one run of 256 rows), and an all-zero table beside it like the
    pad rows: the kernels write the reference's bytes and read them back."""
    x = np.tile(np.linspace(-1, 1, dim, dtype=np.float32), (256, 1))
    x = np.concatenate([x, np.zeros((7, dim), np.float32)])
    lay = bf.Layout("hybrid", 0, dim, (256, 7), True)
    ebs = np.array([1e-3, 1e-3])
    p = blockcpu.encode_group(lay, x, ebs)
    assert len(p) < x.nbytes / 20
    _, y, _ = blockcpu.decode_group(np.frombuffer(p, np.uint8))
    assert (np.abs(y - x) <= 1e-3).all() and (y[:256] == y[0]).all()
    (got,) = kernels([lay], [x], ebs, "cpu")
    assert got.numpy().tobytes() == p
    (rows,), _, ok = blockcoder.decode([got], [lay])
    assert bool(ok.all()) and np.array_equal(rows.numpy(), y)


def test_decoding_another_buffer_of_the_same_layouts_uploads_nothing(monkeypatch) -> None:
    """Each payload buffer has its own decode plan (a graph reads one buffer), all sharing
    one upload of the layouts' indices: a new buffer (a CUDA graph's, under --cuda-graph)
    needs no host copy, which a capture could not hold; payloads at other places in a
    buffer need their places alone."""
    from recsz.codecs import blockplan as bp
    from recsz.codecs import payload

    blockcoder.clear_plans()
    x = np.tile(np.linspace(-1, 1, 8, dtype=np.float32), (40, 1))
    lay = bf.Layout("hybrid", 0, 8, (24, 16), True)
    (got,) = kernels([lay], [x], np.array([1e-3, 1e-2]), "cpu")
    builds = []
    real = bp.build
    monkeypatch.setattr(bp, "build", lambda *a, **kw: builds.append(a) or real(*a, **kw))
    first = blockcoder.decode([got], [lay])[0][0].clone()
    again = blockcoder.decode([got.clone()], [lay])[0][0]
    assert len(builds) == 1 and torch.equal(first, again)
    # elsewhere in a buffer (as received payloads sit anew each step): no plan made again
    room = torch.zeros(12 + len(got) + -len(got) % 4, dtype=torch.uint8)
    moved = room[12 : 12 + len(got)]
    moved.copy_(got)
    assert blockcoder.common_buffer([moved])[1] == [12]
    (rows,), _, ok = blockcoder.decode([moved], [lay])
    assert torch.equal(rows, first) and bool(ok.all()) and len(builds) == 1
    moved[len(moved) // 2] ^= 1  # and its checks read it where it now is
    assert not bool(blockcoder.decode([moved], [lay])[2].all())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        payload.upload([1, 2], torch.int64, torch.device("cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eb", [0.3828125, 0.011962890625])
def test_exact_ties_where_a_multiply_rounds_otherwise(device: str, eb: float) -> None:
    """x / 2eb exactly k + 1/2 where x * (0.5 / eb) rounds below it (eb = 49 x 2^-7, 49 x
    2^-12: the inverse is inexact): codes as the reference's division makes them. (A
    multiply with a division for near-ties only measured slower on the H100, not kept.)"""
    k = np.arange(-96, 96, dtype=np.float64)
    x = ((k + 0.5) * 2 * eb).astype(np.float32).reshape(-1, 4)
    assert np.array_equal(x.astype(np.float64).ravel(), (k + 0.5) * 2 * eb)  # exact ties
    x64 = x.astype(np.float64)
    assert (np.floor(x64 * (0.5 / eb) + 0.5) != np.floor(x64 / (2 * eb) + 0.5)).any()
    lay = bf.Layout("hybrid", 0, 4, (len(x),), False)
    (got,) = kernels([lay], [x], np.array([eb]), device)
    assert got.cpu().numpy().tobytes() == blockcpu.encode_group(lay, x, np.array([eb]))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_one_hash_but_other_bits_stay_literal(device: str) -> None:
    """Rows whose keys collide (same segment, same 32-bit hash, other bits): each copies
    only the key's first row, and only where its bits equal that row's, as the reference."""
    rng = np.random.default_rng(11)
    dim = 4
    a = rng.integers(0, 1 << 20, dim).astype(np.uint32) | np.uint32(0x3F000000)
    m = bf.HASH_MULT[:dim].astype(object) % (1 << 32)
    d1 = 12345
    d2 = (-d1 * m[0] * pow(int(m[1]), -1, 1 << 32)) % (1 << 32)
    b = a.copy()
    b[0] = (int(a[0]) + d1) % (1 << 32)
    b[1] = (int(a[1]) + d2) % (1 << 32)
    c = rng.integers(0, 1 << 20, dim).astype(np.uint32) | np.uint32(0x3F000000)
    bits = np.stack([b, a, a, b, c, a, b])
    x = bits.view(np.float32)
    piece = np.zeros(len(x), np.int64)
    ref_dup = blockref.duplicates(bits.view(np.int32), piece, np.ones(len(x), bool))
    assert ref_dup.tolist() == [-1, -1, -1, 0, -1, -1, 0]  # a and b collide; a never copies
    lay = bf.Layout("hybrid", 0, dim, (len(x),), True)
    ebs = np.array([1e-3])
    (got,) = kernels([lay], [x], ebs, device)
    assert got.cpu().numpy().tobytes() == blockcpu.encode_group(lay, x, ebs)


@pytest.mark.parametrize("device", DEVICES)
def test_damaged_payloads_are_rejected(device: str) -> None:
    rng = np.random.default_rng(5)
    x = adversarial(rng, 20, 16, 0.01)
    lay = bf.Layout("hybrid", 0, 16, (12, 8), True)
    good = blockcpu.encode_group(lay, x, np.array([0.01, 0.02]))
    c = get_codec("hybrid", coder="blocks")
    for i in range(0, len(good), 7):
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        t = torch.frombuffer(bad, dtype=torch.uint8).to(device)
        with pytest.raises(PayloadError):
            decode_segments([t], "hybrid", [lay] if i % 2 else None)
        with pytest.raises(PayloadError):
            c.decode(t)
        # The kernels' checks, on whichever device: every flip in the header and widths,
        # one in three in the data (interpreted on the CPU: 0.15 s a payload).
        if i < lay.data_at(0) + 8 or device != "cpu" or i % 3 == 0:
            assert not kernel_flags(t, lay)
    for cut in (0, 7, 40, len(good) - 4):
        t = torch.tensor(list(good[:cut]), dtype=torch.uint8).to(device)
        with pytest.raises(PayloadError):
            decode_segments([t], "hybrid", [lay])
        assert not kernel_flags(t, lay)
    other = get_codec("quant", coder="blocks")
    with pytest.raises(PayloadError, match="made by codec"):
        other.decode(torch.frombuffer(bytearray(good), dtype=torch.uint8).to(device))


def kernel_flags(t: torch.Tensor, lay: bf.Layout) -> bool:
    """The kernels' verdict: False when a check flags the payload or it is refused."""
    try:
        _, _, ok = blockcoder.decode([t], [lay])
    except PayloadError:
        return False
    return bool(ok.all())


@pytest.mark.parametrize("device", DEVICES)
def test_untrimmed_payloads_decode_like_trimmed_ones(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(10, 8, generator=g).to(device), torch.randn(3, 8, generator=g).to(device)]
    ebs = torch.tensor([0.01, 0.1, 0.05], dtype=torch.float64, device=device)
    groups = [(xs[0], [4, 6]), (xs[1], [3])]
    full, used = encode_segments("hybrid", True, groups, ebs, trim=False)
    cut, _ = encode_segments("hybrid", True, groups, ebs, trim=True)
    assert [p.numel() for p in cut] == used.tolist()
    for a, b in zip(decode_segments(full, "hybrid"), decode_segments(cut, "hybrid"), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_trimmed_payloads_outlive_the_next_call_of_their_shapes(device: str, monkeypatch) -> None:
    """Shapes that repeat replay the coder's CUDA graph, whose buffers the next call
    reuses: trimmed payloads (what leaves a rank) are copies, still the reference's bytes
    after later calls (on the CPU: the same kernels, under the interpreter)."""
    from recsz.codecs import blocks

    monkeypatch.setattr(blocks, "_kernels", lambda dev: True)
    g = torch.Generator().manual_seed(0)
    ebs = torch.tensor([0.01, 0.1, 0.05], dtype=torch.float64)
    lays = blocks.layouts("hybrid", 8, [[4, 6], [3]], True)
    sent = []
    for _ in range(5):
        xs = [torch.randn(10, 8, generator=g), torch.randn(3, 8, generator=g)]
        xs[0][6:] = xs[0][2]  # repeated rows: references
        groups = [(xs[0].to(device), [4, 6]), (xs[1].to(device), [3])]
        sent.append((xs, encode_segments("hybrid", True, groups, ebs.to(device))[0]))
    for xs, payloads in sent:
        refs = [blockcpu.encode_group(lays[0], xs[0].numpy(), ebs[:2].numpy()),
                blockcpu.encode_group(lays[1], xs[1].numpy(), ebs[2:].numpy())]  # fmt: skip
        assert [p.cpu().numpy().tobytes() for p in payloads] == refs


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_codecs_on_format_3_keep_every_bound(seed: int) -> None:
    x, eb = extreme_case(np.random.default_rng(seed))
    assert bound_violation(get_codec("hybrid", coder="blocks"), x.float(), eb) is None


@pytest.mark.filterwarnings("ignore:absolute error bound")  # random data: tiny ranges warn
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["abs", "rel"]))
def test_device_bounds_equal_the_host_ones(seed: int, mode: str) -> None:
    x, _ = extreme_case(np.random.default_rng(seed))
    x = x.float()
    if not x.numel():
        return
    t = torch.stack([x, x * 2, torch.full_like(x, 3.0)])
    with launched("tiny"):
        got = absolute_bounds([0.01, 0.02, 0.5], mode, t).tolist()

    def plain(f: float, v: torch.Tensor) -> float:  # the rule, in float64 on the host
        if mode == "abs":
            return min(f, 1e38)
        a = v.double().numpy()
        a = a[np.isfinite(a)]
        r = float(a.max() - a.min()) if a.size else 0.0
        r = r if r > 0 else float(np.abs(a).max()) if a.size else 0.0
        r = r if np.isfinite(r) else 0.0
        return min(max(f * r, 1e-30), 1e38)

    assert got == [plain(f, v) for f, v in zip([0.01, 0.02, 0.5], t, strict=True)]


def test_dual_policy_bounds_equal_its_per_table_bounds() -> None:
    p = DualBound(
        n_tables=3,
        class_eb={"tight": 0.01, "base": 0.03, "loose": 0.05},
        decay_t=10,
    )
    p.classes[1] = "loose"
    x = torch.randn(3, 40, 8)
    assert p.bounds([0, 1, 2], 3, x).tolist() == [one_bound(p, t, 3, x[t]) for t in range(3)]


# ---- the exchange through format 3 ----------------------------------------------------
def one_rank(**kw: bool) -> EmbeddingExchange:
    return EmbeddingExchange(
        ShardPlan([0, 0, 0], 1),
        0,
        Direction("fwd", get_codec("hybrid", coder="blocks"), FixedBound(0.05, "rel")),
        Direction("bwd", get_codec("hybrid", coder="blocks"), FixedBound(0.05, "rel")),
        **kw,
    )


@pytest.mark.parametrize("ids_aware", [False, True])
def test_exchange_codes_groups_within_their_bounds_both_ways(ids_aware: bool) -> None:
    ex = one_rank(check_bounds=True, id_dedup=ids_aware, coalesce=ids_aware)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (32, 3), generator=g)
    table = torch.randn(3, 6, 4, generator=g)
    pooled = torch.stack([table[t, ids[:, t]] for t in range(3)], 1).requires_grad_()
    emb = ex.start_forward(pooled, 0, ids).wait()
    for t in range(3):
        eb = to_absolute(0.05, "rel", pooled.detach()[:, t])
        assert float((emb.detach()[:, t] - pooled.detach()[:, t]).abs().max()) <= eb
    (emb * torch.randn_like(emb)).sum().backward()
    assert pooled.grad is not None and pooled.grad.shape == pooled.shape
    assert ex.stats.ratio("fwd") > 1 and 0 < ex.stats.max_err["fwd"] <= 1
    assert set(ex.stats.last_eb["fwd"]) == {0, 1, 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_one_gpu_exchange_step_never_syncs_the_host() -> None:
    """World size 1 on a GPU: bounds, encode, decode, both directions, no host sync."""
    classes = {"tight": 0.01, "base": 0.03, "loose": 0.05}

    def direction(name: str) -> Direction:
        return Direction(name, get_codec("hybrid"), DualBound(3, classes, probe_steps=0, every=0))

    ex = EmbeddingExchange(ShardPlan([0, 0, 0], 1), 0, direction("fwd"), direction("bwd"))
    ids = torch.randint(0, 6, (64, 3), device="cuda")
    pooled = torch.randn(64, 3, 16, device="cuda", requires_grad=True)

    def step(k: int) -> None:
        emb = ex.start_forward(pooled, k, ids).wait()
        (emb * emb).sum().backward()

    run_without_host_sync(step)
    assert ex.stats.ratio("fwd") > 1


def test_kernels_compile_for_a_hopper_gpu() -> None:
    """The interpreter accepts code that compiled Triton refuses (globals, intrinsics):
    compile every kernel for sm_90 here, with Triton's own ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.compile_kernels"], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_groups_of_narrow_dtypes_decode_in_the_format_they_were_coded_in(
    dtype: torch.dtype,
) -> None:
    """encode_segments and decode_segments choose the group format the same way, whatever
    the rows' dtype (fp16 groups were once coded framed and read as format 3)."""
    c = get_codec("hybrid", coder="blocks")
    x = (torch.randn(30, 8, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
    ebs = torch.tensor([1e-2, 2e-2], dtype=torch.float64)
    (p,), _ = c.encode_segments([(x, [10, 20])], ebs)
    assert int(p[3]) == 3
    (y,) = c.decode_segments([p], [[10, 20]], 8)
    err = (y.double() - x.double()).abs()
    assert float(err[:10].max()) <= 1e-2 and float(err[10:].max()) <= 2e-2


@pytest.mark.parametrize("dim", [7, 64])
def test_kernels_keep_equal_rows_of_different_segments_apart(dim: int) -> None:
    """Rows equal across segments and groups (one hash), zero rows beside the zero pad
    rows: the device sorts hashes alone, so segments must split the runs as the
    reference's (segment, hash) keys do."""
    rng = np.random.default_rng(dim)
    row = rng.standard_normal(dim).astype(np.float32)
    lays, xs, ebl = [], [], []
    for segs in ([5, 3, 4], [2, 6]):
        x = rng.standard_normal((sum(segs), dim)).astype(np.float32)
        x[::2] = row  # the same row in every segment of both groups
        x[1::3] = 0.0  # zero rows, as the pad rows are
        lays.append(bf.Layout("hybrid", 0, dim, tuple(segs), True))
        xs.append(x)
        ebl.append(np.full(len(segs), 1e-3))
    got = kernels(lays, xs, np.concatenate(ebl), "cpu")
    for lay, x, ebs, p in zip(lays, xs, ebl, got, strict=True):
        assert p.numpy().tobytes() == blockcpu.encode_group(lay, x, ebs)
