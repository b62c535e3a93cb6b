"""The exchange's pieces without spawning ranks: framing, distinct ids, a 1-rank
EmbeddingExchange against a plain reference, the CLI built from the config, and the
reports built from per-rank records."""

from __future__ import annotations

import inspect
from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.codecs import available_codecs, castframe, get_codec
from recsz.codecs.framing import frame, unframe
from recsz.codecs.payload import PayloadError
from recsz.comm import ids as ids_module
from recsz.comm.direction import Direction
from recsz.comm.embedding import EmbeddingExchange
from recsz.comm.ids import distinct_pairs, distinct_slices, unique_first
from recsz.comm.stats import ShardPlan
from recsz.commoptions import DenseCommOptions, ExchangeOptions
from recsz.config import JobOptions, ModelOptions, TrainConfig, build_parser, parse_train_args
from recsz.devicepath import DEVICE_PATH_ON_CPU
from recsz.model import ModelConfig, RowOptimizer, SparseArch
from recsz.model.fiited import HeldMask
from recsz.policy import BoundPolicy, FixedBound
from recsz.report import per_table, summarize


# ---- framing --------------------------------------------------------------------------
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_frame_unframe_round_trip(parts: list[bytes]) -> None:
    ts = [
        torch.frombuffer(bytearray(p), dtype=torch.uint8)
        if p
        else torch.empty(0, dtype=torch.uint8)
        for p in parts
    ]
    back = unframe(frame(ts), len(ts), "rank 1")
    assert [bytes(b.numpy()) for b in back] == parts


def test_unframe_names_the_sender_of_bad_buffers() -> None:
    buf = frame([torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="rank 3: sent 2 chunks, expected 1"):
        unframe(buf, 1, "rank 3")
    with pytest.raises(ValueError, match="rank 3: chunk lengths do not add up"):
        unframe(buf[:-1], 2, "rank 3")
    with pytest.raises(ValueError, match="rank 3: framed buffer of 2 bytes is truncated"):
        unframe(buf[:2], 2, "rank 3")


@given(st.lists(st.lists(st.binary(max_size=20), min_size=1, max_size=4), max_size=3))
def test_unframe_all_reads_each_first_part_with_the_tables(bufs: list[list[bytes]]) -> None:
    """Told each buffer's first part's size, :func:`unframe_all` gives that part on the
    host (what a GPU would read with the tables of lengths), the rest as unframe does."""
    from recsz.codecs.framing import unframe_all

    framed = [frame([torch.tensor(list(p), dtype=torch.uint8) for p in ps]) for ps in bufs]
    names = [f"rank {i}" for i in range(len(bufs))]
    got = unframe_all(framed, [len(ps) for ps in bufs], names, [len(ps[0]) for ps in bufs])
    assert [[bytes(t.numpy()) for t in ts] for ts in got] == bufs
    for i, ps in enumerate(bufs):  # a first part of another size: named
        sizes = [len(p[0]) for p in bufs]
        sizes[i] += 1
        with pytest.raises(ValueError, match=f"rank {i}: its first part is {len(ps[0])} bytes"):
            unframe_all(framed, [len(p) for p in bufs], names, sizes)
    for b in framed:
        b.zero_()  # the first parts are copies (the rest are views of the buffers)
    assert [bytes(ts[0].numpy()) for ts in got] == [ps[0] for ps in bufs]


# ---- distinct ids ---------------------------------------------------------------------
@given(st.lists(st.integers(0, 20), max_size=60))
def test_unique_first_matches_a_plain_reference(ids: list[int]) -> None:
    inv, first, uniq = unique_first(torch.tensor(ids, dtype=torch.int64))
    distinct = sorted(set(ids))
    assert uniq.tolist() == distinct
    assert first.tolist() == [ids.index(v) for v in distinct]
    assert [distinct[i] for i in inv.tolist()] == ids


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(200, 20_000), k=st.integers(1, 300))
def test_unique_first_of_many_repeats_finds_each_ids_first_position(
    seed: int, n: int, k: int
) -> None:
    """Long runs of repeated ids (an unstable sort reorders their positions)."""
    ids = np.random.default_rng(seed).integers(0, k, n) << int(seed % 41)
    inv, first, uniq = unique_first(torch.from_numpy(ids))
    distinct, at = np.unique(ids, return_index=True)  # at: each one's first position
    assert np.array_equal(uniq.numpy(), distinct) and np.array_equal(first.numpy(), at)
    assert np.array_equal(distinct[inv.numpy()], ids)


# ---- one rank: the whole exchange against a plain reference -----------------------------
class Spy(FixedBound):
    """A fixed bound that counts what it is fed."""

    def __init__(self, eb: float) -> None:
        super().__init__(eb, "abs")
        self.observed = 0

    def observe(self, tables: list[int], step: int, x: torch.Tensor) -> None:
        self.observed += len(tables)


def one_rank(codec: str, policy: BoundPolicy, **kw: bool) -> EmbeddingExchange:
    return EmbeddingExchange(
        ShardPlan([0, 0, 0], 1),
        0,
        Direction("fwd", get_codec(codec), policy),
        Direction("bwd", get_codec(codec), policy),
        **kw,
    )


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (32, 3), generator=g)  # many repeats
    table = torch.randn(3, 6, 4, generator=g)
    pooled = torch.stack([table[t, ids[:, t]] for t in range(3)], 1)  # (B, T, D)
    return pooled.requires_grad_(), ids


@pytest.mark.parametrize("ids_aware", [False, True])
def test_lossless_exchange_is_the_identity_forward_and_backward(ids_aware: bool) -> None:
    ex = one_rank("zstd", BoundPolicy(), id_dedup=ids_aware, coalesce=ids_aware)
    pooled, ids = batch()
    emb = ex.start_forward(pooled, 0, ids).wait()
    assert torch.equal(emb, pooled.detach())
    g = torch.randn_like(emb)
    (emb * g).sum().backward()
    # With coalescing each id's summed gradient lands on its first sample; a table sees
    # the same sum per id either way.
    for t in range(3):
        for v in ids[:, t].unique():
            rows = ids[:, t] == v
            torch.testing.assert_close(pooled.grad[rows, t].sum(0), g[rows, t].sum(0))
    assert ex.stats.ratio("fwd") > 1 and (ex.stats.ratio("bwd") > 2) == ids_aware


def test_an_identity_codecs_own_rows_skip_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """``none`` at one rank: nothing is coded, the rows come back as they were (both
    ways), and their bytes count as payload, none as wire."""
    ex = one_rank("none", BoundPolicy())
    for name in ("encode", "decode", "_encode_tensor", "_decode_tensor"):
        monkeypatch.setattr(type(ex.fwd.codec), name, lambda *a, **k: pytest.fail("coded"))
    pooled, ids = batch()
    emb = ex.start_forward(pooled, 0, ids).wait()
    assert torch.equal(emb, pooled.detach())
    g = torch.randn_like(emb)
    (emb * g).sum().backward()
    assert torch.equal(pooled.grad, g)
    ex.stats.settle()
    st = ex.stats
    assert sum(st.sent.values()) == sum(st.raw.values()) == 2 * pooled.numel() * 4
    assert sum(st.wire.values()) == 0


def test_pruned_chunks_gradients_are_sent_as_zeros() -> None:
    """FIITED's mask: the gradient dims past each row's held chunks arrive as zeros, the
    others unchanged (lossless codec, no coalescing: one gradient row per sample)."""
    ex = one_rank("zstd", BoundPolicy())
    counts = {t: torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.uint8) for t in range(3)}
    ex.grad_filter = HeldMask(counts, 2)  # chunks of 2 dims, dim 4: 0, 1 or 2 chunks held
    pooled, ids = batch(2)
    emb = ex.start_forward(pooled, 0, ids).wait()
    g = torch.randn_like(emb)
    (emb * g).sum().backward()
    held = torch.stack([counts[t].long()[ids[:, t]] for t in range(3)], 1)  # (B, T)
    keep = torch.arange(4) // 2 < held.unsqueeze(-1)
    assert torch.equal(pooled.grad, g * keep)


def test_tables_without_chunk_counts_keep_their_whole_gradient() -> None:
    """A table FIITED does not prune (a TT table) is named in no count: left unmasked."""
    ex = one_rank("zstd", BoundPolicy())
    counts = {t: torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.uint8) for t in (0, 2)}
    ex.grad_filter = HeldMask(counts, 2)
    pooled, ids = batch(2)
    emb = ex.start_forward(pooled, 0, ids).wait()
    g = torch.randn_like(emb)
    (emb * g).sum().backward()
    held = torch.stack([counts[t].long()[ids[:, t]] if t in counts
                        else torch.full((len(ids),), 2) for t in range(3)], 1)  # fmt: skip
    assert torch.equal(pooled.grad, g * (torch.arange(4) // 2 < held.unsqueeze(-1)))


def test_bounded_exchange_keeps_the_bound_both_ways() -> None:
    ex = one_rank("hybrid", FixedBound(1e-2, "abs"), check_bounds=True)
    pooled, ids = batch(1)
    emb = ex.start_forward(pooled, 0, ids).wait()
    assert float((emb.detach() - pooled.detach()).abs().max()) <= 1e-2
    g = torch.randn_like(emb)
    (emb * g).sum().backward()
    assert float((pooled.grad - g).abs().max()) <= 1e-2
    assert 0 < ex.stats.max_err["fwd"] <= 1 and 0 < ex.stats.max_err["bwd"] <= 1


def test_evaluation_feeds_neither_policy_nor_counters() -> None:
    spy = Spy(1e-2)
    ex = one_rank("hybrid", spy)
    pooled, ids = batch()
    ex.start_forward(pooled, 0, ids).wait()
    seen, raw = spy.observed, dict(ex.stats.raw)
    assert seen == 3 and raw["fwd"] > 0
    ex.train(False)
    with torch.no_grad():
        ex.start_forward(pooled, 1, ids).wait()
    assert spy.observed == seen and dict(ex.stats.raw) == raw


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_lone_ranks_evaluation_sorts_no_ids_where_nothing_is_coded(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank evaluating through an identity codec: its rows go whole, no distinct ids
    sought (a lossless codec still sends one row per distinct id); the same rows, and
    training afterwards finds its ids again."""
    ex = one_rank(codec, BoundPolicy(), id_dedup=True, coalesce=True)
    sorted_cols = []
    real = ids_module.distinct_slices
    monkeypatch.setattr(ids_module, "distinct_slices", lambda c: sorted_cols.append(c) or real(c))
    pooled, ids = batch(3)
    ex.train(False)
    with torch.no_grad():
        assert torch.equal(ex.start_forward(pooled.detach(), 0, ids).wait(), pooled.detach())
    assert len(sorted_cols) == (codec != "none")
    ex.train(True)
    emb = ex.start_forward(pooled, 1, ids.clone()).wait()
    emb.sum().backward()
    assert torch.equal(emb, pooled.detach()) and len(sorted_cols) == 1 + (codec != "none")
    assert ex.stats.ratio("bwd") > 2  # the gradients coalesced by id


def test_bounded_codec_without_a_bound_is_refused() -> None:
    ex = one_rank("hybrid", BoundPolicy())
    pooled, ids = batch()
    with pytest.raises(ValueError, match="fwd codec 'hybrid' needs an error bound"):
        ex.start_forward(pooled, 0, ids)


# ---- configuration: one source for fields and flags ------------------------------------
def test_every_field_has_a_flag_with_its_default() -> None:
    flags = {a.dest: a for a in build_parser()._actions if a.dest != "help"}
    for f in fields(TrainConfig):
        if f.metadata["cli"]:
            assert flags[f.name].default == f.default, f.name
            assert flags[f.name].help.startswith(f.metadata["help"]), f.name
            # A default is said once: by the help, or as the field's value.
            said = flags[f.name].help.count("(default:")
            shown = f.default not in (None, "")  # an empty default: the help says what it is
            assert said == (shown or "(default:" in f.metadata["help"]), f.name
            if shown and said and "(default:" not in f.metadata["help"]:
                assert flags[f.name].help.endswith(f"(default: {f.default})"), f.name
    assert parse_train_args([]) == TrainConfig()


def test_recsz_train_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`recsz train --help` (through the entry point, which first finds the flags given)
    prints the full parser's help: its description and every default."""
    from recsz.train import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Train DLRM with a compressed embedding all-to-all." in out
    assert "(default: )" not in out
    assert f"(default: {TrainConfig().fwd_eb})" in out
    with pytest.raises(SystemExit) as done:  # a bad flag: named by recsz train's parser
        main(["--fwd-eb", "x"])
    assert done.value.code == 2
    assert "recsz train: error: argument --fwd-eb" in capsys.readouterr().err


def test_the_help_groups_the_flags_as_the_config_does() -> None:
    """Each option group (a dataclass TrainConfig inherits) a section of `recsz train
    --help`, titled by its docstring, holding exactly its fields' flags, in order."""
    groups = [
        g
        for g in build_parser()._action_groups
        if g.title not in ("options", "positional arguments")
    ]
    bases = [ModelOptions, ExchangeOptions, DenseCommOptions, JobOptions]
    assert [g.title for g in groups] == [b.__doc__ for b in bases]
    for g, b in zip(groups, bases, strict=True):
        own = [
            f.name for f in fields(b) if f.name in inspect.get_annotations(b) and f.metadata["cli"]
        ]
        assert [a.dest for a in g._group_actions] == own
    others = len(build_parser()._actions) - 2  # --help, --config
    assert sum(len(g._group_actions) for g in groups) == others


def test_a_failure_to_inject_is_read_before_any_rank_starts() -> None:
    assert parse_train_args(["--inject-failure", "1:3"]).failure_at() == (1, 3)
    assert parse_train_args([]).failure_at() is None
    with pytest.raises(ValueError, match="--inject-failure wants RANK:STEP, got '1-3'"):
        parse_train_args(["--inject-failure", "1-3"])


def test_every_limit_is_enforced_at_its_edge() -> None:
    """Each field's limits: the edge value passes where inclusive, a step beyond fails
    with a message naming the flag."""
    limited = [f for f in fields(TrainConfig) if f.metadata["limits"]]
    assert len(limited) >= 20
    # --eval-fraction is a file's (refused with the generator), --target-auc needs evaluations
    data = {"data": "file.tsv", "eval_every": 1}
    for f in limited:
        for kind, edge in f.metadata["limits"].items():
            step = 1 if isinstance(f.default, int) else 1e-9
            outside = edge + step if kind == "le" else edge - step if kind == "ge" else edge
            with pytest.raises(ValueError, match=f"--{f.name.replace('_', '-')} must be"):
                TrainConfig(**{**data, f.name: outside})
            if kind != "gt":
                TrainConfig(**{**data, f.name: edge})


# ---- reports: built from per-rank records ----------------------------------------------
def record(rank: int, raw: int, sent: int) -> dict:
    return {
        "rank": rank,
        "loss": 0.5 + rank,
        "train_s": 2.0,
        "data_s": 0.1,
        "a2a_fwd_s": 0.2,
        "a2a_bwd_s": 0.2,
        "codec_s": 0.1,
        "allreduce_s": 0.5,
        "raw": {"fwd": raw, "bwd": raw},
        "sent": {"fwd": sent, "bwd": 2 * sent},
        "wire": {"fwd": sent // 2, "bwd": sent},
        "between": {"fwd": sent // 4},
        "between_raw": {"fwd": raw // 2},
        "max_err": {},
        "tables": {
            "fwd": {rank: (raw, sent, 0.1, "base")},
            "bwd": {0: (raw, 2 * sent, 0.2, "loose")},
        },
        "allreduce_bytes": 0,
        "allreduce_dense_bytes": 0,
        "embedding_bytes": 100 + rank,
        "embedding_bytes_dense": 1000,
        "tt_cache": (30 + rank, 100),
        "dct_refreshes": None,
        "events": [],
    }


def test_summary_sums_bytes_and_averages_seconds_over_ranks() -> None:
    s = summarize([record(0, 1000, 100), record(1, 3000, 100)], steps=10, batch_size=64)
    assert s["loss"] == 1.0 and s["train_s"] == 2.0 and s["samples_per_s"] == 320.0
    assert s["compute_s"] == pytest.approx(1.0)
    assert s["bytes_raw"] == 8000 and s["bytes_payload"] == 600 and s["bytes_sent"] == 300
    assert s["bytes_between_hosts"] == 50 and s["between_hosts_ratio"] == 2000 / 50
    assert s["fwd_ratio"] == 20.0 and s["bwd_ratio"] == 10.0
    assert s["tt_cache_hit_rate"] == (30 + 31) / 200
    assert s["embedding_bytes"] == 201 and s["embedding_bytes_dense"] == 2000
    t = per_table([record(0, 1000, 100), record(1, 3000, 100)])
    assert t["0"]["fwd_ratio"] == 10.0 and t["1"]["fwd_ratio"] == 30.0
    assert t["0"]["bwd_ratio"] == 10.0 and t["0"]["bwd_class"] == "loose"


# ---- blocks: every table of a slice at once ---------------------------------------------
@settings(max_examples=50, deadline=None)
@given(cols=st.lists(st.lists(st.integers(0, 9), min_size=7, max_size=7), min_size=0, max_size=4))
def test_distinct_pairs_equal_unique_first_per_table(cols: list[list[int]]) -> None:
    ids = torch.tensor(cols, dtype=torch.int64).reshape(len(cols), 7).t()  # (b=7, T)
    u = distinct_pairs(ids)
    firsts, invs, offset = [], [], 0
    for t in range(ids.shape[1]):
        inv, first, _ = unique_first(ids[:, t])
        invs.append(inv + offset)
        firsts.append(first + 7 * t)
        offset += first.numel()
        assert u.counts[t] == first.numel()
    assert u.first.tolist() == (torch.cat(firsts).tolist() if firsts else [])
    assert u.inverse.tolist() == (torch.cat(invs).tolist() if invs else [])


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(0, 6),
    widths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    data=st.data(),
)
def test_a_steps_slices_at_once_equal_each_slice_alone(
    b: int, widths: list[int], data: st.DataObject
) -> None:
    """distinct_slices on the GPU's path (one sort for all slices, one host read) gives
    each slice's distinct_pairs (empty slices, repeats across and within tables)."""
    cols = [
        torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=b * w, max_size=b * w)),
                     dtype=torch.int64).view(b, w)
        for w in widths
    ]  # fmt: skip
    want = [distinct_pairs(c) for c in cols]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEVICE_PATH_ON_CPU, "1")
        got = distinct_slices(cols)
    for g, w in zip(got, want, strict=True):
        assert g.counts == w.counts
        assert torch.equal(g.first, w.first) and torch.equal(g.inverse, w.inverse)


def test_ids_outside_the_exchanges_range_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    big = torch.tensor([[1, 2], [3, 1 << 41]])
    with pytest.raises(ValueError, match=f"an id of {1 << 41} is too large"):
        distinct_pairs(big)
    with pytest.raises(ValueError, match="an id of -5 is negative"):
        distinct_pairs(-big[:, :1] - 2)
    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")
    with pytest.raises(ValueError, match=f"an id of {1 << 41} is too large"):
        distinct_slices([big[:1], big])
    with pytest.raises(ValueError, match="an id of -5 is negative"):
        distinct_slices([big[:1], -big[:, :1] - 2])


@pytest.mark.parametrize("name", [n for n in available_codecs() if get_codec(n).joinable])
def test_joinable_codecs_decode_a_block_as_its_tables(name: str) -> None:
    """What the exchange relies on when it codes a destination's tables as one chunk."""
    codec = get_codec(name)
    assert not codec.error_bounded and not codec.threshold
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 8, generator=g) * s for n, s in ((5, 1.0), (0, 1.0), (3, 100.0))]
    joined = codec.decode(codec.encode(torch.cat(parts)))
    alone = torch.cat([codec.decode(codec.encode(p)) for p in parts])
    assert torch.equal(joined, alone)


# ---- sizes the shapes set: no sizes exchanged --------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(available_codecs()),
    st.lists(st.integers(0, 300), min_size=1, max_size=3),
    st.sampled_from([1, 7, 64]),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    st.sampled_from([1.0, 1e30]),
)
def test_group_nbytes_is_none_or_the_payloads_length(
    name: str, rows: list[int], dim: int, dtype: torch.dtype, scale: float
) -> None:
    """What a receiver predicts is what the sender makes (NaN, Inf and values past the
    target's range included), in format 1 and in format 4 (the casts' device format, which
    the CPU writes too); every codec that cannot say returns None."""
    codec = get_codec(name)
    cpu = torch.device("cpu")
    predicted = codec.group_nbytes(sum(rows), dim, dtype, cpu)
    if predicted is None:
        assert codec.cast_width(dtype) is None
        return
    g = torch.Generator().manual_seed(sum(rows))
    x = (torch.randn(sum(rows), dim, generator=g, dtype=torch.float64) * scale).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])[: x.numel()]
    eb = None if not codec.error_bounded else 0.1
    payloads, used = codec.encode_segments([(x, rows)], eb)
    assert payloads[0].numel() == int(used[0]) == predicted
    width = codec.cast_width(dtype)
    assert width is not None
    (p4,), _ = castframe.encode(codec.codec_id, codec._encode_tensor, [(x, rows)])
    assert p4.numel() == castframe.nbytes(codec.codec_id, dtype, sum(rows), dim, width)


def test_a_codec_whose_sizes_break_their_rule_is_stopped_before_sending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer would wait for bytes that never come: the sender checks its own payloads."""
    ex = one_rank("fp16", BoundPolicy())
    real = type(ex.fwd.codec).group_nbytes

    def off_by_four(self, *a):  # type: ignore[no-untyped-def]
        n = real(self, *a)
        return None if n is None else n + 4

    monkeypatch.setattr(type(ex.fwd.codec), "group_nbytes", off_by_four)
    pooled, ids = batch()
    with pytest.raises(RuntimeError, match="fwd codec 'fp16' made payloads of"):
        ex.start_forward(pooled, 0, ids)


def _three_rank_exchange(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sizes_exchanged = 0
    real = dist.all_to_all_single

    def counting(output, inp, *a, **k):  # type: ignore[no-untyped-def]
        nonlocal sizes_exchanged
        sizes_exchanged += inp.dtype == torch.int64
        return real(output, inp, *a, **k)

    dist.all_to_all_single = counting  # type: ignore[assignment]
    sorts, real_distinct = {"slices": 0}, ids_module.distinct_slices

    def sorting(cols):  # type: ignore[no-untyped-def]
        sorts["slices"] += len(cols)
        return real_distinct(cols)

    ids_module.distinct_slices = sorting
    owners = [0, 1, 2, 0, 1, 1]  # rank 1 holds three tables, the others fewer
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (12, 6), generator=g)  # b = 4: uneven distinct counts
    table = torch.randn(6, 5, 3, generator=g)
    grad = torch.randn(12, 6, 3, generator=g)[rank * 4 : rank * 4 + 4]
    mine = [t for t, r in enumerate(owners) if r == rank]
    got = {}
    for codec in ("none", "fp16", "zstd"):
        ex = EmbeddingExchange(
            ShardPlan(owners, world),
            rank,
            Direction("fwd", get_codec(codec), BoundPolicy()),
            Direction("bwd", get_codec(codec), BoundPolicy()),
            id_dedup=True,
            coalesce=True,
        )
        before = sizes_exchanged
        pooled = torch.stack([table[t, ids[:, t]] for t in mine], 1).requires_grad_()
        emb = ex.start_forward(pooled, 0, ids).wait()
        (emb * grad).sum().backward()
        n = sizes_exchanged - before
        ex.train(False)
        sorted_before = sorts["slices"]
        with torch.no_grad():  # an evaluation's forward: the same rows
            ev = ex.start_forward(pooled.detach(), 1, ids.clone()).wait()
        got[codec] = (emb.detach(), pooled.grad, n, ev, sorts["slices"] - sorted_before)
    torch.save(got, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def test_casts_cross_three_ranks_without_exchanging_sizes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``none`` and ``fp16`` predict every payload's size from the distinct ids each rank
    knows, so only their bytes move; they deliver what ``zstd`` (lossless, sizes
    exchanged) does, and ``fp16`` its cast, both ways."""
    import torch.multiprocessing as mp

    world = 3
    mp.spawn(_three_rank_exchange, args=(world, f"file://{tmp_path}/rdv", str(tmp_path)),
             nprocs=world)  # fmt: skip
    for rank in range(world):
        got = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False)
        emb, grad, n = got["zstd"][:3]
        assert n == 2  # the sizes of each direction
        assert got["none"][2] == got["fp16"][2] == 0
        assert torch.equal(got["none"][0], emb) and torch.equal(got["none"][1], grad)
        assert torch.equal(got["fp16"][0], emb.half().float())
        # Evaluating, the rank's own rows skip an identity codec whole: its slice unsorted.
        assert all(torch.equal(got[c][3], got[c][0]) for c in got)
        assert (got["none"][4], got["fp16"][4], got["zstd"][4]) == (4, 5, 5)
        torch.testing.assert_close(got["fp16"][1], grad, rtol=2e-3, atol=1e-3)


def _damaged_exchange(rank: int, world: int, init: str, out: str, codec: str, damaged: str) -> None:
    """2 ranks on the GPU's path (``codec`` both ways, fixed-size traffic): step 0 as sent,
    then every received ``damaged`` ("fwd" or "bwd") buffer of step 1 gets a byte flipped."""
    import torch.distributed as dist

    from recsz.comm import exchange
    from recsz.comm.exchange import PendingBytes

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    owners = [0, 1, 0]
    arch = SparseArch(
        ModelConfig(table_sizes=TABLE_ROWS, emb_dim=4, bottom_mlp=(4,), top_mlp=(1,)),
        [t for t, r in enumerate(owners) if r == rank], rank,
        RowOptimizer("rowwise_adagrad", 0.1),
    )  # fmt: skip
    policy = FixedBound(1e-3, "abs")
    ex = EmbeddingExchange(
        ShardPlan(owners, world), rank,
        Direction("fwd", get_codec(codec), policy), Direction("bwd", get_codec(codec), policy),
    )  # fmt: skip
    waits = {"n": 0}
    real_wait = PendingBytes.wait

    def wait(self: PendingBytes) -> list[torch.Tensor]:
        bufs = real_wait(self)
        waits["n"] += 1  # 1, 2: step 0's forward, backward; 3, 4: step 1's
        if waits["n"] == {"fwd": 3, "bwd": 4}[damaged]:
            peer = bufs[1 - rank]
            peer[len(peer) // 2] ^= 0x5A  # self.out's bytes: what decode reads
        return bufs

    exchange.PendingBytes.wait = wait  # type: ignore[method-assign]
    steps = small_steps(torch.Generator().manual_seed(7), 3)

    def snap() -> list[torch.Tensor]:  # the tables and their optimizer's state
        return [v.clone() for v in arch.state_dict().values() if isinstance(v, torch.Tensor)]

    got: dict[str, object] = {"before": snap()}
    try:
        for k, (ids, g) in enumerate(steps):
            b = ids.shape[0] // world
            emb = ex.start_forward(arch(ids), k, ids).wait()
            (emb * g[rank * b : (rank + 1) * b]).sum().backward()
            got[f"after {k}"] = snap()
    except PayloadError as e:
        got["error"], got["at"] = str(e), k
    torch.save(got, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("damaged", ["fwd", "bwd"])
@pytest.mark.parametrize("codec", ["hybrid", "fp16"])
def test_a_damaged_payload_between_ranks_is_named_and_updates_nothing(
    tmp_path, monkeypatch: pytest.MonkeyPatch, codec: str, damaged: str
) -> None:  # type: ignore[no-untyped-def]
    """On the GPU's path the checks' verdicts wait for a later host read (hybrid: the
    next read of payload sizes, so one read a direction a step; fp16, whose sizes are
    known: the forward's before the backward's bytes leave, the backward's with it a step
    later). A damaged forward payload is named before the backward's bytes leave (no table
    changes in that step); a damaged backward payload updates nothing (its rows are gated
    by the verdicts on the device) and is named in the next step."""
    import torch.multiprocessing as mp

    monkeypatch.setenv(DEVICE_PATH_ON_CPU, "1")  # the ranks inherit it
    args = (2, f"file://{tmp_path}/rdv", str(tmp_path), codec, damaged)
    mp.spawn(_damaged_exchange, args=args, nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False)
        other = 1 - rank
        assert got["at"] == (1 if damaged == "fwd" else 2), got
        assert f"rank {rank}: {damaged} payloads from ranks [0, 1]" in got["error"]
        assert "corrupted or truncated" in got["error"]
        assert codec != "hybrid" or f"payload {other}: corrupted" in got["error"]
        moved = [not torch.equal(a, b) for a, b in zip(got["before"], got["after 0"], strict=True)]
        assert any(moved)  # step 0 trained
        if damaged == "bwd":  # step 1 ran through, and left every table as it was
            assert all(map(torch.equal, got["after 0"], got["after 1"]))
        assert "after 1" in got or damaged == "fwd"


# ---- the exchange driving a rank's tables -----------------------------------------------
TABLE_ROWS = (7, 3, 11)


def small_tables(
    kind: str | None = "rowwise_adagrad", hotness: tuple[int, ...] | None = None
) -> SparseArch:
    """Three tiny tables of dim 4 in one SparseArch (``kind``: the row optimizer, None:
    frozen; ``hotness``: ids per bag of each table)."""
    cfg = ModelConfig(table_sizes=TABLE_ROWS, emb_dim=4, bottom_mlp=(4,), top_mlp=(1,))
    opt = RowOptimizer(kind, 0.1) if kind else None
    return SparseArch(cfg, [0, 1, 2], 0, opt, hotness=hotness)


def small_steps(gen: torch.Generator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` steps of (ids (16, 3), the embeddings' gradient (16, 3, 4))."""
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randint(0, r, (16,), generator=gen) for r in TABLE_ROWS], 1)
        out.append((ids, torch.randn(16, 3, 4, generator=gen)))
    return out


def train_tables(
    arch: SparseArch,
    ex: EmbeddingExchange,
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    device: str = "cpu",
) -> None:
    """One exchange step per (ids, gradient): forward, then backward of <emb, gradient>."""
    for k, (ids, g) in enumerate(steps):
        ids, g = ids.to(device), g.to(device)
        (ex.start_forward(arch(ids), k, ids).wait() * g).sum().backward()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]),
    st.sampled_from(["none", "zstd", "fp16"]),
    st.sampled_from([None, (3, 1, 4)]),
)
def test_sparse_coalesced_gradient_updates_the_tables_as_the_dense_one(
    seed: int, kind: str, codec: str, hotness: tuple[int, ...] | None
) -> None:
    """``sparse_grad``: the owner gets each id's summed gradient as a sparse gradient of
    pooled, which the fused update reads directly (with bags: the ids of those bags only);
    three steps of it leave the tables and their optimizer state, bit for bit, where the dense
    (B, |T_r|, D) gradient leaves them."""
    steps = small_steps(torch.Generator().manual_seed(seed), 3)
    archs = []
    for sparse in (False, True):
        arch = small_tables(kind, hotness)
        assert arch.takes_sparse_grad
        ex = one_rank(codec, BoundPolicy(), id_dedup=True, coalesce=True, sparse_grad=sparse)
        train_tables(arch, ex, steps)
        archs.append(arch)
    dense, sparse_ = archs
    torch.testing.assert_close(sparse_.weight, dense.weight, rtol=0, atol=0)
    torch.testing.assert_close(sparse_.optimizer_state, dense.optimizer_state, rtol=0, atol=0)


@pytest.mark.parametrize("ids_aware", [False, True])
def test_gradients_fly_while_the_rest_of_backward_runs(
    ids_aware: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward all-to-all starts when the embeddings' gradient is ready and is
    received at the end of the backward pass: a layer that ran before the exchange was
    waited on (the bottom MLP) gets its gradient while the bytes are sent and the tables
    are not yet updated; afterwards the tables hold what one process's plain backward
    leaves them (frozen tables send nothing)."""
    gen = torch.Generator().manual_seed(0)
    ((ids, g),) = small_steps(gen, 1)
    dense = torch.randn(16, 5, generator=gen)
    bottom = torch.nn.Linear(5, 4)
    archs = [small_tables() for _ in "ab"]
    start = archs[0].weight.detach().clone()
    ex = one_rank("zstd", BoundPolicy(), id_dedup=ids_aware, coalesce=ids_aware)
    seen, decoded = [], []
    decode = ex.bwd.codec.decode_segments
    monkeypatch.setattr(
        ex.bwd.codec, "decode_segments", lambda *a, **k: decoded.append(1) or decode(*a, **k)
    )

    def at_bottom(grad: torch.Tensor) -> None:
        ex.stats.settle()
        sent = ex.stats.raw["bwd"] > 0
        seen.append((sent, len(decoded), torch.equal(archs[0].weight, start)))

    bottom.weight.register_hook(at_bottom)
    pending = ex.start_forward(archs[0](ids), 0, ids)
    x = bottom(dense)  # runs while the embeddings fly
    emb = pending.wait()
    (emb * g * x.unsqueeze(1)).sum().backward()
    assert seen == [(True, 0, True)]  # sent, not yet received, tables untouched
    assert len(decoded) == 1
    (archs[1](ids) * g * x.detach().unsqueeze(1)).sum().backward()  # one process, plain
    torch.testing.assert_close(archs[0].weight, archs[1].weight, rtol=0, atol=1e-6)
    assert not torch.equal(archs[0].weight, start)

    frozen = small_tables(None)
    sent = ex.stats.raw["bwd"]
    emb = ex.start_forward(frozen(ids), 1, ids).wait()
    assert not emb.requires_grad
    ex.stats.settle()
    assert ex.stats.raw["bwd"] == sent


def test_a_deferred_backwards_failure_stops_the_backward_pass() -> None:
    """``tie_backward``: what ``finish`` raises (a damaged payload, a peer gone) comes out of
    ``backward()`` itself, and the source gets no gradient."""
    from recsz.comm.overlap import tie_backward

    source = torch.randn(4, 3, requires_grad=True)
    started = []

    def finish(token: int) -> torch.Tensor:
        raise ValueError(f"rank 1: bwd payloads from ranks [0]: damaged ({token})")

    out = tie_backward(source.detach() * 2, source, lambda g: started.append(g) or 7, finish)
    with pytest.raises(ValueError, match=r"rank 1: bwd payloads .* damaged \(7\)"):
        out.sum().backward()
    assert len(started) == 1 and source.grad is None
    out = tie_backward(source.detach() * 2, source, lambda g: g * 2, lambda g: g)
    out.sum().backward()  # the plain chain rule, where start and finish are the identity
    assert torch.equal(source.grad, torch.full((4, 3), 2.0))


@pytest.mark.parametrize("defer", [True, False])
def test_a_gradient_deferred_or_not_reaches_a_callback_queued_before_it(defer: bool) -> None:
    """DDP queues its reducer's end when its first gradient is ready, before the exchange's
    node runs: a parameter behind the source (TorchRec's position weights) has its gradient
    by then only where the exchange does not defer (``defer=False``); the gradient is the
    chain rule's either way."""
    from recsz.comm.overlap import tie_backward

    weight = torch.randn(4, 1, requires_grad=True)  # a dense parameter behind the source
    source = torch.ones(4, 3) * weight
    dense = torch.randn(3, requires_grad=True)  # a parameter after the exchange
    out = tie_backward(source.detach() * 2, source, lambda g: g * 2, lambda g: g, defer)
    seen = []

    def first_ready(grad: torch.Tensor) -> torch.Tensor:
        run = torch.autograd.Variable._execution_engine.queue_callback
        run(lambda: seen.append(weight.grad is not None))
        return grad

    dense.register_hook(first_ready)
    (out * dense).sum().backward()
    assert seen == [not defer]
    assert torch.allclose(weight.grad, 2 * dense.detach().sum().expand(4, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_cuda_sparse_deferred_gradients_train_the_tables_as_the_cpu(codec: str) -> None:
    """On a GPU (format 4 for the casts, the sort-based row sums) the id-aware exchange, its
    sparse coalesced gradient and the deferred backward leave the tables and the row-wise
    Adagrad state where the CPU leaves them after three steps."""
    steps = small_steps(torch.Generator().manual_seed(0), 3)
    archs = []
    for device in ("cpu", "cuda"):
        arch = small_tables().to(device)
        ex = one_rank(codec, BoundPolicy(), id_dedup=True, coalesce=True, sparse_grad=True)
        train_tables(arch, ex, steps, device)
        archs.append(arch)
    cpu, gpu = archs
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, rtol=0, atol=1e-5)
    torch.testing.assert_close(gpu.optimizer_state.cpu(), cpu.optimizer_state, rtol=0, atol=1e-5)


def test_counters_resumed_on_another_number_of_ranks() -> None:
    """Counters saved by 3 ranks, resumed on 2 and on 5: every byte counted once, each
    table's forward counts at its new owner, seconds from saved rank r % 3."""
    from recsz.comm.stats import CommStats

    saved = []
    for r in range(3):
        s = CommStats()
        s.codec_s = float(r)
        for d in ("fwd", "bwd"):
            s.raw[d], s.sent[d], s.wire[d] = 100 * (r + 1), 10 * (r + 1), r
            for t in range(6):
                if d == "bwd" or t % 3 == r:  # forward: each table's owner counts it
                    s.table_raw[d][t] += t + 1
                    s.table_sent[d][t] += 1
        saved.append(s)
    for world in (2, 5):
        owners = [t % world for t in range(6)]
        got = [
            CommStats.resumed(saved, r, world, [t for t in range(6) if owners[t] == r])
            for r in range(world)
        ]
        for d in ("fwd", "bwd"):
            assert sum(g.raw[d] for g in got) == 600 and sum(g.sent[d] for g in got) == 60
            assert sum(g.wire[d] for g in got) == 3
        for t in range(6):
            fwd = [g.table_raw["fwd"].get(t, 0) for g in got]
            assert fwd[owners[t]] == t + 1 and sum(fwd) == t + 1
            assert sum(g.table_raw["bwd"].get(t, 0) for g in got) == 3 * (t + 1)
        assert [g.codec_s for g in got] == [float(r % 3) for r in range(world)]
