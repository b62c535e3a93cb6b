"""The dense part's gradients under DistributedModelParallel, through recsz's DDP hooks.

DMP wraps the parameters it does not shard (the MLPs) in ``DistributedDataParallel``,
whose all-reduce of fp32 gradients moves, on a bench-preset DLRM, several times the bytes
of a compressed embedding all-to-all. :func:`dense_comm` puts one of ``recsz train``'s
``--dp-comm`` hooks on that DDP (:mod:`recsz.comm.dp_hooks`: torch's fp16 / bf16 / PowerSGD
hooks, DCT-DP, or ``eb``, our error-bounded codec with error feedback), with the same
options, on a process group of its own (:attr:`recsz.comm.dp_hooks.DPComm.group`); under a
sharder with ``compress="auto"`` it follows the sharder's switch (a plain step's gradients
take the fp32 all-reduce)::

    dmp = DistributedModelParallel(model, sharders=recsz.torchrec.sharders())
    dp = recsz.torchrec.dense_comm(dmp, dp_comm="eb", dp_eb=0.01)  # before the first step
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsz.comm.dp_hooks import DPComm, register
from recsz.config import TrainConfig
from recsz.torchrec.dist import local_hosts
from recsz.torchrec.sharder import sent_plain

#: The fields :func:`dense_comm` reads: the hook's mode and its options.
DENSE_TAKEN = {
    "dp_comm", "dp_codec", "dp_eb", "dp_eb_collective", "powersgd_rank", "powersgd_warmup",
    "dct_keep", "dct_refresh",
}  # fmt: skip


def dense_comm(dmp: nn.Module, dp_comm: str = "eb", **options: Any) -> DPComm:
    """Install ``dp_comm``'s hook (``recsz train --dp-comm``) on the DDP that ``dmp`` wraps
    its dense part in; call it on every rank, before the first backward. ``options``: the
    hook's ``recsz train`` options by field name (``dp_eb``, ``dp_codec``, ``powersgd_rank``,
    ...); another name is refused. Returns the hook's state: its seconds, ``bytes_sent``
    and ``bytes_dense`` (what fp32 would have sent) so far, this rank's."""
    config = TrainConfig.taking("dense_comm", DENSE_TAKEN, dp_comm=dp_comm, **options)
    ddp = [m for m in dmp.modules() if isinstance(m, DistributedDataParallel)]
    if len(ddp) != 1:
        raise ValueError(
            f"recsz: dense_comm needs the one DistributedDataParallel a DMP wraps its dense "
            f"part in; this model holds {len(ddp)}"
        )
    group = dist.new_group()
    world, options = dist.get_world_size(group), config.dp_hook_options()
    hosts = local_hosts(world)  # TorchRec's (dp_eb_collective="hosts")
    return register(ddp[0], dp_comm, world, group, sent_plain(dmp), hosts=hosts, **options)
