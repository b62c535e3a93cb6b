"""recsz.torchrec.rows: which rows of a block travel, against plain Python references."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")

from torchrec import KeyedJaggedTensor

import recsz.torchrec.rows as rows_module
from recsz.torchrec.rows import bag_keys, merged


def _kjt(lengths: torch.Tensor, ids: int, seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, ids, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    keys = [f"f{i}" for i in range(lengths.shape[0])]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=lengths.reshape(-1).int(), weights=weights
    )


@st.composite
def _bags(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    features, rows = draw(st.integers(1, 4)), draw(st.integers(0, 30))
    most = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, most + 1, (features, rows), generator=g)
    return lengths, draw(st.integers(1, 12)), seed


def _slices(rows: int, cut: int) -> list[int]:
    return [0, min(cut, rows), rows]


@pytest.mark.parametrize("collide", [False, True])
@given(bags=_bags(), cut=st.integers(0, 30))
@settings(max_examples=60, deadline=None)
def test_keys_merge_bags_of_one_content(
    bags: tuple[torch.Tensor, int, int], cut: int, collide: bool
) -> None:
    """Within a feature and a slice of the batch, two bags share a key exactly when they
    hold the same ids in the same order. When every bag hashes alike (``collide``) the ids'
    check still keeps bags of different ids apart (bags of one content may then stay
    apart: fewer merged, none wrong). The keys of a slice do not depend on the rest of the
    batch (the sample owner sees its slice only)."""
    lengths, ids, seed = bags
    kjt = _kjt(lengths, ids, seed)
    features, rows = lengths.shape
    at = _slices(rows, cut)
    with pytest.MonkeyPatch.context() as mp:
        if collide:
            mp.setattr(rows_module, "_mix", lambda x: x * 0)
        keys = bag_keys(kjt, at, features)
        assert keys is not None
        alone = [bag_keys(_part(kjt, lengths, a, b), [0, b - a], features) for a, b in _pairs(at)]
    values, start = kjt.values().tolist(), 0
    content = []
    for n in lengths.reshape(-1).tolist():
        content.append(tuple(values[start : start + n]))
        start += n
    for (a, b), k, solo in zip(_pairs(at), keys, alone, strict=True):
        assert k.shape == (features, b - a) and solo is not None and torch.equal(solo[0], k)
        for f in range(features):
            mine = content[f * rows + a : f * rows + b]
            for i in range(b - a):
                for j in range(b - a):
                    same = bool(k[f, i] == k[f, j])
                    assert same <= (mine[i] == mine[j]), (f, a, i, j)
                    assert collide or same == (mine[i] == mine[j]), (f, a, i, j)


def _pairs(at: list[int]) -> list[tuple[int, int]]:
    return list(itertools.pairwise(at))


def _part(kjt: KeyedJaggedTensor, lengths: torch.Tensor, a: int, b: int) -> KeyedJaggedTensor:
    """The bags of samples a..b, as the sample owner's own batch."""
    per = kjt.values().split(lengths.reshape(-1).tolist())
    rows = lengths.shape[1]
    keep = [per[f * rows + i] for f in range(lengths.shape[0]) for i in range(a, b)]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(),
        values=torch.cat(keep) if keep else kjt.values()[:0],
        lengths=lengths[:, a:b].reshape(-1).int(),
    )


def test_weighted_bags_or_another_layout_are_not_merged() -> None:
    lengths = torch.ones(2, 5, dtype=torch.int64)
    assert bag_keys(_kjt(lengths, 3, 0, weighted=True), [0, 5], 2) is None
    assert bag_keys(_kjt(lengths, 3, 0), [0, 4], 2) is None
    assert bag_keys(None, [0, 5], 2) is None


@given(bags=_bags(), width=st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_a_content_travels_once_and_its_gradients_as_one_sum(
    bags: tuple[torch.Tensor, int, int], width: int
) -> None:
    """Forward: the table owner's picks carry each content's first bag, in key order, and the
    sample owner's merges copy them back to every bag: the block as it was. Backward: the
    merges sum each content's gradients and the picks put the sum on its first bag, zero
    elsewhere: per content, the same sum as the plain block's."""
    lengths, ids, seed = bags
    features, rows = lengths.shape
    got = bag_keys(_kjt(lengths, ids, seed), [0, rows], features)
    assert got is not None
    keys = got[0]
    (pick,), (merge,) = merged([keys], [keys.clone()])
    assert pick.counts == merge.counts == [len(set(k.tolist())) for k in keys]
    fs, cols = list(range(features)), [f * width for f in range(features)]
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(features, 64, width, generator=g)
    # a bag's pooled row is a function of its key
    x = torch.cat([table[f, keys[f] % 64] for f in fs], 1)
    sent, counts = pick.taken(x, fs, cols, width)
    assert counts == pick.counts and sent.shape == (sum(counts), width)
    for f in fs:  # first bags, keys ascending
        first = pick.order[: pick.counts[f], f]
        got = keys[f, first]
        assert torch.equal(got, torch.unique(keys[f]))
        assert all(int(i) == int((keys[f] == keys[f, i]).nonzero()[0]) for i in first)
    back = torch.zeros_like(x)
    merge.place(back, sent, fs, cols, width)
    assert torch.equal(back, x)
    grad = torch.randn(rows, features * width, generator=g, dtype=torch.float64)
    sums, _ = merge.taken(grad, fs, cols, width)
    placed = torch.zeros_like(grad)
    pick.place(placed, sums, fs, cols, width)
    for f, c in zip(fs, cols, strict=True):
        for k in torch.unique(keys[f]):
            rows_of = keys[f] == k
            want = grad[rows_of, c : c + width].sum(0)
            assert torch.allclose(placed[rows_of, c : c + width].sum(0), want)
            assert int((placed[rows_of, c : c + width] != 0).any(1).sum()) <= 1
