"""Compression of the dense all-reduce: DDP comm hooks, compressed collectives, 1-bit optimizers.

The codecs themselves live in :mod:`services.common.codecs` (one registry for every path);
this package applies them to torch.distributed traffic between the NN workers.
"""

from __future__ import annotations

from services.worker.compression.collectives import (
    CodecAverager,
    CommStats,
    OnebitReducer,
    allgather_bytes,
    compressed_allreduce,
    padded_size,
)
from services.worker.compression.hooks import HOOK_NAMES, make_comm_hook
from services.worker.compression.optim import OnebitAdam, OnebitLamb, dense_parameters

__all__ = [
    "HOOK_NAMES",
    "CodecAverager",
    "CommStats",
    "OnebitAdam",
    "OnebitLamb",
    "OnebitReducer",
    "allgather_bytes",
    "compressed_allreduce",
    "dense_parameters",
    "make_comm_hook",
    "padded_size",
]
