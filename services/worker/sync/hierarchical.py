"""``hierarchical``: gradient averaging node by node, as NCCL and Horovod do it.

Ranks ``k*K .. k*K + K - 1`` form node ``k`` (``ranks_per_node`` K); the first of them is its
leader. After every backward the flat gradient is

1. SUM-reduced inside each node onto its leader,
2. SUM all-reduced among the leaders (the only collective that spans nodes) and divided by
   the world size, and
3. broadcast from each leader to its node.

The result is the flat all-reduce's mean. ``stats.cross_node_bytes`` counts the payload that
enters the leaders' all-reduce, summed over its N/K participants (every leader hands the
same buffer); a flat all-reduce puts all N ranks' payload into a collective spanning nodes.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from services.common.errors import ConfigError
from services.worker.sync.base import BaseSync, copy_flat_, dense_grads, flatten

__all__ = ["HierarchicalSync", "node_layout"]


def node_layout(world: int, ranks_per_node: int) -> list[list[int]]:
    """The ranks of each node: consecutive blocks of ``ranks_per_node``; the first leads."""
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) \
            or ranks_per_node < 1:
        raise ConfigError(f"hierarchical: ranks_per_node must be an int >= 1, "
                          f"got {ranks_per_node!r}")
    if world % ranks_per_node:
        raise ConfigError(f"hierarchical: ranks_per_node {ranks_per_node} must divide the "
                          f"world size {world}")
    return [list(range(s, s + ranks_per_node)) for s in range(0, world, ranks_per_node)]


class HierarchicalSync(BaseSync):
    """Gradient averaging every step: reduce in the node, all-reduce the leaders, broadcast."""

    name = "hierarchical"

    def __init__(self, *, ranks_per_node: int = 2) -> None:
        super().__init__()
        node_layout(ranks_per_node, ranks_per_node)  # checks the value before any group
        self.ranks_per_node = ranks_per_node
        self._node: Any = None      # this rank's node group (None: a node of one rank)
        self._leaders: Any = None   # the leaders' group (None: not a leader, or one node)
        self._leader = 0
        self._nodes = 1

    def _setup(self) -> None:
        if not self.active:
            return
        nodes = node_layout(self.world_size, self.ranks_per_node)
        self._nodes = len(nodes)
        for ranks in nodes:   # new_group is collective: every rank creates every group
            group = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                self._node, self._leader = group, ranks[0]
        leaders = dist.new_group(ranks=[r[0] for r in nodes]) if len(nodes) > 1 else None
        if self.rank == self._leader:
            self._leaders = leaders

    def _on_backward(self, step: int) -> None:
        t0 = time.perf_counter()
        grads = dense_grads(self.params)
        flat = flatten(grads)
        payload = flat.numel() * flat.element_size()
        if self._node is not None:
            dist.reduce(flat, dst=self._leader, op=dist.ReduceOp.SUM, group=self._node)
        if self._leaders is not None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._leaders)
        if self.rank == self._leader:
            flat.div_(self.world_size)
        if self._nodes > 1:
            self.stats.cross_node_bytes += payload * self._nodes
        if self._node is not None:
            dist.broadcast(flat, src=self._leader, group=self._node)
        copy_flat_(grads, flat)
        self.stats.bytes_sent += payload * (2 if self.rank == self._leader else 1)
        self.stats.sync_seconds += time.perf_counter() - t0

    def _on_step(self, step: int) -> None:
        self.stats.syncs += 1

    def finish(self) -> bool:
        """Nothing to do: averaged gradients keep the replicas identical."""
        return False
