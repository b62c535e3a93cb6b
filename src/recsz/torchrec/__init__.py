"""recsz inside TorchRec: ``DistributedModelParallel`` with the embedding all-to-all
compressed, changing one line of a TorchRec program::

    model = DistributedModelParallel(
        model, sharders=recsz.torchrec.sharders(fwd_codec="hybrid", eb_policy="dual")
    )

and its dense part's gradients through one of our DDP hooks (:func:`dense_comm`).

Only this subpackage imports TorchRec (``pip install 'recsz[torchrec]'``).
"""

from __future__ import annotations

from recsz.torchrec.dense import dense_comm
from recsz.torchrec.dist import CompressedPooledEmbeddingDist
from recsz.torchrec.export import load_dlrm, save_dlrm
from recsz.torchrec.rowwise import CompressedReduceScatterDist
from recsz.torchrec.sequence import CompressedSequenceEmbeddingDist
from recsz.torchrec.sharder import (
    CompressedEBCSharder,
    CompressedECSharder,
    comm_bytes,
    sharders,
    switches,
)
from recsz.torchrec.twrw import CompressedTwRwDist

__all__ = [
    "CompressedEBCSharder",
    "CompressedECSharder",
    "CompressedPooledEmbeddingDist",
    "CompressedReduceScatterDist",
    "CompressedSequenceEmbeddingDist",
    "CompressedTwRwDist",
    "comm_bytes",
    "dense_comm",
    "load_dlrm",
    "save_dlrm",
    "sharders",
    "switches",
]
