"""The MLPs' gradients between 2 ranks: DCT-DP, every DDP hook, the error-bounded hook,
and `--compress auto`'s choice of the way each step goes, every rank alike."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recsz.train import main
from tests.multiproc.runs import (
    BASE,
    assert_same_model,
    losses,
    run,
)

pytestmark = pytest.mark.slow


def test_dct_dp_keep_all_reproduces_ddp(single: Path, tmp_path: Path) -> None:
    """DCT-DP with keep fraction 1.0 sends every entry: the run equals plain DDP's."""
    plain = tmp_path / "plain"
    run(plain, nproc=2)
    dct = tmp_path / "dct"
    s = run(dct, "--dp-comm", "dct", "--dct-keep", "1.0", nproc=2)
    assert s["dp_threshold_refreshes"] >= 1
    assert losses(dct) == losses(plain)
    assert_same_model(plain, dct, 0.0)


def test_dct_mp_and_dp_train(tmp_path: Path) -> None:
    s = run(
        tmp_path,
        "--fwd-codec",
        "dct",
        "--bwd-codec",
        "dct-mask",
        "--dp-comm",
        "dct",
        "--dct-keep",
        "0.05",
        "--dct-refresh",
        "5",
        nproc=2,
    )
    assert s["fwd_ratio"] > 5 and s["bwd_ratio"] > 5 and s["dp_ratio"] > 5
    assert 0.3 < s["auc"] < 1.0


@pytest.mark.parametrize("mode", ["fp16", "bf16", "powersgd", "eb", "eb-rsag"])
def test_every_dp_hook_trains_and_counts_its_bytes(single: Path, tmp_path: Path, mode: str) -> None:
    """Each hook's run stays near the plain all-reduce's (``single`` equals it), sending
    fewer bytes."""
    flags = ["--dp-comm", mode, "--powersgd-warmup", "5"]
    if mode == "eb-rsag":
        flags = ["--dp-comm", "eb", "--dp-eb-collective", "rsag"]
    s = run(tmp_path, *flags, nproc=2)
    assert s["allreduce_bytes"] > 0 and s["allreduce_s"] > 0
    assert s["dp_ratio"] > (1.9 if mode != "powersgd" else 1.5), s["dp_ratio"]
    ours, plain = losses(tmp_path), losses(single)
    assert all(math.isfinite(v) for v in ours)
    assert max(abs(a - b) for a, b in zip(ours, plain, strict=True)) < 0.05


def test_eb_hook_with_a_lossless_codec_equals_the_all_reduce(single: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    run(plain, nproc=2)
    for collective in ("allgather", "rsag"):
        eb = tmp_path / collective
        flags = ("--dp-codec", "none", "--dp-eb-collective", collective)
        run(eb, "--dp-comm", "eb", *flags, nproc=2)
        assert losses(eb) == losses(plain)
        assert_same_model(plain, eb, 0.0)


def test_compress_auto_switches_ways_and_stays_exact(single: Path, tmp_path: Path) -> None:
    """--compress auto with a lossless codec: two trials (steps 0-7, with the first's
    warm-up, and 10-13 at least) alternate zstd and the plain exchange step by step, every
    rank alike, and the model is the single process's whichever way each step went."""
    s = run(
        tmp_path,
        *("--fwd-codec", "zstd", "--bwd-codec", "zstd", "--compress", "auto"),
        *("--compress-trial", "2", "--compress-every", "10"),
        nproc=2,
    )
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path)), torch.tensor(losses(single)), rtol=0, atol=1e-5
    )
    assert_same_model(single, tmp_path, 1e-5)
    switch = s["compress"]
    assert [t["step"] for t in switch["trials"]] == [0, 10]
    assert all(t["compressed_s"] > 0 and t["plain_s"] > 0 for t in switch["trials"])
    steps = switch["steps"]
    assert steps["compressed"] + steps["plain"] == 20 and min(steps.values()) >= 6
    # resumed from its checkpoint: the switch goes on (its trials, counts and schedule),
    # rather than opening a trial of its own at the first step
    flags = ("--fwd-codec", "zstd", "--bwd-codec", "zstd", "--compress", "auto")
    flags += ("--compress-trial", "2", "--compress-every", "10")
    assert main([*BASE, *flags, "--steps", "30", "--resume", str(tmp_path), "--nproc", "2"]) == 0
    again = json.loads((tmp_path / "summary.json").read_text())["compress"]
    assert again["trials"][:2] == switch["trials"]
    assert sum(again["steps"].values()) == 30


def _conflicting_clocks(rank: int, store: str, out: str) -> None:
    """Rank 0's steps say compress (1 s against 2 s plain), rank 1's say the opposite by
    more (5 s against 1 s): the ranks' maxima (5 s, 2 s) choose plain on both."""
    import torch.distributed as dist

    from recsz.comm.switch import CompressionSwitch, max_over

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    now = [0.0]
    switch = CompressionSwitch(
        "auto", trial=2, every=0, warmup=0, agree=max_over(None), clock=lambda: now[0]
    )
    ways = []
    for step in range(10):
        ways.append(switch.compress(step))
        now[0] += (1.0 if ways[-1] else 2.0) if rank == 0 else (5.0 if ways[-1] else 1.0)
    torch.save({"ways": ways, "trials": switch.trials}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_ranks_with_conflicting_step_times_choose_alike() -> None:
    from tests.multiproc.spawned import spawned

    got = spawned(_conflicting_clocks, 2)
    assert got[0] == got[1]
    assert got[0]["ways"] == [True, False] * 2 + [False] * 6
    assert (got[0]["trials"][0]["compressed_s"], got[0]["trials"][0]["plain_s"]) == (5.0, 2.0)
