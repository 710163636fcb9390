"""``allreduce``: average the gradients of every step (the default strategy).

Two engines:

- ``use_ddp=True`` (default): ``prepare`` wraps the model in
  ``torch.nn.parallel.DistributedDataParallel``, which all-reduces gradient buckets during
  backward. ``comm_hook=(state, hook)`` takes a hook with torch's DDP signature
  ``hook(state, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]`` (e.g. a compression
  hook); the default is torch's ``allreduce_hook`` on the default group. A hook ``state`` with
  an int attribute ``wire_bytes`` (cumulative) has that reported as the bytes sent.
- ``use_ddp=False``: after backward, the gradients are flattened into one buffer and
  averaged with ``averager`` (default: a SUM all-reduce divided by the world size).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from services.common.errors import ConfigError
from services.worker.sync.base import Averager, BaseSync, copy_flat_, dense_grads, flatten

__all__ = ["AllReduceSync"]

# Model buffers are constants here: do not re-broadcast them every forward (the keyword
# changed name in torch 2.13).
_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False})


class AllReduceSync(BaseSync):
    """Gradient averaging every step, through DDP (with a comm-hook slot) or one flat buffer."""

    name = "allreduce"

    def __init__(self, *, use_ddp: bool = True, bucket_cap_mb: float = 25.0,
                 comm_hook: tuple[Any, Callable[..., Any]] | None = None,
                 averager: Averager | None = None) -> None:
        super().__init__(averager=averager)
        if not isinstance(use_ddp, bool):
            raise ConfigError(f"allreduce: use_ddp must be a bool, got {use_ddp!r}")
        if not isinstance(bucket_cap_mb, int | float) or bucket_cap_mb <= 0:
            raise ConfigError(f"allreduce: bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if comm_hook is not None:
            if not (isinstance(comm_hook, tuple) and len(comm_hook) == 2
                    and callable(comm_hook[1])):
                raise ConfigError("allreduce: comm_hook must be a (state, hook) pair with a "
                                  "callable hook(state, bucket) -> Future[Tensor]")
            if not use_ddp:
                raise ConfigError("allreduce: comm_hook needs use_ddp=True "
                                  "(use averager= with use_ddp=False)")
        if averager is not None and use_ddp:
            raise ConfigError("allreduce: averager applies to use_ddp=False "
                              "(use comm_hook= with DDP)")
        self.use_ddp = use_ddp
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.comm_hook = comm_hook
        self.ddp: DistributedDataParallel | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        """Return the DDP-wrapped model (call forward on it) or ``model`` itself."""
        model = super().prepare(model)
        if not (self.active and self.use_ddp):
            return model
        device = self.params[0].device if self.params else torch.device("cpu")
        self.ddp = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb, **_NO_BUFFER_SYNC)
        state, hook = self.comm_hook if self.comm_hook else (None, allreduce_hook)
        self.ddp.register_comm_hook(state, self._timed(hook))
        return self.ddp

    def _timed(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        stats = self.stats

        # No annotations on purpose: DDP rejects a hook whose annotations are strings.
        def timed_hook(state, bucket):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            buf = bucket.buffer()
            raw = buf.numel() * buf.element_size()
            fut = hook(state, bucket)

            def done(f):  # type: ignore[no-untyped-def]
                stats.sync_seconds += time.perf_counter() - t0
                wire = getattr(state, "wire_bytes", None)
                if isinstance(wire, int):
                    stats.bytes_sent = wire
                else:
                    stats.bytes_sent += raw
                return f.value()

            return fut.then(done)

        return timed_hook

    def _on_backward(self, step: int) -> None:
        if self.use_ddp:
            return
        t0 = time.perf_counter()
        grads = dense_grads(self.params)
        flat = flatten(grads)
        copy_flat_(grads, self._averager(flat, None, self.world_size))
        self._count_bytes(flat)
        self.stats.sync_seconds += time.perf_counter() - t0

    def _on_step(self, step: int) -> None:
        self.stats.syncs += 1

    def finish(self) -> bool:
        """Nothing to do: averaged gradients keep the replicas identical."""
        return False
