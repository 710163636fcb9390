"""Dense synchronisation strategies for the NN workers, chosen by name.

================  ====================================================  =======================
name              what it does                                          parameters
================  ====================================================  =======================
``allreduce``     average gradients every step (DDP; comm-hook slot)    use_ddp, bucket_cap_mb,
                                                                        comm_hook, averager
``local_sgd``     average parameters over all ranks every H steps       every (H), averager
``ds_sync``       average inside small groups, reshuffled every round   group_size, schedule,
                                                                        every, period, seed,
                                                                        averager
``shadow``        average in a background thread, write back the delta  every, elastic_alpha,
                                                                        timeout_s, averager
``gossip``        average with ring / exponential-graph neighbours      topology, every
``hierarchical``  average gradients: reduce in each node, all-reduce    ranks_per_node
                  the leaders, broadcast back (NCCL / Horovod style)
``sfb``           average gradients; linear layers where B(m+n) < mn
                  send each sample's factors instead
``gadmm``         GADMM: a chain; heads and tails alternately send      every, rho
                  their parameters to their two neighbours
================  ====================================================  =======================

``make_sync(name, **params)`` builds one; :class:`SyncConfig` is the flat form for flags and
YAML (``--sync ds_sync --group-size 4``). See :mod:`services.worker.sync.base` for the call
order a training loop follows.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.errors import ConfigError
from services.worker.sync.allreduce import AllReduceSync
from services.worker.sync.averaging import DS_SCHEDULES, DSSync, LocalSGD, ds_rounds
from services.worker.sync.base import (
    Averager,
    BaseSync,
    SyncStats,
    SyncStrategy,
    consensus_distance,
    mean_allreduce,
)
from services.worker.sync.gadmm import GADMMSync
from services.worker.sync.gossip import GOSSIP_TOPOLOGIES, GossipSync, gossip_plan
from services.worker.sync.hierarchical import HierarchicalSync, node_layout
from services.worker.sync.sfb import SFBSync, sfb_plan
from services.worker.sync.shadow import ShadowSync

__all__ = [
    "DS_SCHEDULES",
    "GOSSIP_TOPOLOGIES",
    "STRATEGIES",
    "AllReduceSync",
    "Averager",
    "BaseSync",
    "DSSync",
    "GADMMSync",
    "GossipSync",
    "HierarchicalSync",
    "LocalSGD",
    "SFBSync",
    "ShadowSync",
    "SyncConfig",
    "SyncStats",
    "SyncStrategy",
    "consensus_distance",
    "ds_rounds",
    "gossip_plan",
    "make_sync",
    "mean_allreduce",
    "node_layout",
    "sfb_plan",
    "strategy_params",
]

STRATEGIES: dict[str, type[BaseSync]] = {
    "allreduce": AllReduceSync,
    "local_sgd": LocalSGD,
    "ds_sync": DSSync,
    "shadow": ShadowSync,
    "gossip": GossipSync,
    "hierarchical": HierarchicalSync,
    "sfb": SFBSync,
    "gadmm": GADMMSync,
}


def strategy_params(name: str) -> list[str]:
    """The keyword parameters strategy ``name`` accepts."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown sync strategy {name!r}; available: {sorted(STRATEGIES)}")
    sig = inspect.signature(cls.__init__)
    return [p for p in sig.parameters if p != "self"]


def make_sync(name: str, **params: Any) -> BaseSync:
    """A new strategy ``name``; unknown names, unknown parameters and bad values are ConfigError."""
    accepted = strategy_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ConfigError(f"sync strategy {name!r} does not take {unknown}; it takes {accepted}")
    try:
        return STRATEGIES[name](**params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad parameters for sync strategy {name!r}: {exc}") from exc


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """The flat, flag- and YAML-friendly choice of a strategy and its parameters.

    Fields a strategy does not take are ignored; ``every=None`` means the strategy's
    default (8 for local_sgd, 1 for the others).
    """

    name: str = "allreduce"
    every: int | None = None
    group_size: int = 2
    schedule: str = "hypercube"
    period: int = 8
    seed: int = 0
    elastic_alpha: float | None = None
    topology: str = "ring"
    use_ddp: bool = True
    bucket_cap_mb: float = 25.0
    timeout_s: float = 300.0
    ranks_per_node: int = 2
    rho: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ConfigError(f"unknown sync strategy {self.name!r}; "
                              f"available: {sorted(STRATEGIES)}")
        if self.every is not None and self.every < 1:
            raise ConfigError(f"sync every must be >= 1, got {self.every}")
        if self.schedule not in DS_SCHEDULES:
            raise ConfigError(f"sync schedule must be one of {DS_SCHEDULES}, "
                              f"got {self.schedule!r}")
        if self.topology not in GOSSIP_TOPOLOGIES:
            raise ConfigError(f"sync topology must be one of {GOSSIP_TOPOLOGIES}, "
                              f"got {self.topology!r}")
        if self.group_size < 2:
            raise ConfigError(f"sync group_size must be >= 2, got {self.group_size}")
        if self.elastic_alpha is not None and not 0 < self.elastic_alpha <= 1:
            raise ConfigError(f"sync elastic_alpha must be in (0, 1], got {self.elastic_alpha}")
        node_layout(self.ranks_per_node, self.ranks_per_node)
        if not self.rho > 0:
            raise ConfigError(f"sync rho must be > 0, got {self.rho}")

    def params(self) -> dict[str, Any]:
        """The fields strategy ``name`` takes (``every`` only when set)."""
        accepted = set(strategy_params(self.name))
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = {k: v for k, v in values.items() if k in accepted and k != "name"}
        if out.get("every", 0) is None:
            del out["every"]
        return out

    def build(self, *, comm_hook: tuple[Any, Callable[..., Any]] | None = None,
              averager: Averager | None = None) -> BaseSync:
        """The strategy, with an optional DDP comm hook (allreduce) or averager."""
        params = self.params()
        if comm_hook is not None:
            params["comm_hook"] = comm_hook
        if averager is not None:
            params["averager"] = averager
        return make_sync(self.name, **params)
