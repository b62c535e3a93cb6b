"""``--dp-eb-collective hosts``: four gloo ranks as two hosts of two sum a bucket plain
within each host and code only what crosses hosts; every rank ends with the same sum."""

from __future__ import annotations

import torch

from recsz.codecs import get_codec_with
from recsz.comm.dp_eb import EBState, exchange, host_groups
from recsz.comm.dp_hooks import DPComm
from tests.multiproc.spawned import spawned
from tests.test_dp_hooks import Bucket

WORLD, EB = 4, 0.01
HOSTS = [(0, 1), (2, 3)]


def grads(step: int) -> list[torch.Tensor]:
    """Every rank's bucket at ``step``: two parameters' (600 and 400 values) or one's
    (20,000), as tests.test_dp_hooks' Bucket lays them out."""
    g = torch.Generator().manual_seed(step)
    n = (1000, 20_000, 1000)[step]
    return [torch.randn(n, generator=g) * (1 + r) for r in range(WORLD)]


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    got = {}
    for name, codec, hosts, collective in (
        ("zstd", "zstd", HOSTS, "hosts"),
        ("hybrid", "hybrid", HOSTS, "hosts"),
        ("one host", "hybrid", [tuple(range(WORLD))], "hosts"),
        ("all-gathered", "hybrid", HOSTS, "allgather"),
    ):
        st = EBState(get_codec_with(codec), EB, collective)
        st.near = frozenset(next(h for h in hosts if rank in h))
        if collective == "hosts":
            st.hosts = host_groups(hosts, rank)
        dp = DPComm("eb", WORLD, inner=st, bytes_between=0)
        got[name] = [exchange(dp, Bucket(grads(k)[rank].clone())).value() for k in range(3)]
        got[f"{name} bytes"] = dp.bytes_sent
        got[f"{name} between"] = dp.bytes_between
        got[f"{name} held"] = dict(st.reduced)
    # hosts laid out anew before step 2 (a run resumed so): ranks 1 and 2 trade hosts, or
    # all four on one host; the error feedback held for the pieces coded before goes on
    for name, after in (("rehosted", [(0, 2), (1, 3)]), ("onto one host", [(0, 1, 2, 3)])):
        st = EBState(get_codec_with("hybrid"), EB, "hosts")
        dp = DPComm("eb", WORLD, inner=st, bytes_between=0)
        got[name] = []
        for k, hosts in enumerate((HOSTS, HOSTS, after)):
            st.near = frozenset(next(h for h in hosts if rank in h))
            st.hosts = host_groups(hosts, rank)
            got[name].append(exchange(dp, Bucket(grads(k)[rank].clone())).value())
        got[f"{name} held"] = dict(st.reduced)
    try:
        host_groups([(0, 1, 2), (3,)], rank)
    except ValueError as e:
        got["uneven"] = str(e)
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_every_rank_gets_the_same_mean_lossless_exact_lossy_bounded() -> None:
    ranks = spawned(_worker, WORLD)
    for k in range(3):
        mean = torch.stack(grads(k)).mean(0)
        for name in ("zstd", "hybrid", "one host"):
            outs = [r[name][k] for r in ranks]
            assert all(torch.equal(o, outs[0]) for o in outs), name  # every rank alike
        torch.testing.assert_close(ranks[0]["zstd"][k], mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(ranks[0]["one host"][k], mean, rtol=0, atol=1e-6)
        # each host's piece within EB of its range (the host's sum, error fed back): the
        # mean within the hosts' bounds over the ranks, and not exact
        host_sums = [sum(grads(k)[r] for r in h) for h in HOSTS]
        bound = sum(EB * float(s.max() - s.min()) for s in host_sums) / WORLD
        err = (ranks[0]["hybrid"][k] - mean).abs().max()
        assert 0 < err <= 2 * bound  # (2: the residual of the step before rides along)
    # error feedback loses nothing: W x the outputs + what the pieces' coders hold = the
    # gradients' sum, each layout's parameters apart (600 + 400 values, steps 0 and 2;
    # 20,000, step 1)
    held = [sum(r["hybrid held"][k] for r in ranks) for k in (0, 1, 2)]
    out = ranks[0]["hybrid"]
    assert float(held[2].abs().max()) > 0
    total = [sum(grads(k)) for k in range(3)]
    torch.testing.assert_close(WORLD * out[1] + held[2], total[1], rtol=0, atol=1e-4)
    small = torch.cat(held[:2])
    torch.testing.assert_close(WORLD * (out[0] + out[2]) + small, total[0] + total[2],
                               rtol=0, atol=1e-4)  # fmt: skip
    # hosts laid out anew (a resume): what the pieces' coders held is summed in where it
    # lies, so nothing is lost (before, a rank whose piece moved dropped its residual); on
    # one host it goes out in the plain sum, and nothing of those parameters is held
    for name in ("rehosted", "onto one host"):
        out = ranks[0][name]
        held = [sum(r[f"{name} held"].get(k, torch.zeros(1)) for r in ranks) for k in (0, 1)]
        small = torch.cat([h.expand(n) for h, n in zip(held, (600, 400), strict=True)])
        torch.testing.assert_close(WORLD * (out[0] + out[2]) + small, total[0] + total[2],
                                   rtol=0, atol=1e-4)  # fmt: skip
    assert all(0 not in r["onto one host held"] and 2 in r["onto one host held"] for r in ranks)
    # one host: nothing coded, the all-reduce alone; two: fewer bytes coded across hosts
    assert all(r["hybrid bytes"] < r["zstd bytes"] for r in ranks)
    # between hosts: one payload of half a bucket a rank, against the all-gather's two of
    # a whole one (to the other host's two ranks); none from one host
    for r in ranks:
        assert 0 < 3 * r["hybrid between"] < r["all-gathered between"]
        assert r["one host between"] == 0
    assert all("as many ranks on every host, not [3, 1]" in r["uneven"] for r in ranks)
