"""A TorchRec sharder whose embedding bags send compressed pooled embeddings.

``CompressedEBCSharder`` is TorchRec's ``EmbeddingBagCollectionSharder`` with its
sharded module's output dist replaced by :class:`CompressedPooledEmbeddingDist` for
table-wise, column-wise and table-column-wise tables (an all-to-all of pooled
embeddings) and by :class:`CompressedReduceScatterDist` for row-wise ones (a
reduce-scatter of partial sums), through TorchRec's extension point for exactly this
(``ShardedEmbeddingBagCollection.create_embedding_bag_sharding``, a classmethod so that
a subclass can change the sharding it returns), and by :class:`CompressedTwRwDist` for
table-row-wise and grid ones (TorchRec's reduce-scatter within a host, then our all-to-all
between hosts). A sharding we do not carry (none of TorchRec 1.8's pooled ones) would not
be offered to the planner, and a plan that asks for one is refused naming the tables.

The sharded module's ``input_dist`` empties, in this rank's batch, every bag of a table
whose output we carry but the first of each content (:mod:`recsz.torchrec.rows`) and keeps how
the bags merged in TorchRec's per-batch sharding context, for the output dist (a pipeline
runs the next batch's input dist before this one's output dist); a forward pre-hook on
each sharding's lookup hands its dist the ids it looked up (which bags are filled).
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Callable
from dataclasses import fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingType

from recsz.comm.switch import CompressionSwitch, device_sync, max_over
from recsz.config import TrainConfig
from recsz.torchrec import state
from recsz.torchrec.dist import CompressedPooledEmbeddingDist
from recsz.torchrec.rows import merged
from recsz.torchrec.rowwise import CompressedReduceScatterDist
from recsz.torchrec.twrw import CompressedTwRwDist

#: Our dist of each sharding whose output we carry, and the one with no output
#: communication at all.
COMPRESSED: dict[str, type[CompressedPooledEmbeddingDist] | type[CompressedTwRwDist]] = {
    ShardingType.TABLE_WISE.value: CompressedPooledEmbeddingDist,
    ShardingType.COLUMN_WISE.value: CompressedPooledEmbeddingDist,
    ShardingType.TABLE_COLUMN_WISE.value: CompressedPooledEmbeddingDist,
    ShardingType.ROW_WISE.value: CompressedReduceScatterDist,
    ShardingType.TABLE_ROW_WISE.value: CompressedTwRwDist,
    ShardingType.GRID_SHARD.value: CompressedTwRwDist,
}
UNTOUCHED = {ShardingType.DATA_PARALLEL.value}
_OURS = {f.name for f in fields(TrainConfig)}
#: The fields the compressed dists read: the codecs and the bound policies' settings.
TAKEN = {
    "fwd_codec", "bwd_codec", "coder", "eb_policy", "fwd_eb", "bwd_eb", "eb_mode",
    "fwd_class_eb", "bwd_class_eb", "hindex_probe_steps", "hindex_every", "decay_schedule",
    "decay_c", "decay_t", "dct_keep", "dct_refresh", "check_bounds", "compress",
    "compress_trial", "compress_every",
}  # fmt: skip


class _CompressedEBC(ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose shardings build compressed output dists;
    :class:`CompressedEBCSharder` makes a subclass bound to its configuration."""

    recsz_config: ClassVar[TrainConfig]
    #: every dist this class made (TorchRec keeps them in a plain list, not as modules)
    recsz_dists: ClassVar[list[CompressedPooledEmbeddingDist]]
    #: each sharding environment's switch (TorchRec's DMP gives all its modules one)
    recsz_switches: ClassVar[weakref.WeakKeyDictionary[Any, CompressionSwitch]]

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
        #: how the bags merge, by feature order (:func:`recsz.torchrec.rows.merge_layout`)
        self._recsz_layouts: dict[tuple[str, ...], Any] = {}

    def _ours(self) -> list[CompressedPooledEmbeddingDist]:
        """This module's compressed dists, in its shardings' order (from TorchRec's private
        ``_output_dists``, read here only)."""
        return [c for d in self._output_dists if (c := _compressed(d)) is not None]

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
        super()._load_from_state_dict(state_dict, prefix, *args)
        key = prefix + "_extra_state"  # where nn.Module keeps get_extra_state's
        if key in missing:
            missing.remove(key)
        if key not in state_dict:
            warnings.warn(
                f"recsz: the checkpoint holds no sharder state ({key}): the compressed dists' "
                "bound policies and step counts start afresh",
                stacklevel=2,
            )

    @classmethod
    def create_embedding_bag_sharding(
        cls, sharding_infos: Any, env: ShardingEnv, *args: Any, **kw: Any
    ) -> Any:
        sharding = super().create_embedding_bag_sharding(sharding_infos, env, *args, **kw)
        kind = sharding_infos[0].param_sharding.sharding_type
        if kind in UNTOUCHED:
            return sharding
        if kind not in COMPRESSED:
            names = sorted({i.embedding_config.name for i in sharding_infos})
            raise ValueError(
                f"recsz: tables {', '.join(names)} are sharded {kind}; the compressed dists "
                f"carry {', '.join(sorted(COMPRESSED))} (and {', '.join(UNTOUCHED)}) tables only"
            )
        build, config, made = sharding.create_output_dist, cls.recsz_config, cls.recsz_dists
        ours = COMPRESSED[kind]
        # which tables our dist carries, where (a checkpoint's state restores into the same)
        tables = sorted(
            [i.embedding_config.name, i.param_sharding.ranks, str(i.param_sharding.sharding_spec)]
            for i in sharding_infos
        )
        layout = json.dumps([kind, *tables])
        # The ids the lookup took, for the dist's forward, which follows it.
        seen: dict[str, Any] = {}
        # Our dists take merged bags (input_dist)
        sharding.recsz_merged = True

        def create_output_dist(device: torch.device | None = None) -> Any:
            out = ours(build(device=device), config)
            compressed = _compressed(out)
            assert compressed is not None  # (one of ours)
            compressed.layout = layout
            made.append(compressed)
            out.seen = seen
            return out

        lookup_of = sharding.create_lookup

        def create_lookup(*args: Any, **kwargs: Any) -> Any:
            lookup = lookup_of(*args, **kwargs)
            lookup.register_forward_pre_hook(lambda _, a: seen.update(lookup=a[0]))
            return lookup

        sharding.create_output_dist = create_output_dist
        sharding.create_lookup = create_lookup
        return sharding

    def input_dist(self, ctx: Any, features: Any) -> Any:
        """TorchRec's, on this rank's ids with the bags of our dists' tables that repeat an
        earlier bag emptied (``torchrec/rows.py``: that content's row travels once, from
        its first bag); each such sharding's context keeps how its bags merged, for its
        output dist (a pipeline runs the next batch's input dist before this one's). A
        batch the switch sends plain (``compress="auto"``) keeps its bags, and its context
        says so: the output dists then hand it to TorchRec's (:func:`handover.theirs`)."""
        plain = not self._compressing()
        merges, features = (
            ({}, features)
            if plain
            else merged(self._embedding_shardings, self._recsz_layouts, features)
        )
        got = super().input_dist(ctx, features)
        for i, sctx in enumerate(self._contexts(ctx)):
            sctx.recsz_merge = merges.get(i)
            sctx.recsz_plain = plain
        return got

    def compute_and_output_dist(self, ctx: Any, input: Any) -> Any:
        self._sending(ctx)
        return super().compute_and_output_dist(ctx, input)

    def output_dist(self, ctx: Any, output: Any) -> Any:
        self._sending(ctx)  # (a managed-collision EBC's forward calls this one)
        return super().output_dist(ctx, output)

    def _sending(self, ctx: Any) -> None:
        """Note the way of the batch whose embeddings now leave: under TorchRec's pipeline
        the switch was asked for the next batch already (its input dist runs ahead), and
        this batch's backward follows (the dense hook's step, :func:`sent_plain`)."""
        self.recsz_sent_plain = any(getattr(s, "recsz_plain", False) for s in self._contexts(ctx))

    def _contexts(self, ctx: Any) -> list[Any]:
        """This module's shardings' contexts in the batch's (the last ones: a wrapping
        module's context may hold others before them)."""
        return ctx.sharding_contexts[-len(self._embedding_shardings) :]

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


class CompressedEBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder with the embedding all-to-all compressed both ways.

    Keyword arguments named like :class:`recsz.config.TrainConfig` fields configure the
    compression (those in :data:`TAKEN`: ``fwd_codec``, ``bwd_codec``, ``eb_policy``,
    ``fwd_eb``, ``eb_mode``, ``decay_schedule``, ``check_bounds``, ...; the defaults here:
    ``hybrid`` both ways under the ``dual`` policy; another field is refused by name); the
    rest (``fused_params``, ``qcomm_codecs_registry``, ...) go to TorchRec's sharder.
    """

    def __init__(
        self,
        fwd_codec: str = "hybrid",
        bwd_codec: str = "hybrid",
        eb_policy: str = "dual",
        **kwargs: Any,
    ) -> None:
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k in _OURS}
        self.config = TrainConfig.taking(
            "CompressedEBCSharder",
            TAKEN,
            fwd_codec=fwd_codec,
            bwd_codec=bwd_codec,
            eb_policy=eb_policy,
            **ours,
        )
        self._order = kwargs.get("sharded_module_order_overwrite")
        super().__init__(**kwargs)
        self._module_type: type[_CompressedEBC] = type(
            "CompressedShardedEmbeddingBagCollection",
            (_CompressedEBC,),
            {
                "recsz_config": self.config,
                "recsz_dists": [],
                "recsz_switches": weakref.WeakKeyDictionary(),
            },
        )

    @property
    def dists(self) -> list[CompressedPooledEmbeddingDist]:
        """The compressed dists of every module this sharder sharded."""
        return self._module_type.recsz_dists

    def sharding_types(self, compute_device_type: str) -> list[str]:
        offered = super().sharding_types(compute_device_type)
        return [t for t in offered if t in COMPRESSED.keys() | UNTOUCHED]

    def shard(
        self,
        module: Any,
        params: Any,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        return self._module_type(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._order,
        )

    @property
    def sharded_module_type(self) -> type[ShardedEmbeddingBagCollection]:
        return self._module_type


def sharders(**kwargs: Any) -> list[ModuleSharder[torch.nn.Module]]:
    """TorchRec's default sharders with the EmbeddingBagCollection one compressed, and the
    FeatureProcessedEmbeddingBagCollection one (position-weighted bags) and the
    ManagedCollisionEmbeddingBagCollection one (TorchRec's managed collision; its bags
    travel unmerged, :meth:`_CompressedEBC.compute`) wrapping it:
    ``DistributedModelParallel(model, sharders=recsz.torchrec.sharders(eb_policy="dual"))``.
    Takes :class:`CompressedEBCSharder`'s arguments."""
    from torchrec.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder as FPSharder,
    )
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder as MCSharder,
    )
    from torchrec.distributed.sharding_plan import get_default_sharders

    ours = CompressedEBCSharder(**kwargs)
    registry = ours.qcomm_codecs_registry
    wrapped: dict[type, ModuleSharder[torch.nn.Module]] = {
        EmbeddingBagCollectionSharder: ours,
        FPSharder: FPSharder(ebc_sharder=ours, qcomm_codecs_registry=registry),
        MCSharder: MCSharder(ebc_sharder=ours, qcomm_codecs_registry=registry),
    }
    return [wrapped.get(type(s), s) for s in get_default_sharders()]


def comm_bytes(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Bytes of this rank's compressed dists in ``model`` so far, per direction: ``raw``
    (what the fp32 slices stood for) and ``wire`` (payload bytes sent to other ranks); and
    ``max_err``, the largest error / bound that ``check_bounds=True`` saw (0 without it);
    ``compress``, each switch's state (:func:`switches`; its trials with ``compress="auto"``)."""
    out: dict[str, dict[str, Any]] = {
        "raw": {"fwd": 0, "bwd": 0},
        "wire": {"fwd": 0, "bwd": 0},
        "max_err": {"fwd": 0.0, "bwd": 0.0},
    }
    dists = {
        id(d): d for m in model.modules() if isinstance(m, _CompressedEBC) for d in m.recsz_dists
    }
    out["compress"] = {str(i): s.state() for i, s in enumerate(switches(model))}
    for one in dists.values():
        for d in ("fwd", "bwd"):
            out["raw"][d] += one.raw[d]
            out["wire"][d] += one.wire[d]
            out["max_err"][d] = max(out["max_err"][d], one.max_err[d])
    return out


def switches(model: torch.nn.Module) -> list[CompressionSwitch]:
    """The switches of ``model``'s sharded modules (:attr:`_CompressedEBC.recsz_switch`; one
    a sharder and model), in module order: whether batches go through the codecs, and the
    trials' record."""
    found = {id(m.recsz_switch): m.recsz_switch for m in model.modules()
             if isinstance(m, _CompressedEBC)}  # fmt: skip
    return list(found.values())


def sent_plain(model: torch.nn.Module) -> Callable[[], bool] | None:
    """Where ``model``'s sharded modules run ``compress="auto"``: whether the batch whose
    embeddings left last went plain, i.e. the batch whose backward runs next (under
    TorchRec's pipeline not the switch's latest, which is a batch ahead); None otherwise.
    Every rank and module alike (the ranks agree, the modules share the switch)."""
    auto = [m for m in model.modules() if isinstance(m, _CompressedEBC)]
    auto = [m for m in auto if m.recsz_switch.mode == "auto"]
    return (lambda: auto[0].recsz_sent_plain) if auto else None


def _compressed(d: Any) -> CompressedPooledEmbeddingDist | None:
    """Our compressed all-to-all in an output dist (table-row-wise and grid: the one between
    hosts); None in one of TorchRec's."""
    if isinstance(d, CompressedTwRwDist):
        return d.cross
    return d if isinstance(d, CompressedPooledEmbeddingDist) else None
