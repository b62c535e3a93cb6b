"""The MLP gradients' hooks without ranks: the error-bounded hook's bound, its error
feedback and its lossless case, on one rank (no collective); on a GPU, the eb and DCT-DP
hooks on CUDA gradients and the ragged all-gather through a one-rank gloo + NCCL group."""

from __future__ import annotations

import pytest
import torch

from recsz.codecs import get_codec, get_codec_with
from recsz.comm.dct_dp import DCTState, all_gather_ragged, dct_hook
from recsz.comm.dp_eb import EBState, exchange
from recsz.comm.dp_hooks import DPComm, _hook

PARAMS = [torch.nn.Parameter(torch.zeros(n)) for n in (600, 400, 300, 20_000)]


class Bucket:
    """The parts of DDP's GradBucket the hook reads: a flat buffer over parameters."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g
        self.params = {1000: PARAMS[:2], 300: [PARAMS[2]], 20_000: [PARAMS[3]]}[g.numel()]

    def buffer(self) -> torch.Tensor:
        return self.g

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def is_last(self) -> bool:
        return True


def residual(dp: DPComm) -> torch.Tensor:
    return torch.cat([dp.inner.residual[k] for k in sorted(dp.inner.residual)])


def eb_state(codec: str, eb: float = 0.01, coder: str = "auto") -> DPComm:
    return DPComm("eb", 1, inner=EBState(get_codec_with(codec, coder=coder), eb))


@pytest.mark.parametrize("coder", ["auto", "blocks"])  # blocks: format 3, a GPU's payloads
def test_eb_hook_keeps_the_bound_and_feeds_back_the_error(coder: str) -> None:
    dp = eb_state("hybrid", 0.05, coder)
    g1 = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # not rows of 64
    out1 = exchange(dp, Bucket(g1.clone())).value()
    eb = 0.05 * float(g1.max() - g1.min())
    assert float((out1 - g1).abs().max()) <= eb
    res = residual(dp)
    torch.testing.assert_close(res, g1 - out1, rtol=0, atol=0)  # what was lost is kept
    assert float(res.abs().max()) > 0
    # The next step sends gradient + residual: over two steps the sum of what was sent
    # equals the sum of the gradients up to the last residual only (no accumulation).
    g2 = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    out2 = exchange(dp, Bucket(g2.clone())).value()
    torch.testing.assert_close(out1 + out2 + residual(dp), g1 + g2, rtol=0, atol=1e-5)
    assert dp.bytes_sent < 0.5 * 2 * 1000 * 4


def test_eb_hooks_bound_is_relative_to_the_buckets_own_range() -> None:
    """A bucket of one sign, not a whole number of rows: the padding must not widen the
    range the relative bound is taken from (zeros would, here by a factor of ~10)."""
    g = 10.0 + torch.rand(1000, generator=torch.Generator().manual_seed(4))
    out = exchange(eb_state("hybrid", 0.05), Bucket(g.clone())).value()
    assert float((out - g).abs().max()) <= 0.05 * float(g.max() - g.min())


def test_eb_hook_with_a_lossless_codec_is_exact() -> None:
    dp = eb_state("zstd")
    g = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(exchange(dp, Bucket(g.clone())).value(), g)
    assert float(residual(dp).abs().max()) == 0.0


def test_eb_hook_on_a_gpus_path_reads_the_host_twice_a_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the GPU's path (format 3 under Triton's interpreter here) the relative bound is
    computed on the device and the payloads' layouts follow from the bucket's size: a
    bucket reads the host for its payload's size and, once, for every payload's checks
    (it read 8 times: the bound, the header, the layouts, the checks of each decode)."""
    from recsz.devicepath import DEVICE_PATH_ON_CPU
    from tests.hostreads import counting

    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    dp = eb_state("hybrid", 0.05)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    exchange(eb_state("hybrid", 0.05), Bucket(g.clone()))  # kernels built
    with counting([g]) as c:
        out = exchange(dp, Bucket(g.clone())).value()
        reads, _, where = c.take()
    assert reads == 2, where
    assert "read_sizes" in where and "read_all" in where
    assert float((out - g).abs().max()) <= 0.05 * float(g.max() - g.min())


def test_checkpoint_state_round_trip() -> None:
    dp = eb_state("hybrid")
    exchange(dp, Bucket(torch.randn(300)))
    again = eb_state("hybrid")
    again.load_state_dict(dp.state_dict())
    assert torch.equal(residual(again), residual(dp))
    assert again.bytes_sent == dp.bytes_sent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_eb_and_dct_hooks_on_cuda_gradients(tmp_path) -> None:
    import torch.distributed as dist

    g = torch.randn(1000, generator=torch.Generator().manual_seed(3)).cuda()
    dp = eb_state("hybrid", 0.05)
    out = exchange(dp, Bucket(g.clone())).value()
    assert out.is_cuda and float((out - g).abs().max()) <= 0.05 * float(g.max() - g.min())
    torch.testing.assert_close(residual(dp), g - out, rtol=0, atol=0)
    dct = DCTState(1, keep=0.1)
    sent = dct_hook(dct, Bucket(g.clone())).value()
    assert sent.is_cuda and int((sent != 0).sum()) == 100
    torch.testing.assert_close(sent + residual(DPComm("dct", 1, inner=dct)), g)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/rdv",
                            rank=0, world_size=1, device_id=torch.device("cuda", 0))  # fmt: skip
    try:  # lengths on the CPU (gloo), payloads on the GPU (NCCL)
        (got,), nbytes = all_gather_ragged([out], 1)
        assert torch.equal(got[0], out) and nbytes == 0
    finally:
        dist.destroy_process_group()


# ---- three ranks (gloo): the all-gather and the reduce-scatter + all-gather ---------------
def _grads(rank: int, step: int) -> torch.Tensor:
    return torch.randn(20_000, generator=torch.Generator().manual_seed(10 * step + rank))


def _three_ranks(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    got = {}
    for codec, collective in [("zstd", "rsag"), ("hybrid", "rsag"), ("hybrid", "allgather")]:
        dp = DPComm("eb", world, inner=EBState(get_codec(codec), 0.05, collective))
        outs = [exchange(dp, Bucket(_grads(rank, s))).value() for s in (0, 1)]
        kept = [dp.inner.reduced[k] for k in sorted(dp.inner.reduced)]
        reduced = torch.cat(kept) if kept else torch.zeros(20_000)
        got[codec, collective] = (outs, residual(dp), reduced, dp.bytes_sent)
    for collective in ("rsag", "allgather"):  # --compress auto: a coded step, then a plain one
        ways = iter([False, True])  # the two steps' "goes plain"
        state = EBState(get_codec("hybrid"), 0.05, collective)
        dp = DPComm("eb", world, inner=state, plain=lambda ways=ways: next(ways))
        outs = [_hook(dp, Bucket(_grads(rank, s))).wait() for s in (0, 1)]
        got["plain", collective] = (outs, len(state.residual) + len(state.reduced))
    torch.save(got, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_reduce_scatter_variant_on_three_ranks(tmp_path) -> None:
    """rsag with a lossless codec gives the mean exactly; with hybrid every rank gets the
    same gradient, within the two stages' bounds of the mean; over two steps the error
    feedback of both stages loses nothing; it sends fewer bytes than the all-gather."""
    import torch.multiprocessing as mp

    world = 3
    init = f"file://{tmp_path}/rendezvous"
    mp.spawn(_three_ranks, args=(world, init, str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in range(world)]
    g = [[_grads(r, s) for r in range(world)] for s in (0, 1)]
    exact = (torch.zeros(20_000) + g[0][0] + g[0][1] + g[0][2]) / world
    assert torch.equal(ranks[0]["zstd", "rsag"][0][0], exact)
    for key in [("hybrid", "rsag"), ("hybrid", "allgather")]:
        outs = [rk[key][0] for rk in ranks]
        assert all(torch.equal(o[s], outs[0][s]) for o in outs for s in (0, 1))  # replicas agree
    out, total = ranks[0]["hybrid", "rsag"][0][0], sum(g[0])
    span = sum(float(x.max() - x.min()) for x in g[0]) + float(total.max() - total.min())
    assert float((out - total / world).abs().max()) <= 0.05 * span / world
    # Two steps: W (out1 + out2) + the ranks' residuals + the owners' residuals = sum g.
    o1, o2 = ranks[0]["hybrid", "rsag"][0]
    lost = sum(rk["hybrid", "rsag"][1] + rk["hybrid", "rsag"][2] for rk in ranks)
    torch.testing.assert_close(world * (o1 + o2) + lost, sum(g[0]) + sum(g[1]), rtol=0, atol=1e-4)
    assert float(lost.abs().max()) > 0
    # --compress auto: a plain step after a coded one takes the fp32 all-reduce of the
    # gradients and of all that error feedback held (both stages'): over the two steps the
    # mean of the gradients, and nothing held any more
    for collective in ("rsag", "allgather"):
        (o1, o2), held = ranks[0]["plain", collective]
        assert held == 0 and all(torch.equal(rk["plain", collective][0][1], o2) for rk in ranks)
        torch.testing.assert_close(world * (o1 + o2), sum(g[0]) + sum(g[1]), rtol=0, atol=1e-4)
    rsag = sum(rk["hybrid", "rsag"][3] for rk in ranks)
    allgather = sum(rk["hybrid", "allgather"][3] for rk in ranks)
    assert rsag < 0.8 * allgather, (rsag, allgather)


def test_a_resumed_hook_state_on_another_number_of_ranks() -> None:
    """Saved by 3 ranks, resumed on 2 and on 4: the bytes still sum to the run's, each
    rank keeps its own error feedback where it had one (the reduce-scatter's, cut by the
    world, starts anew; the hosts collective's stays) and a new rank starts without."""
    from recsz.comm.dp_hooks import resumed_state

    saved = [
        {
            "seconds": 1.0 + r,
            "bytes_sent": 10 * (r + 1),
            "bytes_dense": 100 * (r + 1),
            "eb": {"residual": {0: torch.full((3,), float(r))}, "reduced": {0: torch.ones(3)}},
        }
        for r in range(3)
    ]
    for world in (2, 4):
        got = [resumed_state(saved, r, world) for r in range(world)]
        assert sum(g["bytes_sent"] for g in got) == 60
        assert sum(g["bytes_dense"] for g in got) == 600
        for r, g in enumerate(got):
            assert g["seconds"] == 1.0 + r % 3
            assert g["eb"]["reduced"] == {}
            mine = g["eb"]["residual"]
            assert (mine == {}) if r >= 3 else torch.equal(mine[0], torch.full((3,), float(r)))
    # the hosts collective sums what its pieces' coders held wherever it lies: a rank that
    # stays keeps it (the reduce-scatter's above, saved without a collective, did not)
    for s in saved:
        s["eb"]["collective"] = "hosts"
    for world in (2, 4):
        for r in range(world):
            kept = resumed_state(saved, r, world)["eb"]["reduced"]
            assert (kept == {}) if r >= 3 else torch.equal(kept[0], torch.ones(3))
    dct = [{"seconds": 0.0, "bytes_sent": 5, "bytes_dense": 7,
            "dct": {"step": 9, "residual": {}, "bytes_sent": 5, "bytes_dense": 7}}] * 2  # fmt: skip
    one = resumed_state(dct, 0, 1)
    assert one["dct"]["bytes_sent"] == one["bytes_sent"] == 10  # the hook's own counters
    assert one["dct"]["step"] == 9
    DPComm("eb", 1).load_state_dict(saved[0])  # one rank has no hook: counters only
