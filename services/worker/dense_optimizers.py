"""The dense optimizer of a worker's model, by name (``TrainerConfig.dense_optimizer``)."""

from __future__ import annotations

import torch
from torch import nn

from services.common.errors import ConfigError
from services.worker.compression import Lamb, OnebitAdam, OnebitLamb, sqrt_scaled_lr
from services.worker.config import TrainerConfig

__all__ = ["ONEBIT_OPTIMIZERS", "make_optimizer"]

ONEBIT_OPTIMIZERS: dict[str, type[OnebitAdam | OnebitLamb]] = {
    "onebit_adam": OnebitAdam, "onebit_lamb": OnebitLamb}


def make_optimizer(name: str, module: nn.Module, config: TrainerConfig, *,
                   batch: int | None = None) -> torch.optim.Optimizer:
    """The dense optimizer; ``batch``: rows per step over every rank (LAMB's lr scaling)."""
    lr = config.lr
    if name in ONEBIT_OPTIMIZERS:  # they refuse embedding modules (ConfigError) and sparse grads
        return ONEBIT_OPTIMIZERS[name](module, lr=lr, freeze_step=config.onebit_freeze_step)
    params = [p for p in module.parameters() if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, fused=True)  # one kernel for every tensor
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if name == "lamb":
        if config.lamb_base_batch:
            if batch is None:
                raise ConfigError("lamb_base_batch scales the lr by the batch: give the batch")
            lr = sqrt_scaled_lr(lr, batch, config.lamb_base_batch)
        return Lamb(params, lr=lr, warmup_steps=config.lamb_warmup_steps,
                    decay_steps=config.lamb_decay_steps)
    return torch.optim.SGD(params, lr=lr, momentum=config.momentum)
