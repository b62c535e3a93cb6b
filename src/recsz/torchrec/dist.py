"""TorchRec's pooled-embedding all-to-all through our codecs, policies and byte exchange.

TorchRec's table-wise output dist (``TwPooledEmbeddingDist``, which column-wise and
table-column-wise shardings use too) sends each rank's slice of the global batch of the
pooled embeddings it looked up, and the gradients back. Its quantized comms give every
split a size fixed in advance; our payloads' sizes depend on the data, so this dist
replaces the collective: sizes first, then bytes (:mod:`recsz.comm.exchange`).

Layout: rank r's features (TorchRec's "embedding shards" of this sharding) are
``dims[r]`` wide, side by side in its columns. Each (feature, destination) slice is one
table of a group (:meth:`Codec.encode_segments`) under the feature's bound for the step,
which the direction's policy sets from all the values of that feature this rank sends
(forward: the global batch; backward: this rank's gradient columns). Features of one
width form one group; a destination's groups travel framed as one buffer.

Bags of one content travel as one row both ways (:mod:`recsz.torchrec.rows`): the table
owner sends its filled bags (a :class:`Pick`; the sharder's ``input_dist`` emptied the
repeats), the sample owner copies each row to its content's bags and sums their gradients
(a :class:`Merge`, kept in TorchRec's per-batch sharding context).

Row-wise tables: :mod:`recsz.torchrec.rowwise`; table-row-wise and grid ones:
:mod:`recsz.torchrec.twrw`.

Backward: when TorchRec's gradient division is on, the gradient is divided by the world
size before it is encoded (TorchRec divides after the all-to-all), so the bound holds for
the gradient the tables receive and a lossless codec gives TorchRec's values bit for bit.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from recsz.codecs import get_codec
from recsz.codecs.checks import HeldChecks, read_sizes, riding
from recsz.codecs.framing import frame, unframe_all
from recsz.comm.direction import Direction
from recsz.comm.exchange import PendingBytes, start_all_to_all_bytes
from recsz.comm.route import Route, host_of, plain_within_host
from recsz.config import TrainConfig
from recsz.devicepath import Indices
from recsz.policy.factory import make_policy
from recsz.profiling import stage
from recsz.torchrec.handover import Received, lookup_lengths, missing_ids, theirs, weights_learn
from recsz.torchrec.rows import Merge, Pick, Rows


def local_hosts(world: int) -> list[tuple[int, ...]]:
    """TorchRec's hosts of ``world`` ranks: ``get_local_size()`` ranks each, in rank order
    (what its planner and its table-row-wise sharding take a host for)."""
    local = get_local_size(world)
    return [tuple(range(h, min(h + local, world))) for h in range(0, world, local)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)]


@functools.lru_cache(maxsize=256)
def _by_width(dims: tuple[int, ...]) -> dict[int, tuple[list[int], list[int]]]:
    """A block's features ``dims`` wide, side by side, split by width (ascending): each
    width's feature positions and their first columns. Layouts are fixed: made once."""
    cols = _offsets(dims)
    out: dict[int, tuple[list[int], list[int]]] = {}
    for w in sorted(set(dims)):
        fs = [i for i, x in enumerate(dims) if x == w]
        out[w] = (fs, [cols[i] for i in fs])
    return out


def _slabs(x: torch.Tensor, cols: list[int], width: int) -> torch.Tensor:
    """(features, rows, width): the columns of x starting at ``cols``."""
    return torch.stack([x[:, c : c + width] for c in cols])


#: What one step's directions share (which rows of each rank's block travel, both ways).
Context = dict[str, Any]


class CompressedPooledEmbeddingDist(nn.Module):
    """Drop-in for TorchRec's ``TwPooledEmbeddingDist``: ``forward(local_embs, ctx)`` gives
    an awaitable of (local batch, all features' dims), compressed both ways.

    Args:
        inner: the dist TorchRec built for this sharding; its layout is read here, and it
            still serves variable batch per feature (uncompressed, with a warning).
        config: codecs and bound policies (the fields of :class:`recsz.config.TrainConfig`).
    """

    #: whether the receiver adds its sources' blocks up (row-wise: partial sums)
    summed = False

    def __init__(self, inner: TwPooledEmbeddingDist, config: TrainConfig) -> None:
        super().__init__()
        self.inner = inner
        # TorchRec's private layout fields, read here and in _layout (stable since 0.x).
        self.pg: dist.ProcessGroup = self._group(inner)
        self.callbacks = list(getattr(inner, "_callbacks", None) or [])
        self.world, self.rank = self.pg.size(), dist.get_rank(self.pg)
        #: who this is in errors: the global rank (``rank`` is this one's in ``pg``)
        self.who = f"rank {dist.get_rank()}"
        #: each rank's block of a sample: its features' dims, and their keys (the
        #: policies' table ids: every feature of the sharding, in rank order)
        self.dims, self.keys = self._layout(inner)
        self.n_keys = len({k for ks in self.keys for k in ks})
        self.fwd = Direction("fwd", config.codec("fwd"), make_policy(config, "fwd", self.n_keys))
        self.bwd = Direction("bwd", config.codec("bwd"), make_policy(config, "bwd", self.n_keys))
        for d in (self.fwd, self.bwd):
            d.codec.warm_up()
        #: the ranks of the group on this rank's host (TorchRec's: LOCAL_WORLD_SIZE ranks a
        #: host, in rank order), and those whose blocks go plain (``compress_scope``)
        self.host, hosts = self._host()
        self.near = self.host if plain_within_host(config.compress_scope, hosts) else frozenset()
        #: each direction's route, made once: the plain direction for the near ranks
        none = get_codec("none")
        self.routes = {
            d.name: Route.of(self.world, d, Direction(d.name, none, d.policy), self.near)
            for d in (self.fwd, self.bwd)
        }
        self.step = 0
        #: of what left this rank: the bytes of its fp32 slices, and the payload bytes
        self.raw = {"fwd": 0, "bwd": 0}
        self.wire = {"fwd": 0, "bwd": 0}
        self.between = {"fwd": 0, "bwd": 0}  # the payload bytes to other hosts
        #: ``check_bounds``: every payload decoded before it leaves, its bound asserted;
        #: the largest error / bound seen
        self.check_bounds = config.check_bounds
        self.max_err = {"fwd": 0.0, "bwd": 0.0}
        #: which tables this dist carries, where (the sharder's account of its sharding; a
        #: checkpoint's state restores only into the same, :mod:`recsz.torchrec.state`)
        self.layout = ""
        #: the ids this sharding's lookup took in the step, set by the sharder's hook on
        #: the lookup, taken by the next forward
        self.seen: dict[str, Any] = {}
        self._index = Indices()  # the policies' keys, made once on the device
        #: The forward's checks' verdicts, read with the backward's lengths (:meth:`_send`).
        self._fwd_checks = HeldChecks()

    def _host(self) -> tuple[frozenset[int], int]:
        """The ranks of the group on this rank's host (TorchRec's topology: each host
        ``get_local_size()`` ranks in global rank order), and the group's hosts."""
        at = [dist.get_global_rank(self.pg, r) for r in range(self.world)]
        hosts = [h for h in local_hosts(dist.get_world_size()) if set(h) & set(at)]
        mine = host_of(hosts, at[self.rank])
        return frozenset(r for r in range(self.world) if at[r] in mine), len(hosts)

    @staticmethod
    def _group(inner: Any) -> dist.ProcessGroup:
        """The process group of TorchRec's dist ``inner``."""
        return inner._pg

    def _layout(self, inner: Any) -> tuple[list[tuple[int, ...]], list[list[int]]]:
        """Table-wise: rank r sends its own features ``dims[r]``, keys counted on."""
        dims = [tuple(d) for d in inner._emb_dim_per_rank_per_feature]
        starts = _offsets([len(d) for d in dims])
        return dims, [list(range(starts[r], starts[r + 1])) for r in range(self.world)]

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Any = None) -> Awaitable:
        if (stock := theirs(self, local_embs, sharding_ctx)) is not None:
            return stock
        per_rank = getattr(sharding_ctx, "batch_size_per_rank", None) or []
        if not per_rank:
            if local_embs.shape[0] % self.world:
                raise ValueError(
                    f"{self.who}: global batch {local_embs.shape[0]} is not divisible "
                    f"by the {self.world} ranks"
                )
            per_rank = [local_embs.shape[0] // self.world] * self.world
        # TorchRec keeps its dists outside the module tree (model.eval() does not reach
        # them): a forward counts as training when it can be differentiated.
        train = local_embs.requires_grad and torch.is_grad_enabled()
        self._fwd_checks.read()  # a forward's whose backward never ran
        step = self.step
        self.step += int(train)
        defer = not getattr(sharding_ctx, "recsz_learns", weights_learn(self.seen))
        data = local_embs.detach()
        at = _offsets(per_rank)
        mine, dims = self.keys[self.rank], self.dims[self.rank]
        blocks = [(data[at[r] : at[r + 1]], dims, mine) for r in range(self.world)]
        ctx = self._context(data, at, sharding_ctx)
        share = self.world if self.summed else 1  # the receiver sums that many
        ebs = self._bounds(self.fwd, step, data, dims, mine, train, share)
        pending = self._send(self.fwd, step, blocks, ebs, train, ctx.get("mine"), ctx.get("bits"))
        awaitable = Received(local_embs, self, pending, step, per_rank, ctx, defer)
        awaitable.callbacks.extend(self.callbacks)
        return awaitable

    # ---- both directions -------------------------------------------------------------
    def _send(
        self,
        d: Direction,
        step: int,
        blocks: list[tuple[torch.Tensor, tuple[int, ...], list[int]]],
        ebs: torch.Tensor | None,
        train: bool,
        picks: Sequence[Rows] | None = None,
        extra: list[list[torch.Tensor]] | None = None,
    ) -> PendingBytes:
        """Code ``blocks[r]`` = (rows for rank r, its features' dims, their keys) and start
        the byte exchange, under ``ebs`` (a bound by key, :meth:`_bounds`; None: the codec
        takes none). ``picks[r]``: only those rows of block r; ``extra[r]``: bytes framed
        ahead of its payloads. ``train``: count the bytes."""
        with stage(f"recsz.a2a_{d.name}.encode"):  # (as the trainer marks it)
            like = blocks[0][0]
            device = like.device
            parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in blocks]
            route = self.routes[d.name].groups  # each direction's destinations
            for width, (way, peers) in itertools.product(
                sorted({w for _, dims, _ in blocks for w in dims}), route
            ):
                groups, keys, dest = [], [], []
                for r in peers:
                    x, dims, ks = blocks[r]
                    if width not in _by_width(dims):
                        continue
                    fs, cols = _by_width(dims)[width]
                    if picks is None:
                        groups.append(
                            (_slabs(x, cols, width).reshape(-1, width), [x.shape[0]] * len(fs))
                        )
                    else:
                        groups.append(picks[r].taken(x, fs, cols, width))
                    keys += [ks[i] for i in fs]
                    dest.append(r)
                if not dest:
                    continue
                eb = None
                if ebs is not None and way.codec.error_bounded:
                    eb = ebs[self._index(keys, ebs.device)]
                # Untrimmed: every width's payload lengths are read to the host at once below.
                payloads, used = way.codec.encode_segments(groups, eb, trim=False)
                if self.check_bounds and eb is not None:
                    sent = [(r, rows, sizes) for r, (rows, sizes) in zip(dest, groups, strict=True)]
                    worst = way.worst_error(sent, payloads, eb)
                    self.max_err[d.name] = max(self.max_err[d.name], worst)
                for r, p, n in zip(dest, payloads, used, strict=True):
                    parts[r].append((p, n))
            flat = [(p, n) for ps in parts for p, n in ps]
            shaped = all(way.sized_by_shapes(like) for way, _ in route)
            if shaped or not flat:  # the casts: lengths known on the host
                lengths = iter([p.numel() for p, _ in flat])
            else:  # one read, the forward's verdicts along
                with riding(self._fwd_checks):
                    lengths = iter(read_sizes(torch.stack([n for _, n in flat])))
            self._fwd_checks.read()  # what did not ride: bytes made from the forward leave next
            ahead = extra or [[]] * len(parts)
            send = [
                [frame([*e, *(p[: next(lengths)] for p, _ in ps)]).to(device)]
                for e, ps in zip(ahead, parts, strict=True)
            ]
            if train:
                others = [r for r in range(self.world) if r != self.rank]
                self.raw[d.name] += sum(blocks[r][0].numel() * 4 for r in others)
                self.wire[d.name] += sum(send[r][0].numel() for r in others)
                far = (r for r in others if r not in self.host)
                self.between[d.name] += sum(send[r][0].numel() for r in far)
        return start_all_to_all_bytes(send, self.world, self.pg)

    def _bounds(
        self,
        d: Direction,
        step: int,
        x: torch.Tensor,
        dims: tuple[int, ...],
        keys: list[int],
        train: bool,
        share: int = 1,
    ) -> torch.Tensor | None:
        """Each feature's bound from its columns of ``x`` (every value of it sent), as a
        tensor indexed by key (None for a codec that takes none), divided by ``share``
        (the receiver sums that many). ``train``: a training step, which the policy sees."""
        ebs = torch.zeros(self.n_keys, dtype=torch.float64, device=x.device)
        with stage(f"recsz.a2a_{d.name}.encode"):  # (the encode's, as the trainer's)
            for width, (fs, cols) in _by_width(dims).items():
                at = [keys[i] for i in fs]
                got = d.bounds(step, at, _slabs(x, cols, width), observe=train)
                if got is None:
                    return None
                ebs[self._index(at, x.device)] = got.to(x.device)
        return ebs / share if share > 1 else ebs

    def _receive(
        self,
        d: Direction,
        pending: PendingBytes,
        rows: list[int],
        dims: list[tuple[int, ...]],
        hold: bool = False,
        picks: Sequence[Rows] | Callable[[list[torch.Tensor]], Sequence[Rows]] | None = None,
    ) -> list[torch.Tensor]:
        """Source s's block: ``rows[s]`` rows of its features ``dims[s]`` wide. Every
        width's checks are read at once; ``hold``: later (the forward's, whose backward
        reads them with its lengths, before any byte made from them leaves). ``picks``:
        the rows each source sent (the others zero), or a function of the part each
        framed ahead of its payloads that gives them."""
        with stage(f"recsz.a2a_{d.name}.wait"):
            bufs = pending.wait()
        with stage(f"recsz.a2a_{d.name}.decode"):
            widths = [list(_by_width(ds)) for ds in dims]  # each source's groups, in order
            ahead = int(callable(picks))
            parts = unframe_all(
                bufs,
                [len(w) + ahead for w in widths],
                [f"rank {s} ({d.name})" for s in range(self.world)],
                self._framed_ahead() if ahead else None,
            )  # every source's table of lengths in one host read (and what it framed ahead)
            if callable(picks):
                picks = picks([p[0] for p in parts])
                parts = [p[1:] for p in parts]
            new = torch.empty if picks is None else torch.zeros
            at = bufs[0].device
            out = [new(n, self._columns(ds), device=at) for n, ds in zip(rows, dims, strict=True)]
            checks = self._fwd_checks if hold else HeldChecks()
            try:
                with checks.holding(f"{self.who}: {d.name} payloads"):
                    route = self.routes[d.name].groups  # each direction's sources
                    for width, (way, peers) in itertools.product(
                        sorted({w for ws in widths for w in ws}), route
                    ):
                        srcs = [s for s in peers if width in widths[s]]
                        if not srcs:
                            continue
                        fcs = [_by_width(dims[s])[width] for s in srcs]
                        sizes = [
                            [rows[s]] * len(fs)
                            if picks is None
                            else [picks[s].counts[f] for f in fs]
                            for s, (fs, _) in zip(srcs, fcs, strict=True)
                        ]
                        payloads = [parts[s][widths[s].index(width)] for s in srcs]
                        try:  # (payload i: rank srcs[i]'s)
                            decoded = way.codec.decode_segments(payloads, sizes, width)
                        except ValueError as e:
                            raise ValueError(f"from ranks {srcs}: {e}") from e
                        for s, (fs, cols), y in zip(srcs, fcs, decoded, strict=True):
                            if picks is not None:
                                picks[s].place(out[s], y, fs, cols, width)
                                continue
                            slabs = y.view(len(cols), rows[s], width)
                            for j, c in enumerate(cols):
                                out[s][:, c : c + width] = slabs[j]
            except ValueError as e:
                raise ValueError(f"{self.who}: {d.name} payloads: {e}") from e
            if not hold:
                checks.read()
            return out

    def _framed_ahead(self) -> list[int] | None:
        """The bytes each source frames ahead of its payloads, where it frames a part of
        known size there (read on the host with the tables of lengths); None: unknown."""
        return None

    def _columns(self, dims: tuple[int, ...]) -> int:
        """The columns of a block of features ``dims`` wide: side by side here."""
        return sum(dims)

    def _context(self, data: torch.Tensor, at: list[int], sharding_ctx: Any) -> Context:
        """What the step's directions share, where the sample owners merged their bags
        (the sharder's ``input_dist``; rows.py): picks of my filled bags by destination
        (``mine``: the first bag of each content, the repeats came empty) and the merges of
        their rows by source (``theirs``), their counts in one host read."""
        f, n = len(self.dims[self.rank]), at[-1]
        filled = self._filled(n, data.device)
        merge = getattr(sharding_ctx, "recsz_merge", None)
        if merge is None:
            return {}
        inverse, counts, _ = merge
        if filled is None and f:
            raise missing_ids(self.who, f, n)
        if filled is None:
            filled = torch.zeros(n, 0, dtype=torch.bool, device=data.device)
        mine, read = Pick.of([filled[at[r] : at[r + 1]] for r in range(self.world)], counts)
        starts = _offsets([len(d) for d in self.dims])
        theirs = [
            Merge(
                inverse[:, starts[s] : starts[s + 1]].to(data.device),
                read[starts[s] : starts[s + 1]],
            )
            for s in range(self.world)
        ]
        return {"mine": mine, "theirs": theirs}

    def _filled(self, n: int, device: torch.device) -> torch.Tensor | None:
        """(n, my features): which bags this step's lookup found ids in (:func:`lookup_lengths`);
        None where it is missing or laid out otherwise."""
        lengths = lookup_lengths(self.seen, len(self.dims[self.rank]), n)
        return None if lengths is None else lengths.to(device) > 0

    def finish_forward(
        self, pending: PendingBytes, per_rank: list[int], hold: bool, ctx: Context
    ) -> torch.Tensor:
        """(local batch, all dims); ``hold``: a backward follows (:meth:`_receive`)."""
        rows = [per_rank[self.rank]] * self.world
        got = self._receive(self.fwd, pending, rows, self.dims, hold, ctx.get("theirs"))
        return torch.cat(got, 1)

    def start_backward(self, grad: torch.Tensor, step: int, ctx: Context) -> PendingBytes:
        """(local batch, all dims) gradient: coded and sent to the tables' owners."""
        grad = self._divided(grad)
        every = tuple(w for ds in self.dims for w in ds)
        keys = [k for ks in self.keys for k in ks]
        at = _offsets([sum(ds) for ds in self.dims])
        blocks = [
            (grad[:, at[r] : at[r + 1]], self.dims[r], self.keys[r]) for r in range(self.world)
        ]
        ebs = self._bounds(self.bwd, step, grad, every, keys, True)
        return self._send(self.bwd, step, blocks, ebs, True, ctx.get("theirs"))

    def _divided(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as the tables will take it: divided by the world size where
        TorchRec's gradient division is on (it divides after the collective)."""
        grad = grad.contiguous()
        return grad / self.world if get_gradient_division() else grad

    def finish_backward(
        self, pending: PendingBytes, per_rank: list[int], ctx: Context
    ) -> torch.Tensor:
        """What :meth:`start_backward` sent -> (global batch, my dims) on the table owner."""
        dims = [self.dims[self.rank]] * self.world
        return torch.cat(self._receive(self.bwd, pending, per_rank, dims, picks=ctx.get("mine")))
