"""The ``eb`` hook's exchange (:mod:`recsz.comm.dp_hooks`, ``--dp-comm eb``): a bucket's
gradient coded under an error bound with error feedback, and the collectives that bring
every rank the same sum of them (``--dp-eb-collective``: ``allgather``, ``rsag``, ``hosts``;
the module docstring of :mod:`recsz.comm.dp_hooks` says how each goes)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from recsz.codecs import Codec
from recsz.codecs.checks import HeldChecks, riding
from recsz.comm.dct_dp import add_residual, all_gather_ragged, bucket_params, keep_residual
from recsz.comm.exchange import start_all_to_all_bytes
from recsz.comm.route import host_of
from recsz.policy.base import absolute_bounds

if TYPE_CHECKING:
    from recsz.comm.dp_hooks import DPComm


@dataclass
class EBState:
    codec: Codec
    eb: float  # relative to each bucket's range
    collective: str = "allgather"  # or "rsag" (module docstring)
    residual: dict[int, torch.Tensor] = field(default_factory=dict)  # per parameter
    #: rsag and hosts: what coding the sum of this rank's chunks (hosts: of its piece of
    #: its host's sum) lost, per parameter (zeros where another rank owns the chunk)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    param_index: dict[int, int] = field(default_factory=dict)  # id(param) -> position
    #: rsag: each bucket layout's positions per owner (:func:`_owned_positions`), made once
    owned: dict[tuple[int, ...], list[torch.Tensor]] = field(default_factory=dict)
    hosts: HostGroups | None = None  # hosts: the groups within and across hosts
    #: the ranks on this rank's host (its own among them): what reaches the others is
    #: counted as between hosts (:attr:`DPComm.bytes_between`)
    near: frozenset[int] = frozenset({0})


@dataclass(frozen=True)
class HostGroups:
    """``--dp-eb-collective hosts``: the group of this rank's host, the group of the ranks
    of its index on every host, its index, the ranks a host, and the hosts."""

    within: Any
    across: Any
    index: int
    local: int
    count: int


def host_groups(hosts: list[tuple[int, ...]], rank: int) -> HostGroups:
    """The process groups of ``hosts`` (each host's global ranks), made on every rank in
    the same order, as ``dist.new_group`` asks; a ValueError where the hosts hold
    different numbers of ranks (a piece of the bucket a host's index)."""
    if len({len(h) for h in hosts}) != 1:
        raise ValueError(
            f"--dp-eb-collective hosts needs as many ranks on every host, not "
            f"{[len(h) for h in hosts]} (torchrun's nodes)"
        )
    within = across = None
    index = host_of(hosts, rank).index(rank)
    for h in hosts:
        made = dist.new_group(list(h))
        within = made if rank in h else within
    for j in range(len(hosts[0])):
        made = dist.new_group([h[j] for h in hosts])
        across = made if j == index else across
    return HostGroups(within, across, index, len(hosts[0]), len(hosts))


def exchange(dp: DPComm, bucket: Any) -> torch.futures.Future:
    st: EBState = dp.inner
    grad = bucket.buffer()
    keys, sizes = bucket_params(st.param_index, bucket, "eb hook")
    acc = add_residual(grad, st.residual, keys, sizes)
    # Every payload's checks are read once, when the bucket is done (or with a sizes read
    # that comes first): on a GPU two host reads a bucket, its payload's size and the checks.
    checks = HeldChecks()
    with checks.holding("eb hook"), riding(checks):
        if st.collective == "rsag" and dp.world > 1:
            out = _reduce_scatter_gather(dp, acc, keys, sizes)
        elif st.hosts is not None:
            out = _across_hosts(dp, st.hosts, acc, keys, sizes)
        else:
            payload, mine = _code(st, acc)
            keep_residual(st.residual, keys, sizes, acc - mine)  # what was lost, sent later
            if dp.world == 1:
                out = mine.clone()
            else:
                out = torch.zeros_like(grad)
                me = dist.get_rank(dp.group)
                got, sent = all_gather_ragged([payload], dp.world, dp.group)
                dp.bytes_sent += sent
                _between(dp, sent // (dp.world - 1) * (dp.world - len(st.near)))
                for r, (p,) in enumerate(got):
                    out += mine if r == me else _decoded(st, p, grad)
    checks.read()
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out.div_(dp.world))
    return fut


def flushed(dp: DPComm, bucket: Any) -> torch.Tensor:
    """The bucket's gradient with everything error feedback holds for it (the residual of
    this rank's payload, and rsag's of the sums of chunks it coded), which is then
    cleared."""
    st: EBState = dp.inner
    grad = bucket.buffer()
    keys, sizes = bucket_params(st.param_index, bucket, "eb hook")
    return _taken(_taken(grad, st.residual, keys, sizes), st.reduced, keys, sizes)


def _taken(
    x: torch.Tensor, held: dict[int, torch.Tensor], keys: list[int], sizes: list[int]
) -> torch.Tensor:
    """``x`` plus what ``held`` keeps of the bucket's parameters ``keys``, which it then
    keeps no longer (``x`` itself where it keeps none)."""
    out = add_residual(x, held, keys, sizes)
    for k in keys:
        held.pop(k, None)
    return out


#: The eb hook codes a bucket as rows of this many values (a GPU's coder takes the row
#: width as a kernel constant: a bucket is never one row of a million values), padded with
#: copies of its first value, which leave the range the relative bound is taken from as it is.
EB_ROW = 64


def _code(st: EBState, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat) coded under the relative bound (computed where x is), and what the
    payload decodes to."""
    flat = x.detach().reshape(-1)
    rows = torch.cat([flat, flat[:1].expand(-flat.numel() % EB_ROW)]).view(-1, EB_ROW)
    ebs = absolute_bounds([st.eb], "rel", rows.unsqueeze(0)) if st.codec.error_bounded else None
    (payload,), _ = st.codec.encode_segments([(rows, [len(rows)])], ebs)
    return payload, _decoded(st, payload, x)


def _decoded(st: EBState, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A payload of :func:`_code` back as ``like``'s flat values (the padding dropped);
    its layout follows from ``like``'s size, so nothing of it is read on the host first."""
    rows = -(-like.numel() // EB_ROW)
    (y,) = st.codec.decode_segments([payload], [[rows]], EB_ROW)
    return y.reshape(-1)[: like.numel()].to(like.device, like.dtype)


def _reduce_scatter_gather(
    dp: DPComm, acc: torch.Tensor, keys: list[int], sizes: list[int]
) -> torch.Tensor:
    """The sum over ranks of ``acc`` by rsag (module docstring), the same on every rank.

    Rank j owns the j-th of W near-equal pieces of every parameter, so who owns an
    element does not depend on DDP's bucket layout (which it rebuilds after the first
    step, and a resumed run starts from the first one), and neither do the owners'
    residuals or the set of values each chunk's bound is taken from.
    """
    st: EBState = dp.inner
    me = dist.get_rank(dp.group)
    if tuple(sizes) not in st.owned:
        st.owned[tuple(sizes)] = _owned_positions(sizes, dp.world, acc.device)
    at = st.owned[tuple(sizes)]
    coded = [_code(st, acc[idx]) for idx in at]
    sent = torch.empty_like(acc)
    for idx, (_, y) in zip(at, coded, strict=True):
        sent[idx] = y
    keep_residual(st.residual, keys, sizes, acc - sent)
    bufs = start_all_to_all_bytes([[p] for p, _ in coded], dp.world, dp.group).wait()
    dp.bytes_sent += sum(p.numel() + 8 for r, (p, _) in enumerate(coded) if r != me)
    _between(dp, sum(p.numel() + 8 for r, (p, _) in enumerate(coded) if r not in st.near))
    # Chunk ``me`` of every rank, summed in rank order, and what was lost coding it before.
    total = torch.zeros_like(coded[me][1])
    for r, b in enumerate(bufs):
        total += coded[me][1] if r == me else _decoded(st, b, coded[me][1])
    total += add_residual(torch.zeros_like(acc), st.reduced, keys, sizes)[at[me]]
    payload, back = _code(st, total)
    lost = torch.zeros_like(acc)
    lost[at[me]] = total - back
    keep_residual(st.reduced, keys, sizes, lost)
    got, nbytes = all_gather_ragged([payload], dp.world, dp.group)
    dp.bytes_sent += nbytes
    _between(dp, nbytes // (dp.world - 1) * (dp.world - len(st.near)))
    out = torch.empty_like(acc)
    for r, (p,) in enumerate(got):
        out[at[r]] = back if r == me else _decoded(st, p, acc[at[r]])
    return out


def _across_hosts(
    dp: DPComm, h: HostGroups, acc: torch.Tensor, keys: list[int], sizes: list[int]
) -> torch.Tensor:
    """The sum over ranks of ``acc`` by ``hosts`` (module docstring), the same on every
    rank: the host's sum, plain, with what coding the host's sums lost before (each rank
    holds it for its piece: summed in wherever it lies, so a run resumed on another
    layout of hosts, or on one host, loses none of it); its piece ``h.index`` of every
    parameter coded, gathered from that piece's coders on every host and summed in host
    order; the summed pieces gathered within the host."""
    st: EBState = dp.inner
    total = _taken(acc, st.reduced, keys, sizes)  # in the sum now
    total = acc.clone() if total is acc else total
    dist.all_reduce(total, group=h.within)
    dp.bytes_sent += int(2 * (h.local - 1) / h.local * total.numel() * 4)
    if h.count == 1:  # nothing crosses hosts: the plain sum
        return total
    if tuple(sizes) not in st.owned:
        st.owned[tuple(sizes)] = _owned_positions(sizes, h.local, acc.device)
    at = st.owned[tuple(sizes)]
    mine = total[at[h.index]]
    payload, back = _code(st, mine)
    lost = torch.zeros_like(acc)
    lost[at[h.index]] = mine - back
    keep_residual(st.reduced, keys, sizes, lost)
    got, across = all_gather_ragged([payload], h.count, h.across)
    me = dist.get_rank(h.across)
    piece = torch.zeros_like(back)
    for r, (p,) in enumerate(got):
        piece += back if r == me else _decoded(st, p, back)
    pieces, within = all_gather_ragged([piece], h.local, h.within)
    dp.bytes_sent += across + within
    _between(dp, across)
    out = torch.empty_like(acc)
    for j, (p,) in enumerate(pieces):
        out[at[j]] = p
    return out


def _between(dp: DPComm, n: int) -> None:
    """``n`` more payload bytes to ranks on other hosts, where they are counted."""
    if dp.bytes_between is not None:
        dp.bytes_between += n


def _owned_positions(sizes: list[int], world: int, device: torch.device) -> list[torch.Tensor]:
    """Per rank, its positions in a bucket of parameters ``sizes`` long: the rank-th of
    ``world`` near-equal pieces of each parameter."""
    starts = [0, *itertools.accumulate(sizes)][:-1]
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for start, n in zip(starts, sizes, strict=True):
        for r, piece in enumerate(
            torch.arange(start, start + n, device=device).tensor_split(world)
        ):
            per_rank[r].append(piece)
    return [torch.cat(p) for p in per_rank]
