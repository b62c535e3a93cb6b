"""TorchRec's sharded embedding modules with our compressed output dists in their shardings.

:class:`CompressedShardedEBC` is TorchRec's ``ShardedEmbeddingBagCollection`` with its
output dists replaced through TorchRec's extension point for exactly this
(``create_embedding_bag_sharding``, a classmethod so that a subclass can change the
sharding it returns): :class:`CompressedPooledEmbeddingDist` for table-wise, column-wise
and table-column-wise tables (an all-to-all of pooled embeddings),
:class:`CompressedReduceScatterDist` for row-wise ones (a reduce-scatter of partial sums),
:class:`CompressedTwRwDist` for table-row-wise and grid ones (TorchRec's reduce-scatter
within a host, then our all-to-all between hosts). Its ``input_dist`` empties, in this
rank's batch, every bag of a table whose output we carry but the first of each content
(:mod:`recsz.torchrec.rows`) and keeps how the bags merged in TorchRec's per-batch sharding
context, for the output dist (a pipeline runs the next batch's input dist before this
one's output dist); a forward pre-hook on each sharding's lookup hands its dist the ids it
looked up (which bags are filled).

:class:`CompressedShardedEC` is TorchRec's ``ShardedEmbeddingCollection`` (sequence
embeddings, a row an id) with :class:`CompressedSequenceEmbeddingDist` in its table-wise,
column-wise and row-wise shardings (``create_embedding_sharding``).

Both share :class:`CompressingModule`: the ``compress="auto"`` switch (one a sharding
environment, asked once a training batch), and the dists' state in ``dmp.state_dict()``.
A sharding we do not carry is not offered to the planner (the sharders), and a plan that
asks for one is refused naming the tables.
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingEnv, ShardingType

from recsz.comm.switch import CompressionSwitch, device_sync, max_over
from recsz.config import TrainConfig
from recsz.torchrec import state
from recsz.torchrec.dist import CompressedPooledEmbeddingDist
from recsz.torchrec.rows import merged
from recsz.torchrec.rowwise import CompressedReduceScatterDist
from recsz.torchrec.sequence import CompressedSequenceEmbeddingDist
from recsz.torchrec.twrw import CompressedTwRwDist

#: Our dist of each pooled sharding whose output we carry.
COMPRESSED: dict[str, type[CompressedPooledEmbeddingDist] | type[CompressedTwRwDist]] = {
    ShardingType.TABLE_WISE.value: CompressedPooledEmbeddingDist,
    ShardingType.COLUMN_WISE.value: CompressedPooledEmbeddingDist,
    ShardingType.TABLE_COLUMN_WISE.value: CompressedPooledEmbeddingDist,
    ShardingType.ROW_WISE.value: CompressedReduceScatterDist,
    ShardingType.TABLE_ROW_WISE.value: CompressedTwRwDist,
    ShardingType.GRID_SHARD.value: CompressedTwRwDist,
}
#: The sequence shardings whose output we carry (all of TorchRec's but data-parallel).
SEQUENCE = {
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
}
#: The sharding with no output communication at all.
UNTOUCHED = {ShardingType.DATA_PARALLEL.value}


def compressed(d: Any) -> CompressedPooledEmbeddingDist | None:
    """Our compressed all-to-all in an output dist (table-row-wise and grid: the one between
    hosts); None in one of TorchRec's."""
    if isinstance(d, CompressedTwRwDist):
        return d.cross
    return d if isinstance(d, CompressedPooledEmbeddingDist) else None


def _refuse(kind: str, infos: Any, carried: set[str]) -> ValueError:
    names = sorted({i.embedding_config.name for i in infos})
    return ValueError(
        f"recsz: tables {', '.join(names)} are sharded {kind}; the compressed dists "
        f"carry {', '.join(sorted(carried))} (and {', '.join(UNTOUCHED)}) tables only"
    )


class CompressingModule:
    """What our sharded modules share (a mixin before TorchRec's sharded module): the
    ``compress="auto"`` switch, the batch count, the dists' state. The sharders make a
    subclass bound to their configuration."""

    recsz_config: ClassVar[TrainConfig]
    #: every dist this class made (TorchRec keeps them in a plain list, not as modules)
    recsz_dists: ClassVar[list[CompressedPooledEmbeddingDist]]
    #: each sharding environment's switch (TorchRec's DMP gives all its modules one)
    recsz_switches: ClassVar[weakref.WeakKeyDictionary[Any, CompressionSwitch]]
    # TorchRec's sharded module's, read here
    _env: ShardingEnv
    _device: torch.device | None
    _output_dists: list[Any]
    training: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        group, device = self._env.process_group, self._device or torch.device("cpu")
        #: whether a batch goes through the codecs (:mod:`recsz.comm.switch`), its ranks'
        #: step times combined over the module's group; one for all the modules of a model
        #: (e.g. an EBC and a feature-processed one), so that a batch goes one way in all
        #: and a trial times the steps of both ways
        switch = self.recsz_switches.get(self._env)
        if switch is None:
            switch = self.recsz_config.switch(agree=max_over(group), sync=device_sync(device))
            self.recsz_switches[self._env] = switch
        self.recsz_switch = switch
        #: training batches this module's input dist has seen (the switch's step)
        self.recsz_batches = 0
        #: whether the batch whose embeddings left last went plain (:meth:`_sending`)
        self.recsz_sent_plain = False

    @classmethod
    def _carry(
        cls, sharding: Any, kind: str, infos: Any, ours: Callable[[Any], Any]
    ) -> dict[str, Any]:
        """Make ``sharding``'s output dists ours (``ours(TorchRec's dist)``), each kept in
        :attr:`recsz_dists` with the layout it carries; what the sharding's lookup hands
        over to them (``seen``)."""
        build, made = sharding.create_output_dist, cls.recsz_dists
        # which tables our dist carries, where (a checkpoint's state restores into the same)
        tables = sorted(
            [i.embedding_config.name, i.param_sharding.ranks, str(i.param_sharding.sharding_spec)]
            for i in infos
        )
        layout = json.dumps([kind, *tables])
        seen: dict[str, Any] = {}

        def create_output_dist(device: torch.device | None = None) -> Any:
            out = ours(build(device=device))
            one = compressed(out)
            assert one is not None  # (one of ours)
            one.layout = layout
            made.append(one)
            out.seen = seen
            return out

        sharding.create_output_dist = create_output_dist
        return seen

    def _ours(self) -> list[CompressedPooledEmbeddingDist]:
        """This module's compressed dists, in its shardings' order (from TorchRec's private
        ``_output_dists``, read here only)."""
        return [c for d in self._output_dists if (c := compressed(d)) is not None]

    def get_extra_state(self) -> bytes:
        """What the compressed dists and the switch carry from step to step, in
        ``dmp.state_dict()`` (:func:`recsz.torchrec.state.dump`)."""
        switch = {"batches": self.recsz_batches, **self.recsz_switch.state_dict()}
        return state.dump(self._ours(), dist.get_rank(), switch)

    def set_extra_state(self, saved: Any) -> None:
        """Restore :meth:`get_extra_state`'s state (:func:`recsz.torchrec.state.load`); the
        switch too where the blob has it (the modules sharing it load the same)."""
        rank = dist.get_rank()
        switch = state.load(self._ours(), saved, rank)
        if switch is not None:
            try:
                self.recsz_batches = int(switch.pop("batches"))
                self.recsz_switch.load_state_dict(switch)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"recsz: rank {rank}: the checkpoint's switch state: {e}") from e

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """TorchRec's, and a checkpoint without our state (written by stock DMP) loads too,
        under ``strict``: the dists then start afresh, with a warning."""
        missing: list[str] = args[2]
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]
        key = prefix + "_extra_state"  # where nn.Module keeps get_extra_state's
        if key in missing:
            missing.remove(key)
        if key not in state_dict and hasattr(self, "recsz_switch"):  # (not TorchRec's own
            # load of the unsharded module's state, within the sharded EC's __init__)
            warnings.warn(
                f"recsz: the checkpoint holds no sharder state ({key}): the compressed dists' "
                "bound policies and step counts start afresh",
                stacklevel=2,
            )

    def compute_and_output_dist(self, ctx: Any, input: Any) -> Any:
        self._sending(ctx)
        return super().compute_and_output_dist(ctx, input)  # type: ignore[misc]

    def output_dist(self, ctx: Any, output: Any) -> Any:
        self._sending(ctx)  # (a managed-collision EBC's forward calls this one)
        return super().output_dist(ctx, output)  # type: ignore[misc]

    def _sending(self, ctx: Any) -> None:
        """Note the way of the batch whose embeddings now leave: under TorchRec's pipeline
        the switch was asked for the next batch already (its input dist runs ahead), and
        this batch's backward follows (the dense hook's step, :func:`sent_plain`)."""
        self.recsz_sent_plain = any(getattr(s, "recsz_plain", False) for s in self._contexts(ctx))

    def _shardings(self) -> int:
        """How many shardings the module has (a context each)."""
        raise NotImplementedError

    def _contexts(self, ctx: Any) -> list[Any]:
        """This module's shardings' contexts in the batch's (the last ones: a wrapping
        module's context may hold others before them)."""
        return ctx.sharding_contexts[-self._shardings() :]

    def _compressing(self) -> bool:
        """The switch's way for this batch: the module's training batches are the switch's
        steps (one ask a batch, all ranks and the model's other modules alike); another
        batch takes the way chosen."""
        switch = self.recsz_switch
        if not (self.training and torch.is_grad_enabled()):
            switch.pause()
            return switch.chosen
        self.recsz_batches += 1
        return switch.compress(self.recsz_batches - 1)


class CompressedShardedEBC(CompressingModule, ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose shardings build compressed output dists."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: how the bags merge, by feature order (:func:`recsz.torchrec.rows.merge_layout`)
        self._recsz_layouts: dict[tuple[str, ...], Any] = {}

    def _shardings(self) -> int:
        return len(self._embedding_shardings)

    @classmethod
    def create_embedding_bag_sharding(
        cls, sharding_infos: Any, env: ShardingEnv, *args: Any, **kw: Any
    ) -> Any:
        sharding = super().create_embedding_bag_sharding(sharding_infos, env, *args, **kw)
        kind = sharding_infos[0].param_sharding.sharding_type
        if kind in UNTOUCHED:
            return sharding
        if kind not in COMPRESSED:
            raise _refuse(kind, sharding_infos, set(COMPRESSED))
        config, ours = cls.recsz_config, COMPRESSED[kind]
        # The ids the lookup took, for the dist's forward, which follows it.
        seen = cls._carry(sharding, kind, sharding_infos, lambda inner: ours(inner, config))
        # Our dists take merged bags (input_dist)
        sharding.recsz_merged = True
        lookup_of = sharding.create_lookup

        def create_lookup(*args: Any, **kwargs: Any) -> Any:
            lookup = lookup_of(*args, **kwargs)
            lookup.register_forward_pre_hook(lambda _, a: seen.update(lookup=a[0]))
            return lookup

        sharding.create_lookup = create_lookup
        return sharding

    def input_dist(self, ctx: Any, features: Any) -> Any:
        """TorchRec's, on this rank's ids with the bags of our dists' tables that repeat an
        earlier bag emptied (``torchrec/rows.py``: that content's row travels once, from
        its first bag); each such sharding's context keeps how its bags merged, for its
        output dist (a pipeline runs the next batch's input dist before this one's). A
        batch the switch sends plain (``compress="auto"``) keeps its bags, and its context
        says so: the output dists then hand it to TorchRec's (:func:`handover.theirs`).
        A module with a mean-pooled row-wise table merges nothing: TorchRec divides its
        outputs by a divisor it takes from these lengths (an emptied bag's would be 0)."""
        plain = not self._compressing()
        merges, features = (
            ({}, features)
            if plain or self._has_mean_pooling_callback
            else merged(self._embedding_shardings, self._recsz_layouts, features)
        )
        got = super().input_dist(ctx, features)
        for i, sctx in enumerate(self._contexts(ctx)):
            sctx.recsz_merge = merges.get(i)
            sctx.recsz_plain = plain
        return got

    def compute(self, ctx: Any, dist_input: Any) -> Any:
        """TorchRec's lookups. Where another module ran the input dist (a managed-collision
        EBC's collection does: its sharding contexts carry no flag of ours), the switch is
        asked here, once a batch, and every bag travels (none merged)."""
        contexts = [s for s in self._contexts(ctx) if s]
        if contexts and not any(hasattr(s, "recsz_plain") for s in contexts):
            plain = not self._compressing()
            for sctx in contexts:
                sctx.recsz_plain = plain
        return super().compute(ctx, dist_input)


class CompressedShardedEC(CompressingModule, ShardedEmbeddingCollection):
    """ShardedEmbeddingCollection whose shardings build compressed sequence dists."""

    def _shardings(self) -> int:
        return len(self._sharding_type_to_sharding)

    @classmethod
    def create_embedding_sharding(
        cls, sharding_type: str, sharding_infos: Any, env: ShardingEnv, *args: Any, **kw: Any
    ) -> Any:
        sharding = super().create_embedding_sharding(
            sharding_type, sharding_infos, env, *args, **kw
        )
        if sharding_type in UNTOUCHED:
            return sharding
        if sharding_type not in SEQUENCE:
            raise _refuse(sharding_type, sharding_infos, SEQUENCE)
        config, rw = cls.recsz_config, sharding_type == ShardingType.ROW_WISE.value
        features = (
            [len(sharding.feature_names())] * env.world_size if rw else sharding.features_per_rank()
        )
        cls._carry(
            sharding,
            sharding_type,
            sharding_infos,
            lambda inner: CompressedSequenceEmbeddingDist(inner, config, features, rw),
        )
        return sharding

    def input_dist(self, ctx: Any, features: Any) -> Any:
        """TorchRec's; each sharding's context says whether the switch sends the batch
        plain (``compress="auto"``: TorchRec's dists then carry it)."""
        plain = not self._compressing()
        got = super().input_dist(ctx, features)
        for sctx in self._contexts(ctx):
            sctx.recsz_plain = plain
        return got
