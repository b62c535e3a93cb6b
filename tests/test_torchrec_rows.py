"""recsz.torchrec.rows: which rows of a block travel, against plain Python references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchrec", reason="TorchRec (make test installs it)")

from torchrec import KeyedJaggedTensor

import recsz.torchrec.rows as rows_module
from recsz.torchrec.rows import Merge, Pick, first_bags


@st.composite
def _bags(draw: st.DrawFn) -> KeyedJaggedTensor:
    """Bags of 0-3 ids from a few, so that contents repeat."""
    features, rows = draw(st.integers(1, 4)), draw(st.integers(0, 30))
    most, ids = draw(st.integers(0, 3)), draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lengths = torch.randint(0, most + 1, (features * rows,), generator=g)
    values = torch.randint(0, ids, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(features)], values=values, lengths=lengths.int(), stride=rows
    )


def _first_bags(kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """first_bags' first bags and contents (its third output: the test below)."""
    lengths = kjt.lengths().view(len(kjt.keys()), kjt.stride())
    return first_bags(lengths, kjt.offsets()[:-1], kjt.values())[:2]


def _contents(kjt: KeyedJaggedTensor) -> list[list[tuple[int, ...]]]:
    """Each feature's bags' ids, in order."""
    values, at, out = kjt.values().tolist(), 0, []
    for n in kjt.lengths().tolist():
        out.append(tuple(values[at : at + n]))
        at += n
    rows = kjt.stride()
    return [out[f * rows : (f + 1) * rows] for f in range(len(kjt.keys()))]


@given(kjt=_bags())
@settings(max_examples=80, deadline=None)
def test_first_bags_against_a_reference(kjt: KeyedJaggedTensor) -> None:
    """A bag is first when it holds ids and no earlier bag of its feature holds the same
    ids in the same order; contents are numbered in the order of their first bags."""
    first, inverse = _first_bags(kjt)
    for f, bags in enumerate(_contents(kjt)):
        order: dict[tuple[int, ...], int] = {}
        for i, ids in enumerate(bags):
            new = bool(ids) and ids not in order
            if new:
                order[ids] = len(order)
            assert bool(first[f, i]) == new, (f, i)
            assert int(inverse[f, i]) == (order[ids] if ids else -1), (f, i)


@given(kjt=_bags())
@settings(max_examples=40, deadline=None)
def test_when_every_hash_collides_no_two_contents_merge(kjt: KeyedJaggedTensor) -> None:
    """With every bag hashing alike, the ids' check still keeps different bags apart (bags
    of one content may then stay apart: fewer merged, none wrong), and every bag points
    to a first bag of its own ids."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows_module, "mix32", lambda x: x * 0)
        first, inverse = _first_bags(kjt)
    for f, bags in enumerate(_contents(kjt)):
        firsts = [i for i in range(len(bags)) if first[f, i]]
        for i, ids in enumerate(bags):
            k = int(inverse[f, i])
            assert k == -1 if not ids else bags[firsts[k]] == ids, (f, i)


@given(kjt=_bags(), width=st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_a_content_travels_once_and_its_gradients_as_one_sum(
    kjt: KeyedJaggedTensor, width: int
) -> None:
    """Forward: the table owner's pick of the bags left filled (each content's first, the
    repeats emptied) carries one row a content, and the sample owner's merge copies it back
    to every bag of that content (zero: empty bags): the block as it was. Backward: the
    merge sums each content's gradients and the pick puts the sum on its first bag: per
    content, the same sum as the plain block's; an empty bag's gradient goes nowhere."""
    first, inverse = _first_bags(kjt)
    features, rows = first.shape
    (pick,), counts = Pick.of([first.t()], first.sum(1))
    merge = Merge(inverse.t(), counts)
    assert pick.counts == merge.counts
    fs, cols = list(range(features)), [f * width for f in range(features)]
    g = torch.Generator().manual_seed(rows * 31 + width)
    contents = _contents(kjt)
    table = {ids: torch.randn(width, generator=g) for bags in contents for ids in bags}
    x = torch.zeros(rows, features * width)
    for f, bags in enumerate(contents):
        for i, ids in enumerate(bags):
            x[i, cols[f] : cols[f] + width] = table[ids] if ids else 0
    sent, n = pick.taken(x, fs, cols, width)
    assert n == pick.counts and sent.shape == (sum(n), width)
    back = torch.full_like(x, float("nan"))
    merge.place(back, sent, fs, cols, width)
    assert torch.equal(back, x)
    grad = torch.randn(rows, features * width, generator=g, dtype=torch.float64)
    sums, _ = merge.taken(grad, fs, cols, width)
    placed = torch.zeros_like(grad)
    pick.place(placed, sums, fs, cols, width)
    for f, bags in enumerate(contents):
        c = cols[f]
        for ids in set(bags):
            of = torch.tensor([b == ids for b in bags])
            want = grad[of, c : c + width].sum(0) if ids else torch.zeros(width).double()
            assert torch.allclose(placed[of, c : c + width].sum(0), want)
            assert int((placed[of, c : c + width] != 0).any(1).sum()) <= 1


@given(kjt=_bags())
@settings(max_examples=60, deadline=None)
def test_each_bag_points_at_its_contents_first(kjt: KeyedJaggedTensor) -> None:
    """Row-wise tables' merges (first_bags' third output): each bag's row is its content's
    first bag (the first bag, in order, with the same ids), an empty bag's its own."""
    lengths = kjt.lengths().view(len(kjt.keys()), kjt.stride())
    src = first_bags(lengths, kjt.offsets()[:-1], kjt.values())[2]
    for f, bags in enumerate(_contents(kjt)):
        for i, ids in enumerate(bags):
            want = bags.index(ids) if ids else i
            assert int(src[f, i]) == want, (f, i)
