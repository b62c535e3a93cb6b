"""``--compress-scope``: which ranks' blocks the codecs code (:mod:`recsz.comm.route`).
Four gloo ranks as two hosts of two, against the same exchange with a lossless codec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recsz.codecs import get_codec
from recsz.comm.direction import Direction
from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.route import Route, host_ranks, plain_within_host
from recsz.comm.stats import ShardPlan
from recsz.policy import BoundPolicy, FixedBound
from tests.multiproc.spawned import codec_path, spawned

WORLD, LOCAL, EB = 4, 2, 0.02
OWNERS = [0, 1, 2, 3, 0, 1, 2, 3]  # two tables a rank


def test_the_scope_decides_by_the_number_of_hosts() -> None:
    assert plain_within_host("between-hosts", 1) and plain_within_host("between-hosts", 3)
    assert not plain_within_host("all", 2)
    assert plain_within_host("auto", 2) and not plain_within_host("auto", 1)
    with pytest.raises(ValueError, match="--compress-scope 'within'"):
        plain_within_host("within", 2)


def test_a_ranks_host_is_the_ranks_of_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks are on one host where their machine and torchrun node agree."""
    keys = ["a/0", "a/1", "a/0", "b/0"]
    assert host_ranks(lambda _: keys) == [(0, 2), (1,), (3,)]
    monkeypatch.setenv("GROUP_RANK", "7")
    assert host_ranks(lambda key: [key] * 2) == [(0, 1)]


def test_a_route_codes_each_direction_once_for_its_peers() -> None:
    coded = Direction("fwd", get_codec("hybrid"), FixedBound(EB, "abs"))
    plain = Direction("fwd", get_codec("none"), coded.policy)
    route = Route.of(4, coded, plain, frozenset({2, 3}))
    assert [(d.codec.codec_id, peers) for d, peers in route.groups] == [
        ("hybrid", [0, 1]),
        ("none", [2, 3]),
    ]
    assert route.name == "fwd" and not route.forward_mask


def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    host = frozenset(r for r in range(WORLD) if r // LOCAL == rank // LOCAL)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (16, 8), generator=g)  # b = 4, repeats
    table = torch.randn(8, 5, 3, generator=g)
    grad = torch.randn(16, 8, 3, generator=g)[rank * 4 : rank * 4 + 4]
    mine = [t for t, r in enumerate(OWNERS) if r == rank]
    got = {}
    for name, codec, near in (
        ("exact", "none", frozenset()),
        ("all", "hybrid", frozenset()),
        ("between", "hybrid", host),
    ):
        policy = FixedBound(EB, "abs") if codec == "hybrid" else BoundPolicy()
        plain = tuple(Direction(d, get_codec("none"), policy) for d in ("fwd", "bwd"))
        ex = EmbeddingExchange(
            ShardPlan(OWNERS, WORLD), rank,
            *(Direction(d, get_codec(codec), policy) for d in ("fwd", "bwd")),
            id_dedup=True, coalesce=True, plain=plain, near=near, host=host,
        )  # fmt: skip
        pooled = torch.stack([table[t, ids[:, t]] for t in mine], 1).requires_grad_()
        emb = ex.start_forward(pooled, 0, ids).wait()
        (emb * grad).sum().backward()
        ex.stats.settle()
        st = ex.stats
        got[name] = (
            emb.detach(),
            pooled.grad,
            dict(st.wire),
            dict(st.between),
            dict(st.between_raw),
        )
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("path", ["host", "device"])
def test_between_hosts_the_host_s_blocks_come_exact_and_the_rest_bounded(path: str) -> None:
    """Both ways, on the host's and the GPU's code paths: what comes from a rank of this
    host (itself too) is exact under ``between-hosts`` and bounded but not exact under
    ``all``; what crosses hosts is coded alike under both (same bytes between hosts),
    within its bound."""
    with codec_path(path):
        results = spawned(_worker, WORLD)
    for rank, got in enumerate(results):
        near = {r for r in range(WORLD) if r // LOCAL == rank // LOCAL}
        emb, grad, _, between, _ = got["exact"]
        assert sum(between.values()) > 0
        cols_near = [t for t, r in enumerate(OWNERS) if r in near]  # forward: by table owner
        cols_far = [t for t, r in enumerate(OWNERS) if r not in near]
        rows_near = [s for s in range(16) if s // 4 in near]  # backward: by sample owner
        rows_far = [s for s in range(16) if s // 4 not in near]
        for mode in ("all", "between"):
            e, gr = got[mode][0], got[mode][1]
            assert (e - emb).abs().max() <= EB and (gr - grad).abs().max() <= EB
            exact = mode == "between"
            assert torch.equal(e[:, cols_near], emb[:, cols_near]) == exact
            assert torch.equal(gr[rows_near], grad[rows_near]) == exact
            assert not torch.equal(e[:, cols_far], emb[:, cols_far])
            assert not torch.equal(gr[rows_far], grad[rows_far])
        assert got["all"][3] == got["between"][3]  # what crosses hosts: the same payloads
        assert got["all"][4] == got["between"][4] == got["exact"][4]  # of the same raw bytes
        assert got["between"][2] != got["all"][2]  # what stays within: other payloads


def test_a_run_keeps_counters_saved_before_the_count_between_hosts(tmp_path: Path) -> None:
    """A checkpoint's counters pickled without ``between`` load with none counted."""
    from recsz.comm.stats import CommStats

    st = CommStats()
    st.wire["fwd"] = 5
    state = dict(st.__dict__)
    del state["between"], state["between_raw"]
    old = CommStats.__new__(CommStats)
    old.__setstate__(state)
    assert old.wire["fwd"] == 5 and old.between["fwd"] == old.between_raw["fwd"] == 0
