"""Which direction codes each peer's block of a step (:class:`Route`), and where the
codecs stop paying: ``--compress-scope`` (:func:`plain_within_host`).

Within a host, ranks talk over NVLink or shared memory, faster than any codec codes (the
fastest GPU codec here encodes at ~141 GB/s, NVLink moves ~900 GB/s); between hosts over
the network, where the codec's bytes saved pay. So under ``between-hosts`` a step's blocks
for the ranks of this rank's host (its own among them) go plain (lossless ``none``, the
own block skipping any coding) and only those crossing hosts go through the codec. A
pair of ranks agrees on the direction of its blocks both ways (being on one host is
symmetric), so each end decodes what the other coded without a word about it: the
payloads say the rest (the exchange never looks at a codec's type).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recsz.comm.direction import Direction

#: ``--compress-scope``: every block through the codecs (``all``), only those for ranks on
#: other hosts (``between-hosts``), or ``auto``: between hosts where the job spans several,
#: all where it runs on one (a lone host's run, the demo's, still compresses).
SCOPES = ("auto", "all", "between-hosts")


def host_key() -> str:
    """This rank's host, as torchrun's agents divide a job: the machine and the agent's
    node rank (``GROUP_RANK``; two agents on one machine stand for two hosts)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


def host_ranks(gather: Callable[[Any], list[Any]]) -> list[tuple[int, ...]]:
    """Every host's ranks (ascending), the hosts in the order of their first ranks, from
    every rank's :func:`host_key` (``gather``: one all-gather)."""
    out: dict[str, list[int]] = {}
    for r, key in enumerate(gather(host_key())):
        out.setdefault(key, []).append(r)
    return [tuple(ranks) for ranks in out.values()]


def host_of(hosts: list[tuple[int, ...]], rank: int) -> tuple[int, ...]:
    """The ranks of ``hosts`` (:func:`host_ranks`) on ``rank``'s host."""
    return next(h for h in hosts if rank in h)


def plain_within_host(scope: str, hosts: int) -> bool:
    """Whether ``--compress-scope`` sends the blocks within a host plain, in a job of
    ``hosts`` hosts."""
    if scope not in SCOPES:
        raise ValueError(f"--compress-scope {scope!r}: one of {', '.join(SCOPES)}")
    return scope == "between-hosts" or (scope == "auto" and hosts > 1)


@dataclass(frozen=True)
class Route:
    """One direction of a step, peer by peer: ``ways[p]`` codes the block for (or from)
    rank ``p``."""

    ways: tuple[Direction, ...]

    @classmethod
    def of(cls, world: int, coded: Direction, plain: Direction, near: frozenset[int]) -> Route:
        """``coded`` for every peer, but ``plain`` for those in ``near``."""
        return cls(tuple(plain if p in near else coded for p in range(world)))

    @property
    def name(self) -> str:
        return self.ways[0].name

    @property
    def forward_mask(self) -> bool:
        """A codec of the route drops forward entries whose gradients must be dropped too."""
        return any(d.codec.forward_mask for d in self.ways)

    @functools.cached_property
    def groups(self) -> list[tuple[Direction, list[int]]]:
        """Each direction and its peers (ascending), in the order the directions first
        appear: one batched coding call a direction (made once a route)."""
        out: dict[int, tuple[Direction, list[int]]] = {}
        for peer, d in enumerate(self.ways):
            out.setdefault(id(d), (d, []))[1].append(peer)
        return list(out.values())

    def __getitem__(self, peer: int) -> Direction:
        return self.ways[peer]
