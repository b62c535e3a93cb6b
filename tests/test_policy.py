"""Error-bound policies without any communication."""

from __future__ import annotations

import itertools
import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.config import TrainConfig
from recsz.policy import FixedBound, to_absolute
from recsz.policy.adaptive import (
    DualBound,
    decay_multiplier,
    homogenization_counts,
    sorted_counts,
)
from recsz.policy.dct import DCTThreshold
from recsz.policy.factory import make_policy
from tests.reference import one_bound

CLS = {"tight": 0.01, "base": 0.03, "loose": 0.05}


@pytest.mark.parametrize(
    ("schedule", "t", "expect"),
    [
        ("step", 0, 2.0),
        ("step", 6553, 2.0),  # still in the first of 10 steps
        ("step", 6554, 1.9),
        ("step", 65535, 1.1),
        ("step", 65536, 1.0),
        ("constant", 0, 1.0),
        ("step", 10**7, 1.0),
    ],
)
def test_schedules_match_formulas(schedule: str, t: int, expect: float) -> None:
    assert decay_multiplier(t, 65536, 2.0, schedule) == pytest.approx(expect, abs=1e-12)


def test_step_schedule_is_monotone() -> None:
    ms = [decay_multiplier(t, 1000, 3.0, "step") for t in range(0, 1001, 7)]
    assert all(a >= b for a, b in itertools.pairwise(ms)) and ms[0] == 3.0
    with pytest.raises(ValueError, match="linear"):
        decay_multiplier(0, 1000, 3.0, "linear")  # retired


def _collapsing(g: torch.Generator) -> torch.Tensor:
    """Values that quantization merges: tiny noise around 0 plus a few large entries."""
    x = torch.randn(256, 16, generator=g) * 1e-4
    x[0] = 1.0
    x[1] = -1.0
    return x


def _spread(g: torch.Generator) -> torch.Tensor:
    """Few distinct rows, far apart: quantization keeps every value distinct."""
    rows = torch.rand(4, 16, generator=g) * 2 - 1
    return rows[torch.randint(0, 4, (256,), generator=g)]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_homogenization_counts_equal_a_per_column_reference(seed: int) -> None:
    """Distinct finite values per column before and after rounding x / 2eb (float32),
    rows holding NaN/Inf left out, as np.unique column by column; the GPU's batched torch
    version gives the same counts."""
    rng = np.random.default_rng(seed)
    t, n, d = 3, int(rng.integers(1, 40)), int(rng.integers(1, 6))
    x = (rng.integers(-5, 5, (t, n, d)) * rng.choice([0.01, 0.3, 1.0])).astype(np.float32)
    x[rng.random((t, n, d)) < 0.05] = rng.choice([np.nan, np.inf, -np.inf])
    eb = rng.uniform(0.001, 2.0, t)
    got = homogenization_counts(torch.from_numpy(x), torch.from_numpy(eb)).numpy()
    for j in range(t):
        rows = x[j][np.isfinite(x[j]).all(1)]
        codes = np.round(rows / np.float32(2 * eb[j]))  # in the values' precision
        before = sum(len(np.unique(rows[:, c])) for c in range(d))
        after = sum(len(np.unique(codes[:, c])) for c in range(d))
        assert got[j].tolist() == [before, after]
    assert torch.equal(
        sorted_counts(torch.from_numpy(x), torch.from_numpy(eb)), torch.from_numpy(got)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_homogenization_counts_take_narrow_floats(dtype: torch.dtype) -> None:
    x = torch.tensor([[[0.5, 1.0], [0.5, 2.0], [1.5, 2.0]]], dtype=dtype)
    got = homogenization_counts(x, torch.tensor([0.5], dtype=torch.float64))
    assert got.tolist() == [[4, 4]]  # columns {0.5, 1.5}, {1, 2}; codes {0, 2}, {1, 2}


def test_index_separates_collapsing_from_distinct_tables() -> None:
    g = torch.Generator().manual_seed(0)
    p = DualBound(n_tables=3, class_eb=CLS, probe_steps=2, every=0, decay_schedule="constant")
    mid = torch.randn(256, 16, generator=g) * 0.3
    for step in range(2):
        p.observe([0], step, _collapsing(g))
        p.observe([1], step, _spread(g))
        p.observe([2], step, mid)
    assert p.class_of(0) == "base"  # nothing classified before the window ends
    x = torch.ones(4, 4)
    one_bound(p, 0, 2, x)
    assert p.index[0] < 0.035 < p.index[2] < 0.5 <= p.index[1]
    assert [p.class_of(t) for t in range(3)] == ["tight", "loose", "base"]
    assert {e["table"] for e in p.events} == {0, 1}
    rng = torch.tensor([[0.0, 2.0]])
    assert one_bound(p, 0, 5, rng) == pytest.approx(0.02)
    assert one_bound(p, 1, 5, rng) == pytest.approx(0.10)


def test_reclassification_every_k_steps() -> None:
    g = torch.Generator().manual_seed(1)
    p = DualBound(n_tables=1, class_eb=CLS, probe_steps=1, every=10, decay_schedule="constant")
    p.observe([0], 0, _collapsing(g))
    one_bound(p, 0, 1, torch.ones(2, 2))
    assert p.class_of(0) == "tight"
    p.observe([0], 5, _spread(g))  # outside a window: ignored
    one_bound(p, 0, 6, torch.ones(2, 2))
    assert p.class_of(0) == "tight"
    p.observe([0], 10, _spread(g))  # window [10, 11)
    one_bound(p, 0, 11, torch.ones(2, 2))
    assert p.class_of(0) == "loose" and len(p.events) == 2


def test_dual_multiplies_class_bound_by_decay() -> None:
    p = DualBound(
        n_tables=1,
        class_eb=CLS,
        mode="abs",
        probe_steps=0,
        every=0,
        decay_c=2.0,
        decay_t=100,
    )
    x = torch.zeros(2, 2)
    assert one_bound(p, 0, 0, x) == pytest.approx(0.06)
    assert one_bound(p, 0, 50, x) == pytest.approx(0.045)  # 1.5 x
    assert one_bound(p, 0, 100, x) == pytest.approx(0.03)


def test_state_survives_checkpoint_roundtrip() -> None:
    g = torch.Generator().manual_seed(3)
    a = DualBound(n_tables=2, class_eb=CLS, probe_steps=2, every=0)
    a.observe([0], 0, _collapsing(g))
    a.observe([1], 0, _spread(g))
    b = DualBound(n_tables=2, class_eb=CLS, probe_steps=2, every=0)
    b.load_state_dict(a.state_dict())  # mid-window: counts carried over
    for p in (a, b):
        p.observe([0], 1, _collapsing(torch.Generator().manual_seed(9)))
        one_bound(p, 0, 2, torch.ones(2, 2))
    assert a.classes == b.classes and a.index == b.index and a.events == b.events


def test_probe_again_classifies_anew_from_that_step() -> None:
    """A restore that lost a rank's classes (the sharder, given another rank's state) probes
    again from the step it resumes at; without it, a policy that classifies once keeps its
    first classes for good. The window survives a checkpoint."""
    g = torch.Generator().manual_seed(5)
    runs = []
    for again in (False, True):
        p = DualBound(n_tables=1, class_eb=CLS, probe_steps=2, every=0)
        for step in (0, 1):
            p.observe([0], step, _spread(g))
        one_bound(p, 0, 2, torch.ones(2, 2))
        first = p.class_of(0)
        if again:
            p.probe_again(50)
            q = DualBound(n_tables=1, class_eb=CLS, probe_steps=2, every=0)
            q.load_state_dict(p.state_dict())
            p = q
        for step in (50, 51):
            p.observe([0], step, _collapsing(g))
        one_bound(p, 0, 52, torch.ones(2, 2))
        runs.append((first, p.class_of(0)))
    assert runs[0] == ("loose", "loose") and runs[1] == ("loose", "tight")


@pytest.mark.parametrize("resumed_at", [1, 2])  # in the probe window; after it
def test_a_resharded_policy_learns_on_as_the_one_that_saw_every_table(resumed_at: int) -> None:
    """Two old ranks' forward policies, each fed its own tables (as their owners are),
    restored into one (``load_resharded``, each table's state from its owner): mid-window
    or classified, it goes on exactly as one policy fed every table from the start (classes,
    indices, events), and no table probes anew."""
    g = torch.Generator().manual_seed(11)
    owners = {0: 0, 1: 1, 2: 0}
    mid = [torch.randn(256, 16, generator=g) * s for s in (0.1, 0.5)]  # steps differ
    days = [{0: _collapsing(g), 1: _spread(g), 2: mid[step % 2]} for step in range(10)]

    def fresh() -> DualBound:
        return DualBound(n_tables=3, class_eb=CLS, probe_steps=2, every=10)

    one, old = fresh(), [fresh(), fresh()]
    for step in range(resumed_at):
        for t, x in days[step].items():
            one.observe([t], step, x)
            old[owners[t]].observe([t], step, x)
        for p in (one, *old):
            one_bound(p, 0, step + 1, torch.ones(2, 2))
    new = fresh()
    new.load_resharded([p.state_dict() for p in old], owners, own=0)

    def g_late(t: int) -> torch.Generator:
        return torch.Generator().manual_seed(t)

    seen = []
    for step in range(resumed_at, 12):  # the second window, [10, 12): every table spread
        for p in (one, new):
            for t in range(3):
                p.observe([t], step, days[step][t] if step < 10 else _spread(g_late(t)))
            one_bound(p, 0, step + 1, torch.ones(2, 2))
        seen.append([[p.class_of(t) for t in range(3)] for p in (one, new)])
        assert new.classes == one.classes and new.index == one.index, step
    assert seen[2 - resumed_at][0] == ["tight", "loose", "base"]  # the first window's
    assert seen[-1][0] == ["loose"] * 3
    assert {(e["step"], e["table"]) for e in new.events} >= {(12, 0), (12, 2)}


def test_a_resharded_dct_policy_keeps_each_tables_threshold() -> None:
    """DCT's thresholds and their refresh steps: each table's from the rank that held it."""
    old = [DCTThreshold(0.1, 5), DCTThreshold(0.1, 5)]
    g = torch.Generator().manual_seed(2)
    for t, r in ((0, 1), (1, 0), (2, 1)):
        old[r].bounds([t], t, torch.randn(1, 64, 4, generator=g))
    new = DCTThreshold(0.1, 5)
    new.load_resharded([p.state_dict() for p in old], {0: 1, 1: 0, 2: 1}, own=0)
    assert new.thresholds == {t: old[r].thresholds[t] for t, r in ((0, 1), (1, 0), (2, 1))}
    assert new.refreshed_at == {0: 0, 1: 1, 2: 2}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["classes"].update({0: "medium"}), "unknown classes"),
        (lambda s: s["classes"].update({7: "tight"}), r"tables \[7\] beyond"),
        (lambda s: s.pop("win"), "malformed"),
        (lambda s: s["index"].update({0: "x"}), "malformed"),
    ],
)
def test_a_damaged_state_is_refused_naming_what(edit: object, message: str) -> None:
    """A class the policy does not have would fail steps later (a KeyError in bounds());
    the load names it instead, and leaves the policy as it was."""
    a = DualBound(n_tables=2, class_eb=CLS, probe_steps=1, every=0)
    a.observe([0, 1], 0, torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0)))
    one_bound(a, 0, 1, torch.ones(2, 2))
    state = a.state_dict()
    edit(state)  # type: ignore[operator]
    b = DualBound(n_tables=2, class_eb=CLS, probe_steps=1, every=0)
    with pytest.raises(ValueError, match=message):
        b.load_state_dict(state)
    assert b.classes == {} and b.index == {}


def test_fixed_and_relative_bounds() -> None:
    x = torch.tensor([[-1.0, 3.0]])
    assert one_bound(FixedBound(0.03, "rel"), 0, 0, x) == pytest.approx(0.12)
    assert one_bound(FixedBound(1e-3, "abs"), 0, 0, x) == 1e-3
    assert to_absolute(0.1, "rel", torch.full((2, 2), 5.0)) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        FixedBound(0.0)


def test_factory_wiring() -> None:
    cfg = TrainConfig(fwd_codec="hybrid", bwd_codec="none", eb_policy="dual")
    assert isinstance(make_policy(cfg, "fwd", 26), DualBound)
    assert one_bound(make_policy(cfg, "bwd", 26), 0, 0, torch.ones(2, 2)) is None
    cfg = TrainConfig(fwd_codec="hybrid", eb_policy="table")
    p = make_policy(cfg, "fwd", 26)
    assert isinstance(p, DualBound) and p.decay_schedule == "constant"
    with pytest.raises(ValueError, match="three numbers"):
        make_policy(
            TrainConfig(fwd_codec="hybrid", eb_policy="dual", fwd_class_eb="0.1"), "fwd", 26
        )


def test_absolute_bound_wider_than_the_data_warns() -> None:
    import warnings

    from recsz.policy import base

    base._abs_checks["left"] = 10
    x = torch.linspace(-1, 1, 64).view(8, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert base.to_absolute(1e-3, "abs", x) == 1e-3  # narrower: silent
        assert not seen
        assert base.to_absolute(1e30, "abs", x) == 1e30
    assert any("at least the range of the data" in str(w.message) for w in seen)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 7, 32, 64]), st.integers(1, 150))
def test_the_range_kernel_equals_the_torch_reduction(seed: int, dim: int, rows: int) -> None:
    """The GPU's one-pass finite range (run here under the Triton interpreter) gives the
    torch reduction's numbers, specials and table-major strided views included."""
    from recsz.codecs.base import EB_MAX
    from recsz.policy import rangekernel
    from recsz.policy.base import MIN_ABS_BOUND, absolute_bounds, finite_range

    g = torch.Generator().manual_seed(seed)
    step = torch.randn(rows, 3, dim, generator=g) * 10.0 ** torch.randint(
        -20, 20, (1,), generator=g
    )
    spots = torch.rand(step.shape, generator=g)
    step[spots < 0.05] = float("nan")
    step[(spots >= 0.05) & (spots < 0.08)] = float("inf")
    step[:, 2] = float("nan") if seed % 2 else -float("inf")  # a table with nothing finite
    if seed % 3 == 0:  # every value finite (the CPU's two plain reductions)
        step = torch.nan_to_num(step, nan=0.5, posinf=3.0, neginf=-3.0)
    x = step.transpose(0, 1)  # (tables, rows, dim), as the exchange hands it over
    lo, hi = rangekernel.finite_range(x)
    want_lo, want_hi = finite_range(x)
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)
    f = [0.01, 0.3, 2.0]
    got = rangekernel.bounds(torch.tensor(f, dtype=torch.float64), x, MIN_ABS_BOUND, EB_MAX)
    assert torch.equal(got, absolute_bounds(f, "rel", x))  # the torch path here


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bounds_equal_the_cpu_ones() -> None:
    """absolute_bounds on a GPU (the range kernel) gives the CPU's numbers."""
    from recsz.policy.base import absolute_bounds

    g = torch.Generator().manual_seed(1)
    step = torch.randn(4096, 26, 64, generator=g) * torch.rand(1, 26, 1, generator=g) * 5
    step[7, 3, 5] = float("nan")
    step[9, 4] = float("inf")
    x = step.transpose(0, 1)
    f = [0.01 * (j + 1) for j in range(26)]
    got = absolute_bounds(f, "rel", x.cuda())
    assert got.is_cuda and torch.equal(got.cpu(), absolute_bounds(f, "rel", x))


def _policies() -> list[object]:
    from recsz.policy.dct import DCTThreshold

    return [
        FixedBound(0.01, "rel"),
        FixedBound(1e-9, "abs"),
        DualBound(n_tables=6, class_eb=CLS, probe_steps=2, every=0),
        DCTThreshold(0.3, 1),
    ]


@pytest.mark.parametrize("path", ["host", "device"])
@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=1, max_size=6),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_padded_tables_give_every_policy_what_each_table_alone_gives(
    path: str, runs: list[list[int]], seed: int, specials: bool
) -> None:
    """Tables of several lengths padded into a few tensors (runs of rows anywhere in x, NaN
    after them) give each policy the bounds, and the dual policy the classes, that one
    call a table gives: the padding takes no part. On the GPU's path (the range kernel,
    the probe's torch counts; padded) and on the host path (each table alone, unpadded)."""
    from recsz.devicepath import DEVICE_PATH_ON_CPU

    with mock.patch.dict(os.environ, {DEVICE_PATH_ON_CPU: str(int(path == "device"))}):
        _padded_tables_checked(runs, seed, specials)


def _padded_tables_checked(runs: list[list[int]], seed: int, specials: bool) -> None:
    from recsz.policy.base import padded_tables

    g = torch.Generator().manual_seed(seed)
    rows = sum(sum(r) for r in runs)  # (and 3 rows no table holds)
    x = torch.randn(rows + 3, 5, generator=g) * torch.rand(rows + 3, 1, generator=g) * 4
    if specials:
        x[torch.rand(x.shape, generator=g) < 0.1] = float("inf")
    # each table's runs at shuffled places in x (as a row's gradient, source after source)
    pieces = [(j, n) for j, r in enumerate(runs) for n in r]
    spans: list[list[tuple[int, int]]] = [[] for _ in runs]
    start = 0
    for i in torch.randperm(len(pieces), generator=g).tolist():
        j, n = pieces[i]
        spans[j].append((start, n))
        start += n
    groups = padded_tables(x, spans)
    got_rows = {j: t[k] for fs, t in groups for k, j in enumerate(fs)}
    for j, r in enumerate(spans):
        want = torch.cat([x[a : a + n] for a, n in r]) if r else x[:0]
        if not len(want):
            assert j not in got_rows
            continue
        pad = got_rows[j][len(want) :]
        assert torch.equal(got_rows[j][: len(want)], want) and bool(pad.isnan().all())
        assert got_rows[j].shape[0] < 2 * len(want)  # at most twice a table's rows
    for apart, together in zip(_policies(), _policies(), strict=True):
        for step in (0, 1, 2):  # the dual policy: a probe window, then its classes
            for fs, t in groups:
                together.observe(fs, step, t)
            for j in got_rows:
                r = spans[j]
                apart.observe([j], step, torch.cat([x[a : a + n] for a, n in r])[None])
            alone = {
                j: float(apart.bounds([j], step, torch.cat([x[a : a + n] for a, n in r])[None])[0])
                for j, r in enumerate(spans)
                if j in got_rows
            }
            joint = {}
            for fs, t in groups:
                joint.update(zip(fs, together.bounds(fs, step, t).tolist(), strict=True))
            assert joint == alone, (step, type(apart).__name__)
        assert together.describe() == apart.describe()
