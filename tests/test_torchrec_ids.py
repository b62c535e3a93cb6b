"""recsz.torchrec.ids: the input dist's bit-packed ids against TorchRec's own KJT all-to-all,
the exchange played out in one process (what each rank sends each, concatenated by
source as ``all_to_all_single`` does)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")

from torchrec import KeyedJaggedTensor
from torchrec.distributed.dist_data import _get_recat

from recsz.codecs.payload import PayloadError
from recsz.torchrec.ids import PackedIdsKJT


def _exchange(
    sent: list[KeyedJaggedTensor], splits: list[int], damage: int | None = None
) -> list[KeyedJaggedTensor]:
    """Every rank's KJT after TorchRec's all-to-all protocol (dist_splits, dist_tensors,
    dist_init of the input's class), as the stock KJTAllToAll runs it between ranks."""
    world = len(sent)
    cuts = [0, *torch.tensor(splits).cumsum(0).tolist()]
    parts = []
    for kjt in sent:
        sizes, tensors = kjt.dist_splits(splits), kjt.dist_tensors()
        parts.append([list(t.split(s)) for t, s in zip(tensors, sizes, strict=True)])
    out = []
    for dest in range(world):
        tensors = [torch.cat([parts[src][i][dest] for src in range(world)]) for i in range(2)]
        if damage is not None and dest == 0 and tensors[0].numel():
            tensors[0] = tensors[0].clone()
            tensors[0][damage % tensors[0].numel()] ^= 0x10
        keys = sent[0].keys()[cuts[dest] : cuts[dest + 1]]
        stride = [k.stride() for k in sent]
        recat = _get_recat(splits[dest], world, 1, torch.device("cpu"), stride)
        made = type(sent[0]).dist_init(keys, tensors, False, world, recat, stride, 1)
        out.append(made)
    return out


@st.composite
def _inputs(draw: st.DrawFn) -> tuple[list[KeyedJaggedTensor], list[int]]:
    """Each rank's features (some with no bags, some empty, ids of every width), the
    features split over the ranks (a rank may own none)."""
    world = draw(st.integers(1, 3))
    splits = draw(st.lists(st.integers(0, 3), min_size=world, max_size=world))
    f, rows = sum(splits), draw(st.integers(0, 12))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    sent = []
    for _ in range(world):
        lengths = torch.randint(0, draw(st.integers(0, 5)) + 1, (f * rows,), generator=g)
        wide = [2**40, 2**62] if dtype == torch.int64 else []
        hi = draw(st.sampled_from([1, 2, 1000, 2**30, *wide]))
        lo = draw(st.integers(0, 2**20)) if hi > 2 else 0
        values = torch.randint(0, hi, (int(lengths.sum()),), generator=g) + lo
        if dtype == torch.int64 and draw(st.booleans()) and values.numel():
            values[0] = -(2**62)  # a range past int64: sent as 8 bytes
        sent.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(f)],
                values=values.to(dtype),
                lengths=lengths.int(),
                stride=rows,
            )
        )
    return sent, splits


@settings(max_examples=60, deadline=None)
@given(_inputs())
def test_packed_ids_arrive_as_torchrecs_own(inputs: tuple[list, list[int]]) -> None:
    sent, splits = inputs
    stock = _exchange(sent, splits)
    ours = _exchange([PackedIdsKJT.of(k) for k in sent], splits)
    for a, b in zip(stock, ours, strict=True):
        assert type(b) is KeyedJaggedTensor and b.keys() == a.keys()
        assert b.stride() == a.stride()
        for x, y in ((a.lengths(), b.lengths()), (a.values(), b.values())):
            assert y.dtype == x.dtype and torch.equal(x, y)


def test_small_ids_take_fewer_bytes_and_the_bytes_are_counted() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 30, (4 * 64,), generator=g)  # 4 features, 64 bags
    values = torch.randint(0, 50_000, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c", "d"], values=values, lengths=lengths.int(), stride=64
    )
    counter = {"raw": 0, "wire": 0}
    packed = PackedIdsKJT.of(kjt, counter, rank=0)
    sizes = packed.dist_splits([2, 2])
    raw = sum(t.numel() * t.element_size() for t in kjt.dist_tensors())
    assert sum(sizes[0]) < raw / 3.5  # 16-bit ids for 64-bit ones, 5-bit lengths for 32
    other = lengths[128:].sum() * 8 + 128 * 4  # what rank 1's features stood for
    assert counter["raw"] == other and counter["wire"] == sizes[0][1] + 8 + 6 * 8 * 2


def test_weighted_or_variable_batch_features_stay_torchrecs() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 2]), weights=torch.ones(3)
    )
    assert PackedIdsKJT.of(kjt) is None


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_a_damaged_byte_is_named(at: int) -> None:
    g = torch.Generator().manual_seed(1)
    sent = []
    for _ in range(2):
        lengths = torch.randint(0, 4, (2 * 8,), generator=g)
        values = torch.randint(0, 5000, (int(lengths.sum()),), generator=g)
        sent.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=["a", "b"], values=values, lengths=lengths.int(), stride=8
            )
        )
    with pytest.raises(PayloadError, match=r"ids from rank \d, feature a: damaged"):
        _exchange([PackedIdsKJT.of(k) for k in sent], [1, 1], damage=at)
