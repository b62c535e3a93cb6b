"""The GPU's path on the CPU (RECSZ_DEVICE_PATH_ON_CPU), step by step: what would make a
GPU wait for its host (a value read back, an output sized by values) and what a CUDA graph
could not replay (an upload), counted by :mod:`tests.hostreads` without a GPU. The GPU tests
check the same with torch's sync debug mode where a GPU is lent (gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from recsz.codecs import checks
from recsz.codecs.payload import PayloadError
from recsz.data.source import make_source
from recsz.devicepath import DEVICE_PATH_ON_CPU
from recsz.model import get_preset
from recsz.model.rowopt import sum_by_row
from recsz.step import train_step
from tests.common import trainer_parts
from tests.hostreads import counting, mark, on_device


def test_the_count_sees_each_kind_of_host_read() -> None:
    g = torch.Generator().manual_seed(0)
    x, host = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    with counting([x]) as c:
        float(host.sum()), host.tolist(), host[host > 0], torch.unique(host)  # host: free
        assert c.total() == 0
        y = x * 2  # made from the device's: the device's
        float(y.sum())  # item
        y.tolist()
        y[y > 0]  # sized by a mask
        y[:, [0, 2]]  # a host index, copied to the device
        i = torch.tensor([0, 2], device=y.device)  # host values copied to the device
        y[:, i]  # an index on the device: free
        torch.unique(y)
        buf = torch.zeros(8, 4)
        buf.copy_(x)  # written with the device's
        buf.numpy()
        sum_by_row(torch.tensor([3, 1, 3]), y[:3], keep_size=False)  # the host's rows: free
        sum_by_row(y[:3, 0].long(), y[:3], keep_size=False)  # unique_consecutive
    kinds = {"_local_scalar_dense", "_unique2", "unique_consecutive", "index", "numpy", "tolist"}
    kinds.add("tensor(host values, device=)")
    assert {w for w, _ in c.reads} == kinds
    assert c.total() == 8
    assert "rowopt.py" in c.report()  # where, in recsz


def test_the_count_sees_what_would_launch_on_a_gpu() -> None:
    """Operations on the device's tensors and Triton kernels are launches; views,
    allocations and host tensors' operations are not."""
    from recsz.codecs import blockkernels

    x, host = torch.randn(8, 4), torch.randn(8, 4)
    first, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([32])
    with counting([x]) as c:
        host + 1, host.sum()  # the host's: none
        words = x.view(32)[:16].view(torch.int32)  # views: none
        torch.empty_like(x)  # an allocation: none
        y = x * 2 + 1  # two
        torch.zeros(3, device=x.device)  # made there: one
        out = torch.zeros(1, dtype=torch.int32)  # the host's: none
        blockkernels.word_sum_kernel[(1, 1)](words, first, lens, out, 16)  # a kernel: one
    assert y.shape == x.shape and out.item() != 0
    assert c.launches == {"mul": 1, "add": 1, "zeros": 1, "word_sum_kernel": 1}


def test_held_verdicts_ride_on_the_next_read_of_sizes() -> None:
    """Verdicts held by HeldChecks cost no read until one is made anyway: the sizes read
    inside ``riding`` reads them along (one read), and names a failure with its prefix;
    ``all_ok`` says whether all passed where the flags are; outside ``holding`` a verdict
    is read at once."""
    good, bad = torch.ones(3, dtype=torch.bool), torch.tensor([True, False])
    sizes = torch.tensor([7, 9])
    fwd, bwd = checks.HeldChecks(), checks.HeldChecks()
    with counting([good, bad, sizes]) as c:
        with fwd.holding("rank 0: fwd"):
            checks.verdict(good, lambda i: f"payload {i}")
        with bwd.holding("rank 0: bwd"):
            checks.verdict(bad, lambda i: f"payload {i}")
        ok = bwd.all_ok()
        assert c.total() == 0 and ok is not None and on_device(ok)
        assert checks.read_sizes(sizes) == [7, 9]  # no rider: the sizes alone
        with checks.riding(fwd, bwd), pytest.raises(PayloadError, match=r"rank 0: bwd: payload 1$"):
            checks.read_sizes(sizes)
        assert c.total() == 2 and not fwd and not bwd  # taken by the read that raised
        with fwd.holding():
            checks.verdict(good, str)
        with checks.riding(fwd):
            assert checks.read_sizes(sizes) == [7, 9]
        assert c.total() == 3 and not fwd
        with pytest.raises(PayloadError, match=r"^payload 1$"):
            checks.verdict(bad, lambda i: f"payload {i}")  # not held: read now
    assert not bool(ok)


def steps_counted(
    codec: str, ids: bool, steps: int, extra: tuple[str, ...] = ()
) -> list[tuple[bool, int, int, str]]:
    """Per step of the trainer's parts on the GPU's path: (whether --cuda-graph would
    capture or replay it: its key seen in as many steps before as it warms up with, host
    reads, uploads, what was read where)."""
    from recsz import stepgraph

    parts, ranks = trainer_parts(codec, "cpu", ids=ids, extra=extra)
    graphs = stepgraph.graphed(lambda b, k: torch.zeros(()), parts.exchange, 1)
    src = make_source("synthetic", get_preset("tiny").model.table_sizes, 0)
    state = [*parts.sparse.state_dict().values(), *parts.dense.state_dict().values()]
    state += [*parts.sparse.parameters(), *parts.dense.parameters()]
    seen: dict[object, int] = {}
    out = []
    with counting(state) as c:
        for k in range(steps):
            b = src.train_batch(k, 64)
            key = graphs.key(k)
            graphed = key is not None and seen.get(key, 0) >= graphs.warm
            if key is not None:
                seen[key] = seen.get(key, 0) + 1
            mark([b.dense, b.ids, b.labels])
            train_step(parts, b, k, ranks)
            out.append((graphed, *c.take()))
    return out


@pytest.mark.parametrize("codec", ["hybrid", "fp16", "none"])
def test_a_fixed_size_step_on_the_device_path_never_waits_for_the_host(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fixed-size traffic on the GPU's path: once kernels are built and constants uploaded
    (3 steps), no step reads the device back, the probe windows' included; the steps a CUDA
    graph would capture or replay (--cuda-graph) upload nothing either (a new decay
    multiplier's bounds upload theirs in its warm-up steps). Only the step that turns a
    window's counts into classes reads them (its graph key is None: it runs eagerly)."""
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    counted = steps_counted(codec, ids=False, steps=14)[3:]
    for k, (graphed, reads, uploads, where) in enumerate(counted, start=3):
        classifies = codec == "hybrid" and k == 12  # after the window 10-11 (0-1: at 2)
        assert reads == 0 or classifies, f"step {k}: {where}"
        assert uploads == 0 or not graphed, f"step {k}: {uploads} uploads"
    assert sum(g for g, *_ in counted) >= 3  # steps 5-7 at least


def test_id_aware_traffic_reads_the_host_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Id-aware traffic sends one row per distinct id: the sizes of what it sends are read
    back once a step, for every slice of the batch at once."""
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    for k, (_, reads, _, where) in enumerate(steps_counted("hybrid", ids=True, steps=6)[3:]):
        assert reads == 1, f"step {k + 3}: {where}"


@pytest.mark.parametrize(
    ("codec", "ids", "per_batch"), [("hybrid", False, 0), ("hybrid", True, 1), ("none", True, 0)]
)
def test_an_evaluation_reads_the_host_once_not_once_a_batch(
    codec: str, ids: bool, per_batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The predictions and labels stay on the device until the three numbers: an
    evaluation of 8 batches reads the host as often as one of 2, but for the id-aware
    forward's one read a batch (it read two more a batch, copying both to the host); a
    lone rank's rows through ``none`` go whole: no distinct ids, no read."""
    from types import SimpleNamespace

    from recsz.data import source as source_module
    from recsz.evaluation import evaluate

    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    parts, ranks = trainer_parts(codec, "cpu", ids=ids)
    state = [*parts.sparse.state_dict().values(), *parts.dense.state_dict().values()]
    state += [*parts.sparse.parameters(), *parts.dense.parameters()]
    to = source_module.Batch.to

    def moved(batch: source_module.Batch, device: torch.device) -> source_module.Batch:
        mark([batch.dense, batch.ids, batch.labels])  # the batch on the device
        return to(batch, device)

    monkeypatch.setattr(source_module.Batch, "to", moved)
    cfg = SimpleNamespace(eval_batch_size=64, prefetch=0, progress=False)
    sizes = get_preset("tiny").model.table_sizes
    reads = {}
    with counting(state) as c:
        for n_eval in (128, 128, 512):  # the first builds kernels and uploads constants
            src = make_source("synthetic", sizes, 0, synthetic_eval=n_eval)
            got = evaluate(parts, src, cfg, 0, ranks)  # type: ignore[arg-type]
            reads[n_eval] = c.take()
            assert got["eval_samples"] == n_eval
    (two, _, where), (eight, _, _) = reads[128], reads[512]
    assert eight - two == 6 * per_batch, where
    assert two <= 2 + 2 * per_batch, where


def test_a_lone_rank_without_a_codec_reads_nothing_but_for_bags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One process, ``none`` both ways: nothing leaves the rank, so its default id-aware
    traffic is off (it read the distinct ids' count a step); bags keep it (their update
    reads its sparse gradient), and so does a codec that codes."""
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    for codec, extra, expected in [
        ("none", (), 0),
        ("none", ("--multi-hot", "2"), 1),
        ("fp16", (), 1),
    ]:
        parts = trainer_parts(codec, "cpu", ids=True, extra=extra)[0]
        assert parts.exchange.id_dedup == parts.exchange.coalesce == bool(expected)
        counted = steps_counted(codec, ids=True, steps=4, extra=extra)
        assert [reads for _, reads, _, _ in counted[2:]] == [expected] * 2, (codec, extra)


@pytest.mark.parametrize(("ids", "expected"), [(False, 0), (True, 1)])
@pytest.mark.parametrize(
    "extra",
    [
        ("--multi-hot", "mlperf"),
        ("--table-dtype", "fp16"),
        ("--column-shards", "4"),
        ("--tt-tables", "3"),
        ("--tt-tables", "3", "--multi-hot", "2", "--tt-placement", "replicated"),
        ("--tt-tables", "3", "--tt-cache-rows", "8", "--tt-cache-interval", "1"),
    ],
)
def test_bags_half_tables_column_shards_and_tt_tables_add_no_host_read(
    ids: bool, expected: int, extra: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLPerf's bags, made and pooled on the device, and their ids' updates; half tables'
    rounding; column shards (their ids gathered on the device); TT-Rec tables, sharded or
    replicated, with bags (the sources' ids unchecked again, every id's row made: 3 reads
    a table before), or with caches (every id a lookup of its own: no distinct ids
    counted, a read a table before; a fill every step, in tensors of fixed shapes: reads
    before): no read more than the one-hot float32 step's (id-aware: through `fp16`)."""
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    codec = "fp16" if ids else "none"  # (a lone rank's `none` sends no distinct ids)
    counted = steps_counted(codec, ids=ids, steps=5, extra=extra)
    for k, (_, reads, _, where) in enumerate(counted[3:], start=3):
        assert reads == expected, f"step {k}: {where}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("ids", "expected", "extra"),
    [
        (False, 0, ()),
        (True, 1, ()),
        (False, 0, ("--multi-hot", "mlperf")),
        (False, 0, ("--table-dtype", "fp16")),
        (True, 1, ("--column-shards", "4")),
    ],
)
def test_on_a_gpu_a_step_syncs_as_often_as_counted_on_the_cpu(
    ids: bool, expected: int, extra: tuple[str, ...]
) -> None:
    """What the CPU's count says, torch's sync debug mode confirms on a GPU (it also sees
    what the CPU cannot: pageable copies to the device)."""
    import warnings

    parts, ranks = trainer_parts("hybrid", "cuda", ids=ids, extra=extra)
    src = make_source("synthetic", get_preset("tiny").model.table_sizes, 0)
    syncs = []
    for k in range(7):
        b = src.train_batch(k, 256).to(torch.device("cuda"))
        if k < 3:
            train_step(parts, b, k, ranks)
            continue
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(parts, b, k, ranks)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    assert syncs == [expected] * 4, syncs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["hybrid", "fp16"])
def test_on_a_gpu_held_verdicts_wait_for_the_sizes_read(codec: str) -> None:
    """Between GPUs (world > 1): a received payload's verdict, held, costs no sync; the
    next trimmed encode's read of its sizes takes it along (hybrid: one sync in all; fp16,
    whose sizes its shapes set, reads nothing until the held verdicts are read)."""
    import warnings

    from recsz.codecs import get_codec

    c, dim, sizes = get_codec(codec), 16, [32, 64]
    x = torch.randn(sum(sizes), dim, device="cuda")
    ebs = torch.full((2,), 1e-2, dtype=torch.float64, device="cuda")
    for _ in range(3):  # kernels built, plans made and captured
        payloads, _ = c.encode_segments([(x, sizes)], ebs, trim=True)
        c.decode_segments(payloads, [sizes], dim)
    held = checks.HeldChecks()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with held.holding("rank 0: fwd"):
                (got,) = c.decode_segments(payloads, [sizes], dim)
            with checks.riding(held):
                c.encode_segments([(x, sizes)], ebs, trim=True)
            syncs_before_read = sum("synchroniz" in str(w.message) for w in caught)
            checks.read_all(held)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert (syncs_before_read, syncs) == ((1, 1) if codec == "hybrid" else (0, 1))
    assert float((got - x).abs().max()) <= (1e-2 if codec == "hybrid" else 1e-2 * x.abs().max())
