"""Compression on the worker: DDP comm hooks, compressed collectives, 1-bit optimizers, DCT-MP,
and LAMB (the large-batch optimizer 1-bit LAMB compresses).

The codecs themselves live in :mod:`services.common.codecs` (one registry for every path);
this package applies them to torch.distributed traffic between the NN workers.
"""

from __future__ import annotations

from services.worker.compression.activations import (
    ActivationSparsifier,
    kept_per_sample,
    threshold_activations,
)
from services.worker.compression.collectives import (
    NEAR_LOSSLESS,
    CodecAverager,
    CommStats,
    OnebitReducer,
    allgather_bytes,
    compressed_allreduce,
    lossy_codec,
    padded_size,
)
from services.worker.compression.hooks import HOOK_NAMES, make_comm_hook
from services.worker.compression.lamb import Lamb, lr_factor, sqrt_scaled_lr, trust_ratio
from services.worker.compression.onebit import OnebitAdam, OnebitLamb, dense_parameters

__all__ = [
    "HOOK_NAMES",
    "NEAR_LOSSLESS",
    "ActivationSparsifier",
    "CodecAverager",
    "CommStats",
    "Lamb",
    "OnebitAdam",
    "OnebitLamb",
    "OnebitReducer",
    "allgather_bytes",
    "compressed_allreduce",
    "dense_parameters",
    "kept_per_sample",
    "lossy_codec",
    "lr_factor",
    "make_comm_hook",
    "padded_size",
    "sqrt_scaled_lr",
    "threshold_activations",
    "trust_ratio",
]
