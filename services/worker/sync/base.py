"""The sync-strategy plug-in point, its metrics, and flat-buffer helpers they share.

A training step calls the strategy at two points::

    model = sync.prepare(model)        # once; may wrap the model (DDP), returns what to call
    for step, batch in enumerate(batches):
        loss(model(pooled, dense)).backward()
        sync.after_backward(step)      # gradient-averaging strategies act here
        optimizer.step()
        sync.after_step(step)          # parameter-averaging strategies act here
    sync.finish()                      # collective: every replica becomes the global average
    sync.close()                       # collective: every rank calls it

``finish`` ends a run with one model: decentralised and periodic schemes leave replicas
apart, and (as in their analyses) the model they produce is the average of the replicas.
Training may go on after it. ``step`` is the 0-based index of the step just taken; a strategy with period ``every``
acts after steps ``every - 1, 2 * every - 1, ...``, so every rank must tell it the same index
at the same step (the thread that takes the steps counts them: a count kept by another
thread lags). Without a process group, or with one
rank, every strategy is a no-op. Only parameters with ``requires_grad`` take part (the dense
network: embeddings live on the PS); they must share one dtype and device.

Parameter averaging through a ``lossy`` averager (a codec other than none/fp16/bf16) sends
changes, never the parameters: every rank keeps the reference copy of the last sync (equal on
every rank), and a sync makes the parameters ``reference + mean_i C(x_i − reference + e_i)``,
which becomes the new reference; ``e_i``, the part of rank i's change its codec did not send,
is kept on rank i and goes out with its next change (the averager's ``average_change``;
zero for the unbiased qsgd and adaquant).
Compressing the parameters themselves would zero 99 % of them under a 1 % top-k.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from services.common.errors import ConfigError
from services.worker.distributed import joined

__all__ = [
    "Averager",
    "BaseSync",
    "SyncStats",
    "SyncStrategy",
    "add_flat_",
    "consensus_distance",
    "copy_flat_",
    "flatten",
    "lossy_averager",
    "mean_allreduce",
]


@dataclass(slots=True)
class SyncStats:
    """What a strategy did on this rank, cumulative since ``prepare``."""

    steps: int = 0
    syncs: int = 0                 # sync rounds completed
    bytes_sent: int = 0            # payload bytes this rank handed to collectives / peers
    sync_seconds: float = 0.0      # time spent communicating (background time for shadow)
    blocking_seconds: float = 0.0  # time the training thread spent inside the strategy
    cross_node_bytes: int = 0      # node-aware strategies: payload entering collectives that
    #                                span nodes, summed over the ranks (0: not tracked)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def sync_time_per_step(self) -> float:
        return self.sync_seconds / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "syncs": self.syncs, "bytes_sent": self.bytes_sent,
                "bytes_per_step": self.bytes_per_step, "sync_seconds": self.sync_seconds,
                "sync_time_per_step": self.sync_time_per_step,
                "blocking_seconds": self.blocking_seconds,
                "cross_node_bytes": self.cross_node_bytes}


@runtime_checkable
class SyncStrategy(Protocol):
    """A dense synchronisation scheme (see the module docstring for the call order)."""

    name: str
    stats: SyncStats

    def prepare(self, model: nn.Module) -> nn.Module: ...
    def after_backward(self, step: int) -> None: ...
    def after_step(self, step: int) -> None: ...
    def consensus_distance(self) -> float: ...
    def finish(self) -> bool: ...
    def close(self) -> None: ...


class Averager(Protocol):
    """Replaces the plain mean all-reduce of a flat buffer (the slot compression plugs into).

    Called as ``averager(flat, group, size)`` and returns the mean over the group's ranks; it
    may compress. An optional int attribute ``wire_bytes`` (cumulative) is reported instead
    of the uncompressed payload. An averager with ``lossy = True`` must also have
    ``average_change(change, group, size)``: the mean of the ranks' changes, with error
    feedback kept per rank (parameter averaging then sends changes, see the module docstring).
    """

    def __call__(self, flat: Tensor, group: Any, size: int) -> Tensor: ...


def mean_allreduce(flat: Tensor, group: Any, size: int) -> Tensor:
    """The default :class:`Averager`: SUM all-reduce in place, divided by ``size``."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat.div_(size)


def lossy_averager(averager: Any) -> bool:
    """Whether ``averager`` says it is lossy (``lossy = True``); absent means exact."""
    return bool(getattr(averager, "lossy", False))


def dense_grads(params: Sequence[Tensor]) -> list[Tensor]:
    """Every parameter's gradient, zeros where it has none: every rank's buffer of them has
    the same length."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


def flatten(params: Sequence[Tensor]) -> Tensor:
    """A new contiguous 1-D copy of ``params``."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def _views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params,
                                         strict=True)]


@torch.no_grad()
def copy_flat_(params: Sequence[Tensor], flat: Tensor) -> None:
    """Write ``flat`` into ``params``."""
    torch._foreach_copy_([p.data for p in params], _views(flat, params))


@torch.no_grad()
def add_flat_(params: Sequence[Tensor], flat: Tensor) -> None:
    """Add ``flat`` to ``params`` in place."""
    torch._foreach_add_([p.data for p in params], _views(flat, params))


def _world() -> int:
    return dist.get_world_size() if joined() else 1


def consensus_distance(params: Sequence[Tensor], group: Any = None) -> float:
    """``sqrt(mean_i ||x_i - mean_j x_j||^2)`` over the ranks of ``group`` (collective).

    0.0 on a single process. Computed in float64 so that exact agreement reads as ~0.
    """
    n = _world() if group is None else dist.get_world_size(group)
    if n <= 1 or not params:
        return 0.0
    x = flatten(params).double()
    mean = x.clone()
    dist.all_reduce(mean, group=group)
    mean /= n
    d2 = (x - mean).pow(2).sum().reshape(1)
    dist.all_reduce(d2, group=group)
    return math.sqrt(max(float(d2.item()) / n, 0.0))


def check_every(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}: every must be an int >= 1, got {value!r}")
    return value


class BaseSync:
    """Shared plumbing: the parameter list, world size, stats and timing of the hooks."""

    name = "base"

    def __init__(self, *, averager: Averager | None = None) -> None:
        self.stats = SyncStats()
        self.params: list[Tensor] = []
        self.world_size = 1
        self.rank = 0
        self._averager: Averager | Callable[..., Tensor] = averager or mean_allreduce
        self._lossy = lossy_averager(averager)
        if self._lossy and not callable(getattr(averager, "average_change", None)):
            raise ConfigError(f"{self.name}: a lossy averager must have average_change()")
        self._reference: Tensor | None = None   # lossy averaging: the last sync's average
        self._prepared = False

    @property
    def active(self) -> bool:
        """True when there is more than one rank to talk to."""
        return self.world_size > 1

    def prepare(self, model: nn.Module) -> nn.Module:
        """Record the trainable parameters and make every replica equal to rank 0's."""
        if self._prepared:
            raise ConfigError(f"{self.name}: prepare() was already called")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ConfigError(f"{self.name}: all trainable parameters must share one dtype and "
                              "device")
        self.world_size = _world()
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self._prepared = True
        if self.active and self.params:
            flat = flatten(self.params)
            dist.broadcast(flat, src=0)
            copy_flat_(self.params, flat)
            if self._lossy:
                self._reference = flat
        self._setup()
        return model

    def _setup(self) -> None:
        """Strategy-specific set-up after the parameters are known (collective)."""

    def after_backward(self, step: int) -> None:
        if self.active:
            t0 = time.perf_counter()
            self._on_backward(step)
            self.stats.blocking_seconds += time.perf_counter() - t0

    def after_step(self, step: int) -> None:
        self.stats.steps += 1
        if self.active:
            t0 = time.perf_counter()
            self._on_step(step)
            self.stats.blocking_seconds += time.perf_counter() - t0

    def _on_backward(self, step: int) -> None:
        """Gradient-averaging strategies override this."""

    def _on_step(self, step: int) -> None:
        """Parameter-averaging strategies override this."""

    def consensus_distance(self) -> float:
        """How far the replicas are apart (collective over all ranks)."""
        return consensus_distance(self.params) if self.active else 0.0

    def finish(self) -> bool:
        """Make every replica the global average (collective); True when that ran."""
        if not (self.active and self.params):
            return False
        self._average_params(None, self.world_size)
        return True

    def close(self) -> None:
        """Release what the strategy holds (collective for background strategies)."""

    def _average_params(self, group: Any, size: int) -> None:
        """Replace the parameters by their mean over ``group`` (``size`` ranks), timed."""
        t0 = time.perf_counter()
        flat = flatten(self.params)
        copy_flat_(self.params, self._mean(flat, group, size))
        self._count_bytes(flat)
        self.stats.sync_seconds += time.perf_counter() - t0
        self.stats.syncs += 1

    def _mean(self, flat: Tensor, group: Any, size: int) -> Tensor:
        """The mean of the replicas' ``flat`` over ``group``: through an exact averager as
        it is; through a lossy one, the reference plus the mean of the changes since it,
        which becomes the new reference (``group`` must be the one the reference is shared
        over)."""
        if self._reference is None:
            return self._averager(flat, group, size)
        self._reference += self._average_change(flat - self._reference, group, size)
        return self._reference.clone()

    def _average_change(self, change: Tensor, group: Any, size: int) -> Tensor:
        """The mean of the ranks' ``change``; with error feedback where the averager is lossy."""
        if self._lossy:
            return getattr(self._averager, "average_change")(change, group, size)  # noqa: B009
        return self._averager(change, group, size)

    def _count_bytes(self, flat: Tensor, copies: int = 1) -> None:
        wire = getattr(self._averager, "wire_bytes", None)
        if isinstance(wire, int):
            self.stats.bytes_sent = wire
        else:
            self.stats.bytes_sent += flat.numel() * flat.element_size() * copies
