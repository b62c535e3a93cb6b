"""CompressionSwitch: the trial schedule, the choice from step times, the ranks' agreement."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.comm.switch import CLEAR, CompressionSwitch
from recsz.config import TrainConfig
from recsz.configcheck import idle


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(
    sw: CompressionSwitch, clock: Clock, steps: range, took: Callable[[int, bool], float]
) -> list[bool]:
    """Ask the switch at every step; each step then lasts ``took(step, way)`` seconds."""
    ways = []
    for s in steps:
        way = sw.compress(s)
        ways.append(way)
        clock.t += took(s, way)
    return ways


def switch(clock: Clock, **kw: object) -> CompressionSwitch:
    return CompressionSwitch(mode="auto", clock=clock, **kw)  # type: ignore[arg-type]


def test_always_compresses_and_reads_no_clock() -> None:
    def clock() -> float:
        raise AssertionError("always reads no clock")

    sw = CompressionSwitch(mode="always", clock=clock)
    assert all(sw.compress(s) for s in range(50))


@pytest.mark.parametrize(("fast", "slow", "chosen"), [(1.0, 2.0, True), (2.0, 1.0, False)])
def test_ways_clearly_apart_end_the_trial_after_two_pairs(
    fast: float, slow: float, chosen: bool
) -> None:
    clock = Clock()
    sw = switch(clock, trial=3, warmup=1, every=0)
    ways = run(sw, clock, range(30), lambda _, way: fast if way else slow)
    assert ways[:6] == [True, False] * 3  # a warm-up pair, two timed
    assert ways[6:] == [chosen] * 24
    [trial] = sw.trials
    assert (trial["compressed_s"], trial["plain_s"], trial["timed"]) == (fast, slow, 2)
    assert trial["compress"] is chosen


def test_ways_close_together_take_the_whole_trial() -> None:
    """1.0 s against 1.1 s (not CLEAR apart): three timed pairs, then the faster."""
    clock = Clock()
    sw = switch(clock, trial=3, warmup=1, every=0)
    ways = run(sw, clock, range(20), lambda _, way: 1.1 if way else 1.0)
    assert ways[: sw.length] == [True, False] * 4
    assert ways[sw.length :] == [False] * (20 - sw.length)
    assert sw.trials[0]["timed"] == 3


def test_warmup_steps_are_not_timed() -> None:
    """A slow first step of each way (compilation) does not decide."""
    clock = Clock()
    sw = switch(clock, trial=2, warmup=1, every=0)
    # compressed is faster but its first step takes 100 s; the plain way's first is quick
    run(sw, clock, range(10), lambda s, way: (100.0 if s == 0 else 1.0) if way else 2.0)
    assert sw.chosen is True


def test_the_first_trial_waits_for_the_lead() -> None:
    """``lead`` steps go compressed, untimed (the probe window, whose steps cost more),
    then the first trial; a switch restored before any trial leads again, one restored
    after it does not."""
    clock = Clock()
    sw = switch(clock, trial=2, warmup=1, every=0, lead=5)
    # compressed steps cost 3 s during the lead, 1 s after; plain ones 2 s
    ways = run(sw, clock, range(20), lambda s, way: (3.0 if s < 5 else 1.0) if way else 2.0)
    assert ways[:5] == [True] * 5 and ways[5:11] == [True, False] * 3
    assert [t["step"] for t in sw.trials] == [5] and sw.chosen is True
    assert ways[11:] == [True] * 9
    again = switch(clock, trial=2, warmup=1, every=0, lead=5)
    again.load_state_dict(sw.state_dict())
    assert all(again.compress(s) for s in range(20, 30)) and len(again.trials) == 1
    fresh = switch(clock, trial=2, warmup=1, every=0, lead=5)
    fresh.load_state_dict(switch(clock, lead=5).state_dict())
    assert [fresh.compress(s) for s in range(30, 37)] == [True] * 6 + [False]


def test_the_dual_policy_leads_with_its_probe_window() -> None:

    dual = {"compress": "auto", "eb_policy": "dual", "hindex_probe_steps": 7}
    assert TrainConfig(**dual, fwd_codec="hybrid").switch().lead == 7  # type: ignore[arg-type]
    assert TrainConfig(**dual).switch().lead == 0  # type: ignore[arg-type]  # (no bounds)
    assert TrainConfig(compress="auto", fwd_codec="hybrid").switch().lead == 0  # fixed


def test_ties_go_plain() -> None:
    clock = Clock()
    sw = switch(clock, trial=2, warmup=0, every=0)
    run(sw, clock, range(8), lambda *_: 1.0)
    assert sw.chosen is False


def test_trials_recur_and_follow_the_link() -> None:
    """The link slows down at step 40: the trial at 50 (no warm-up after the first)
    turns compression on."""
    clock = Clock()
    sw = switch(clock, trial=2, warmup=1, every=50)
    ways = run(sw, clock, range(100), lambda s, way: 1.0 if way == (s >= 40) else 2.0)
    assert ways[:6] == [True, False] * 3 and ways[6:50] == [False] * 44
    assert ways[50:54] == [True, False] * 2 and ways[54:] == [True] * 46
    assert [t["step"] for t in sw.trials] == [0, 50]


def test_trials_keeping_the_way_back_off_and_a_change_resets_the_gap() -> None:
    """Compression wins until step 500, plain after: each trial that keeps the way doubles
    the gap to the next (20, 40, 80, then BACKOFF x 20 = 160 at most); the trial after the
    change (at 620) brings it back to 20."""
    clock = Clock()
    sw = switch(clock, trial=2, warmup=0, every=20)
    ways = run(sw, clock, range(700), lambda s, way: 1.0 if way == (s < 500) else 2.0)
    assert [t["step"] for t in sw.trials] == [0, 20, 60, 140, 300, 460, 620, 640, 680]
    assert [t["compress"] for t in sw.trials] == [True] * 6 + [False] * 3
    assert ways[464:620] == [True] * 156 and ways[624:640] == [False] * 16
    # plain: 2 in each of the first 6 trials, 2 in the one at 620, then all but the 2
    # compressed steps of each of the trials at 640 and 680
    assert sw.steps["plain"] == 6 * 2 + 2 + (700 - 624 - 2 * 2)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_step_asked_again_gets_its_answer_and_counts_once(mode: str) -> None:
    """Two modules of one model ask each step (the second a step behind, as a pipeline's
    input dist runs ahead of another module's compute): the switch decides and counts as
    for one, and each module's step goes the way the first ask of that step went."""
    clock = Clock()
    one, two = (
        switch(clock, trial=3, warmup=1, every=20),
        switch(clock, trial=3, warmup=1, every=20),
    )
    one.mode = two.mode = mode
    took = lambda s, way: 1.0 if way == (s < 30) else 1.6  # noqa: E731
    alone = run(one, clock, range(60), took)
    clock.t, first, second = 0.0, [], []
    for s in range(60):
        first.append(two.compress(s))
        if s:
            second.append(two.compress(s - 1))
        assert two.compress(s) == first[-1]
        clock.t += took(s, first[-1])
    assert first == alone and second == alone[:-1]
    assert two.trials == one.trials and two.steps == one.steps
    assert sum(two.steps.values()) == 60 and two.current == alone[-1]


def test_ranks_agree_on_their_slowest() -> None:
    """Rank 0 alone would compress; the ranks' maximum (rank 1's plain steps are faster
    than its compressed ones by more) decides for both."""
    # rank 1's figures: medians, maxima, minima negated (compressed, plain)
    other = torch.tensor([5.0, 1.0, 5.0, 1.0, -5.0, -1.0], dtype=torch.float64)
    clock = Clock()
    sw = switch(clock, trial=2, warmup=0, every=0, agree=lambda x: torch.maximum(x, other))
    run(sw, clock, range(10), lambda _, way: 1.0 if way else 2.0)
    assert sw.chosen is False
    assert (sw.trials[0]["compressed_s"], sw.trials[0]["plain_s"]) == (5.0, 2.0)


def test_a_pause_leaves_the_gap_untimed() -> None:
    """An evaluation of 1000 s between two trial steps is not a step's time."""
    clock = Clock()
    sw = switch(clock, trial=3, warmup=0, every=0)
    for s in range(sw.length + 1):
        way = sw.compress(s)
        clock.t += 1.0 if way else 2.0
        if s == 2:  # after a compressed step
            sw.pause()
            clock.t += 1000.0
    assert sw.chosen is True
    assert sw.trials[0]["compressed_s"] == 1.0


def test_sync_runs_before_each_trial_timing_only() -> None:
    clock, synced = Clock(), []
    sw = switch(clock, trial=2, warmup=0, every=0, sync=lambda: synced.append(clock.t))
    run(sw, clock, range(20), lambda *_: 1.0)
    assert synced and max(synced) <= sw.length  # none once the trial is over


def test_a_resume_at_a_later_step_starts_a_trial_there() -> None:
    clock = Clock()
    sw = switch(clock, trial=2, warmup=0, every=0)
    ways = run(sw, clock, range(300, 310), lambda _, way: 1.0 if way else 2.0)
    assert ways == [True, False] * 2 + [True] * 6
    assert sw.trials[0]["step"] == 300


def test_a_switch_restored_from_its_state_goes_on_as_the_saved_one() -> None:
    """A checkpoint between trials: the restored switch (a fresh clock, as a new process's)
    answers every later step as the switch that ran on, its trials and the backoff's gap
    included. Saved inside a trial, it starts that trial again (warm-up first) and ends it
    with the same choice."""

    def took(s: int, way: bool) -> float:
        return 1.0 if way == (s < 500) else 2.0  # compression wins until step 500

    clock = Clock()
    sw = switch(clock, trial=2, warmup=1, every=20)
    run(sw, clock, range(150), took)  # trials at 0, 20, 60: the next at 140, gap 160
    assert [t["step"] for t in sw.trials] == [0, 20, 60, 140] and not sw.state_dict()["trying"]
    saved = sw.state_dict()
    later = run(sw, clock, range(150, 700), took)
    clock2 = Clock()
    back = switch(clock2, trial=2, warmup=1, every=20)
    back.load_state_dict(saved)
    assert run(back, clock2, range(150, 700), took) == later
    assert back.trials == sw.trials and back.steps == sw.steps

    clock3 = Clock()
    mid = switch(clock3, trial=2, warmup=1, every=20)
    mid.load_state_dict({**saved, "start": 140, "trying": True})  # saved at step 141
    ways = run(mid, clock3, range(142, 160), took)
    assert ways[:6] == [True, False] * 3  # the trial again: a warm-up pair, two timed
    assert mid.trials[-1]["step"] == 142 and mid.trials[-1]["compress"] is True
    assert ways[6:] == [True] * 12


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"mode": "sometimes"}, "compress mode"),
        ({"trial": 0}, "trial >= 1"),
        ({"trial": 5, "warmup": 1, "every": 10}, "cannot hold"),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        CompressionSwitch(**{"mode": "auto", **kw})  # type: ignore[arg-type]


def test_trial_settings_are_idle_where_every_step_compresses() -> None:
    """``--compress-every 3`` without ``--compress auto`` trains as the default would (the
    config check warns that it does nothing), where it was refused as if trials ran."""
    s = CompressionSwitch("always", trial=6, every=3)
    assert [s.compress(i) for i in range(20)] == [True] * 20 and not s.trials
    cfg = TrainConfig(compress_every=3)
    assert idle(cfg) == ["--compress-every 3 does nothing without --compress auto"]
    assert cfg.switch().mode == "always"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 20).map(float), min_size=4, max_size=4),
    st.lists(st.integers(1, 20).map(float), min_size=4, max_size=4),
    st.integers(0, 2),
)
def test_the_choice_against_a_plain_reference(
    compressed: list[float], plain: list[float], warmup: int
) -> None:
    """The trial ends after the first k >= 2 timed pairs whose ways stand CLEAR apart, or
    after all 4; the way of the smaller median of those steps wins (whole seconds: the fake
    clock's sums stay exact)."""
    for k in range(2, 5):
        c, p = compressed[:k], plain[:k]
        if k == 4 or min(p) >= CLEAR * max(c) or min(c) >= CLEAR * max(p):
            break
    want = (statistics.median(c) < statistics.median(p), k)
    clock = Clock()
    sw = switch(clock, trial=4, warmup=warmup, every=0)
    seen = {True: 0, False: 0}

    def took(_: int, way: bool) -> float:
        at = seen[way] - warmup
        seen[way] += 1
        if at < 0 or at >= 4:
            return 50.0  # warm-up steps, and those after the trial: never timed
        return (compressed if way else plain)[at]

    ways = run(sw, clock, range(sw.length + 1), took)
    assert (sw.chosen, sw.trials[0]["timed"]) == want
    end = 2 * (warmup + k)
    assert ways[:end] == [True, False] * (end // 2)
    assert ways[end:] == [want[0]] * (len(ways) - end)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_steps_are_timed_by_their_kernels() -> None:
    """On a GPU the host runs ahead of its kernels: the switch sees the compressed steps'
    queued GPU work (here ~5 ms of sleep a step, against none plain) by synchronizing."""
    from recsz.comm.switch import device_sync

    device = torch.device("cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * 5.0 / start.elapsed_time(end))  # ~5 ms of the GPU's clock
    sw = CompressionSwitch(mode="auto", trial=4, warmup=1, every=0, sync=device_sync(device))
    for step in range(sw.length + 2):
        if sw.compress(step):
            torch.cuda._sleep(cycles)  # queued, not waited for
    torch.cuda.synchronize(device)
    assert sw.trials and sw.chosen is False
    assert sw.trials[0]["compressed_s"] > 4e-3 > sw.trials[0]["plain_s"]
