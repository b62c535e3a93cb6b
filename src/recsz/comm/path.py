"""The one exchange path (:class:`BlockPath`): a step's direction as one :class:`Block` per
peer, each coded by its peer's direction (a :class:`~recsz.comm.route.Route`), the bytes
moved in one all-to-all, and one block per source decoded from them. What the blocks hold
and where their rows go is the caller's (:mod:`recsz.comm.embedding`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from recsz.codecs.checks import HeldChecks, read_all, riding
from recsz.comm.direction import Direction
from recsz.comm.exchange import PendingBytes, start_all_to_all_bytes
from recsz.comm.route import Route
from recsz.comm.stats import CommStats, GroupsSent
from recsz.devicepath import Indices
from recsz.profiling import stage


class Sent(NamedTuple):
    """One direction's bytes in flight, the rank's own rows where they skip the codec, and
    the route (codec by peer) that made them, which decodes them."""

    pending: PendingBytes
    own: torch.Tensor | None
    route: Route


class Block(NamedTuple):
    """What one peer gets from this rank (peer = destination) or sent it (peer = source):
    rows of ``tables``, ``sizes[i]`` rows of ``tables[i]``, one table after another."""

    peer: int
    tables: list[int]
    rows: torch.Tensor  # (sum(sizes), D)
    sizes: list[int]


class BlockPath:
    """Blocks to and from every peer of ``rank`` in a ``world``: coded by a route, moved,
    decoded; counted in ``stats`` while ``training``; ``check_bounds``: every payload
    decoded on the sender too and its bound asserted; ``host``: the ranks on this rank's
    host (None: every rank), whose bytes do not count as between hosts."""

    def __init__(
        self, rank: int, world: int, check_bounds: bool, host: frozenset[int] | None
    ) -> None:
        self.rank, self.world = rank, world
        self.host = frozenset(range(world)) if host is None else host
        self.stats = CommStats()
        self.check_bounds = check_bounds
        #: Training steps feed the policies and the statistics; evaluation does neither.
        self.training = True
        self._index_of = Indices()
        #: The checks' verdicts of received payloads, held to ride on the next read of
        #: sizes: the forward's until the backward's bytes are made (:meth:`_send`), the
        #: backward's, which gate its rows, until any later one (:meth:`settle`).
        self._fwd_checks, self._bwd_checks = HeldChecks(), HeldChecks()

    def settle(self) -> None:
        """Read every held check now (PayloadError for a damaged payload): before
        evaluating, saving a checkpoint, ending."""
        read_all(self._fwd_checks, self._bwd_checks)

    def _send(
        self,
        route: Route,
        step: int,
        blocks: list[Block],
        bound_src: tuple[list[int], torch.Tensor],
        raw_bytes: int,
        expect: list[int],
    ) -> Sent:
        """Encode one block per destination and start the byte all-to-all.

        A table's bound is set once per step from its values in ``bound_src`` (tables,
        and their values table-major: all that this rank sends of each), so every
        destination gets the same bound (:meth:`Direction.bounds`). ``raw_bytes`` is what
        one table's rows stood for before any id-aware reduction (the full (b, D) fp32
        slice), so ratios count those savings too. Each direction of the ``route`` turns
        its peers' blocks into one payload each (:meth:`Codec.encode_segments`, one call a
        direction); the sizes are read once where bytes leave the rank, and stay on the
        device otherwise. ``expect``: the rows each source sends here.
        """
        t0 = time.perf_counter()
        # An identity codec's payload is the rows' bytes: the rank's own rows skip it (an
        # empty payload in their place, their bytes counted as sent).
        own = blocks[self.rank].rows if route[self.rank].codec.identity else None
        skip = self.rank if own is not None else -1  # an empty payload: 0 bytes, known

        def rows(n: int, peer: int) -> int | None:
            return None if peer == skip else n

        payloads: dict[int, torch.Tensor] = {}
        recv: dict[int, int] | None = {}
        with riding(self._fwd_checks, self._bwd_checks):  # read with the sizes, if any
            for d, peers in route.groups:
                coded = [p for p in peers if p != skip]
                ebs = self._bounds(d, step, bound_src, [blocks[p] for p in coded])
                made, used = (
                    d.codec.encode_segments(
                        [(blocks[p].rows, blocks[p].sizes) for p in coded], ebs, self.world > 1
                    )
                    if coded
                    else ([], None)
                )
                payloads.update(zip(coded, made, strict=True))
                if own is not None and skip in peers:
                    payloads[skip] = own.new_empty(0, dtype=torch.uint8)
                    nb = torch.full((1,), own.numel() * own.element_size(), device=own.device)
                    i = peers.index(skip)
                    used = nb if used is None else torch.cat([used[:i], nb, used[i:]])
                if self.check_bounds and ebs is not None:
                    sent = [(p, blocks[p].rows, blocks[p].sizes) for p in coded]
                    worst = d.worst_error(sent, made, ebs)
                    self.stats.max_err[d.name] = max(self.stats.max_err[d.name], worst)
                if self.training and used is not None:
                    tabs = [(blocks[p].tables, blocks[p].sizes) for p in peers]
                    remote = [p != self.rank for p in peers]
                    apart = [p not in self.host for p in peers]
                    self.stats.count_groups(
                        GroupsSent(d.name, tabs, raw_bytes, used, ebs, remote, apart)
                    )
                got = d.known_sizes(
                    blocks[0].rows,
                    [payloads[p] for p in peers],
                    [rows(len(blocks[p].rows), p) for p in peers],
                    [rows(expect[p], p) for p in peers],
                )
                if recv is None or got is None:  # the values set some sizes: exchanged
                    recv = None
                else:
                    recv.update(zip(peers, got, strict=True))
        if self._fwd_checks:  # what did not ride: bytes made from the forward leave next
            read_all(self._fwd_checks, self._bwd_checks)
        self._time_codec(t0)
        pending = start_all_to_all_bytes(
            [[payloads[p]] for p in range(self.world)],
            self.world,
            None,
            None if recv is None else [recv[p] for p in range(self.world)],
        )
        return Sent(pending, own, route)

    def _bounds(
        self, d: Direction, step: int, bound_src: tuple[list[int], torch.Tensor], sent: list[Block]
    ) -> torch.Tensor | None:
        """The bounds of the tables of ``sent``'s blocks, in order, under ``d`` (None: its
        codec takes none)."""
        tables, values = bound_src
        all_ebs = d.bounds(step, tables, values, observe=self.training)
        if all_ebs is None:
            return None
        at = {t: j for j, t in enumerate(tables)}
        order = tuple(at[t] for blk in sent for t in blk.tables)
        return all_ebs[self._index_of(order, all_ebs.device)]

    def _receive(
        self,
        sent: Sent,
        tables_from: Callable[[int], list[int]],
        sizes_from: Callable[[int], list[int]],
        dim: int,
        hold: HeldChecks,
    ) -> list[Block]:
        """Wait for the bytes and decode them into one block per source, holding the
        tables ``tables_from(source)`` sends, checked to be ``sizes_from(source)`` rows of
        each. ``hold`` keeps the checks' verdicts for a later host read."""
        pending, route = sent.pending, sent.route
        with stage(f"recsz.a2a_{route.name}.wait"):
            bufs = pending.wait()
        if self.training:
            self.stats.a2a_s[route.name] += pending.waited_s
        t0 = time.perf_counter()
        sizes = [sizes_from(src) for src in range(self.world)]
        # Payloads this process made itself never left its memory: no checks to read.
        payloads = pending.pieces if pending.pieces is not None else bufs
        rows: dict[int, torch.Tensor] = {}
        if sent.own is not None:
            rows[self.rank] = sent.own
        with stage(f"recsz.a2a_{route.name}.decode"):  # (entered with nothing coded too)
            for d, peers in route.groups:
                coded = [s for s in peers if s not in rows]
                if not coded:
                    continue
                what = f"rank {self.rank}: {d.name} payloads from ranks {coded}"
                with hold.holding(what):
                    try:
                        decoded = d.codec.decode_segments(
                            [payloads[s] for s in coded],
                            [sizes[s] for s in coded],
                            dim,
                            check=pending.pieces is None,
                        )
                    except ValueError as e:
                        raise ValueError(f"{what}: {e}") from e
                rows.update(zip(coded, decoded, strict=True))
        blocks = []
        for src, want in enumerate(sizes):
            y = rows[src]
            if tuple(y.shape) != (sum(want), dim):
                raise ValueError(
                    f"rank {src} sent tables {tables_from(src)} ({route.name}) as "
                    f"{tuple(y.shape)}, expected {(sum(want), dim)} (do the ranks read the "
                    "same batch?)"
                )
            blocks.append(Block(src, tables_from(src), y, want))
        self._time_codec(t0)
        return blocks

    def _time_codec(self, t0: float) -> None:
        if self.training:
            self.stats.codec_s += time.perf_counter() - t0
