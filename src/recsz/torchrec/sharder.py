"""TorchRec sharders whose embedding modules send compressed embeddings.

:class:`CompressedEBCSharder` is TorchRec's ``EmbeddingBagCollectionSharder`` and
:class:`CompressedECSharder` its ``EmbeddingCollectionSharder`` (sequence embeddings), each
sharding into our subclass of TorchRec's sharded module (:mod:`recsz.torchrec.sharded`,
bound to the sharder's configuration), whose output dists are compressed both ways; each
offers the planner only the shardings we carry (and data-parallel). :func:`sharders` is
TorchRec's default list with them in, for ``DistributedModelParallel(sharders=...)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import fields
from typing import Any, ClassVar

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import ModuleSharder, ShardingEnv

from recsz.comm.switch import CompressionSwitch
from recsz.config import TrainConfig
from recsz.torchrec.dist import CompressedPooledEmbeddingDist
from recsz.torchrec.sharded import (
    COMPRESSED,
    SEQUENCE,
    UNTOUCHED,
    CompressedShardedEBC,
    CompressedShardedEC,
    CompressingModule,
)

_OURS = {f.name for f in fields(TrainConfig)}
#: The fields the compressed dists read: the codecs and the bound policies' settings.
TAKEN = {
    "fwd_codec", "bwd_codec", "coder", "eb_policy", "fwd_eb", "bwd_eb", "eb_mode",
    "fwd_class_eb", "bwd_class_eb", "hindex_probe_steps", "hindex_every", "decay_schedule",
    "decay_c", "decay_t", "dct_keep", "dct_refresh", "check_bounds", "compress",
    "compress_trial", "compress_every", "compress_scope",
}  # fmt: skip


#: the sequence sharder's default tight,base,loose bounds of the gradients
SEQUENCE_BWD_CLASS_EB = "0.000333,0.001,0.00167"


def _configured(who: str, kwargs: dict[str, Any], **defaults: Any) -> TrainConfig:
    """The compression's configuration: ``defaults`` and the keyword arguments named like
    :class:`recsz.config.TrainConfig` fields, taken out of ``kwargs`` (the rest are
    TorchRec's); a field outside :data:`TAKEN` is refused by name."""
    ours = {k: kwargs.pop(k) for k in list(kwargs) if k in _OURS}
    return TrainConfig.taking(who, TAKEN, **{**defaults, **ours})


def _bound(name: str, base: type, config: TrainConfig) -> Any:
    """A subclass of our sharded module ``base`` bound to ``config``, with its own list of
    dists and of switches."""
    switches: weakref.WeakKeyDictionary[Any, CompressionSwitch] = weakref.WeakKeyDictionary()
    made = {"recsz_config": config, "recsz_dists": [], "recsz_switches": switches}
    return type(name, (base,), made)


class _Ours:
    """What our sharders add to TorchRec's (a mixin before it): the compression's
    configuration (:func:`_configured`), our sharded module bound to it (:func:`_bound`),
    and only the shardings that module carries offered to the planner."""

    #: our sharded module, the name of its bound subclass, the shardings it carries
    sharded: ClassVar[type[CompressingModule]]
    named: ClassVar[str]
    carried: ClassVar[frozenset[str]]
    #: this sharder's defaults where they differ from ``recsz train``'s (an argument wins)
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        fwd_codec: str = "hybrid",
        bwd_codec: str = "hybrid",
        eb_policy: str = "dual",
        **kwargs: Any,
    ) -> None:
        self.config = _configured(
            type(self).__name__, kwargs, **self.defaults, fwd_codec=fwd_codec,
            bwd_codec=bwd_codec, eb_policy=eb_policy,
        )  # fmt: skip
        self._order = kwargs.get("sharded_module_order_overwrite")
        super().__init__(**kwargs)
        self._module_type: Any = _bound(self.named, self.sharded, self.config)

    @property
    def dists(self) -> list[CompressedPooledEmbeddingDist]:
        """The compressed dists of every module this sharder sharded."""
        return self._module_type.recsz_dists

    def sharding_types(self, compute_device_type: str) -> list[str]:
        offered = super().sharding_types(compute_device_type)  # type: ignore[misc]
        return [t for t in offered if t in self.carried | UNTOUCHED]

    @property
    def sharded_module_type(self) -> Any:
        return self._module_type


class CompressedEBCSharder(_Ours, EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder with the embedding all-to-all compressed both ways.

    Keyword arguments named like :class:`recsz.config.TrainConfig` fields configure the
    compression (those in :data:`TAKEN`: ``fwd_codec``, ``bwd_codec``, ``eb_policy``,
    ``fwd_eb``, ``eb_mode``, ``decay_schedule``, ``check_bounds``, ...; the defaults here:
    ``hybrid`` both ways under the ``dual`` policy; another field is refused by name); the
    rest (``fused_params``, ``qcomm_codecs_registry``, ...) go to TorchRec's sharder.
    """

    sharded = CompressedShardedEBC
    named = "CompressedShardedEmbeddingBagCollection"
    carried = frozenset(COMPRESSED)

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


class CompressedECSharder(_Ours, EmbeddingCollectionSharder):
    """TorchRec's EmbeddingCollection sharder (sequence embeddings: a row an id) with the
    all-to-all of the rows compressed both ways; arguments as :class:`CompressedEBCSharder`'s
    (TorchRec's: ``fused_params``, ``qcomm_codecs_registry``, ``use_index_dedup``), but the
    gradients' class bounds a tenth of ``recsz train``'s by default: a row an id, each
    row's gradient is its own (no bag sums them), and at the pooled bounds the held-out log
    loss rose by 0.007 on average over 6 seeds (up to 0.035) where a tenth of them lowered
    it by 0.003, at 51x fewer bytes than fp32 instead of 64x
    (benchmarks/results/session28/sequence_seeds_all.md)."""

    sharded = CompressedShardedEC
    named = "CompressedShardedEmbeddingCollection"
    carried = frozenset(SEQUENCE)
    defaults: ClassVar[dict[str, Any]] = {"bwd_class_eb": SEQUENCE_BWD_CLASS_EB}

    def shard(
        self,
        module: Any,
        params: Any,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingCollection:
        return self._module_type(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )


def sharders(**kwargs: Any) -> list[ModuleSharder[torch.nn.Module]]:
    """TorchRec's default sharders with the EmbeddingBagCollection and EmbeddingCollection
    ones compressed, and the FeatureProcessedEmbeddingBagCollection one (position-weighted
    bags) and the ManagedCollisionEmbeddingBagCollection one (TorchRec's managed collision;
    its bags travel unmerged, :meth:`CompressedShardedEBC.compute`) wrapping ours:
    ``DistributedModelParallel(model, sharders=recsz.torchrec.sharders(eb_policy="dual"))``.
    Takes :class:`CompressedEBCSharder`'s arguments; the modules of a model share one
    ``compress="auto"`` switch."""
    from torchrec.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder as FPSharder,
    )
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder as MCSharder,
    )
    from torchrec.distributed.sharding_plan import get_default_sharders

    ours = CompressedEBCSharder(**kwargs)
    sequence = CompressedECSharder(**kwargs)
    sequence.sharded_module_type.recsz_switches = ours.sharded_module_type.recsz_switches
    registry = ours.qcomm_codecs_registry
    wrapped: dict[type, ModuleSharder[torch.nn.Module]] = {
        EmbeddingBagCollectionSharder: ours,
        EmbeddingCollectionSharder: sequence,
        FPSharder: FPSharder(ebc_sharder=ours, qcomm_codecs_registry=registry),
        MCSharder: MCSharder(ebc_sharder=ours, qcomm_codecs_registry=registry),
    }
    return [wrapped.get(type(s), s) for s in get_default_sharders()]


def _modules(model: torch.nn.Module) -> list[CompressingModule]:
    return [m for m in model.modules() if isinstance(m, CompressingModule)]


def comm_bytes(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Bytes of this rank's compressed dists in ``model`` so far, per direction: ``raw``
    (what the fp32 slices stood for), ``wire`` (payload bytes sent to other ranks) and
    ``between`` (those to ranks on other hosts: TorchRec's, ``LOCAL_WORLD_SIZE`` a host); and
    ``max_err``, the largest error / bound that ``check_bounds=True`` saw (0 without it);
    ``compress``, each switch's state (:func:`switches`; its trials with ``compress="auto"``)."""
    out: dict[str, dict[str, Any]] = {
        "raw": {"fwd": 0, "bwd": 0},
        "wire": {"fwd": 0, "bwd": 0},
        "between": {"fwd": 0, "bwd": 0},
        "max_err": {"fwd": 0.0, "bwd": 0.0},
    }
    dists = {id(d): d for m in _modules(model) for d in m.recsz_dists}
    out["compress"] = {str(i): s.state() for i, s in enumerate(switches(model))}
    for one in dists.values():
        for d in ("fwd", "bwd"):
            out["raw"][d] += one.raw[d]
            out["wire"][d] += one.wire[d]
            out["between"][d] += one.between[d]
            out["max_err"][d] = max(out["max_err"][d], one.max_err[d])
    return out


def switches(model: torch.nn.Module) -> list[CompressionSwitch]:
    """The switches of ``model``'s sharded modules (:attr:`CompressingModule.recsz_switch`;
    one a sharder and model), in module order: whether batches go through the codecs, and
    the trials' record."""
    return list({id(m.recsz_switch): m.recsz_switch for m in _modules(model)}.values())


def sent_plain(model: torch.nn.Module) -> Callable[[], bool] | None:
    """Where ``model``'s sharded modules run ``compress="auto"``: whether the batch whose
    embeddings left last went plain, i.e. the batch whose backward runs next (under
    TorchRec's pipeline not the switch's latest, which is a batch ahead); None otherwise.
    Every rank and module alike (the ranks agree, the modules share the switch)."""
    auto = [m for m in _modules(model) if m.recsz_switch.mode == "auto"]
    return (lambda: auto[0].recsz_sent_plain) if auto else None
