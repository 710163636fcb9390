"""``gossip``: decentralised averaging with neighbours only (DmSGD when paired with momentum).

After each optimizer step (every ``every`` steps) rank i replaces its parameters by
``Σ_j W[i, j] x_j`` over itself and its in-neighbours, exchanging point-to-point messages
(``batch_isend_irecv``) instead of a global all-reduce. Every W here is doubly stochastic,
so a gossip step keeps the global mean of the parameters exactly (up to float rounding).
Used with ``torch.optim.SGD(momentum=β)`` this is decentralised momentum SGD (DmSGD, in its
adapt-then-combine form: ``m_i = β m_i + g_i; x_i = Σ_j W_ij (x_j − γ m_j)``).

Topologies (n ranks):

- ``ring``: neighbours i ± 1; weights 1/3 each (1/2 with two ranks).
- ``exp``: static exponential graph; rank i sends to ``i + 2^k`` and receives from
  ``i − 2^k`` (mod n) for ``2^k < n``; weights ``1/(τ + 1)``, τ the number of such k.
- ``onepeer_exp``: one peer per round, ``i ± 2^(t mod τ)``; weights 1/2 (cheapest; mixes
  exactly in τ rounds when n is a power of two).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from services.common.errors import ConfigError
from services.worker.sync.base import BaseSync, check_every, copy_flat_, flatten

__all__ = ["GOSSIP_TOPOLOGIES", "GossipSync", "gossip_plan"]

GOSSIP_TOPOLOGIES = ("ring", "exp", "onepeer_exp")


def _num_exp_peers(n: int) -> int:
    return max((n - 1).bit_length(), 0)   # number of k with 2^k < n


def gossip_plan(n: int, rank: int, topology: str,
                round_: int = 0) -> tuple[float, list[int], list[tuple[int, float]]]:
    """``(self weight, ranks to send to, [(rank to receive from, weight)])`` for one round."""
    if topology not in GOSSIP_TOPOLOGIES:
        raise ConfigError(f"gossip: topology must be one of {GOSSIP_TOPOLOGIES}, "
                          f"got {topology!r}")
    if n == 1:
        return 1.0, [], []
    if topology == "ring":
        peers = sorted({(rank - 1) % n, (rank + 1) % n})
        w = 1.0 / (len(peers) + 1)
        return w, peers, [(p, w) for p in peers]
    tau = _num_exp_peers(n)
    if topology == "exp":
        w = 1.0 / (tau + 1)
        send = [(rank + (1 << k)) % n for k in range(tau)]
        recv = [((rank - (1 << k)) % n, w) for k in range(tau)]
        return w, send, recv
    hop = 1 << (round_ % tau)
    return 0.5, [(rank + hop) % n], [((rank - hop) % n, 0.5)]


class GossipSync(BaseSync):
    """Average with graph neighbours after every ``every`` steps (see module docstring)."""

    name = "gossip"

    def __init__(self, *, topology: str = "ring", every: int = 1) -> None:
        super().__init__()
        if topology not in GOSSIP_TOPOLOGIES:
            raise ConfigError(f"gossip: topology must be one of {GOSSIP_TOPOLOGIES}, "
                              f"got {topology!r}")
        self.topology = topology
        self.every = check_every(self.name, every)
        self._round = 0

    def _on_step(self, step: int) -> None:
        if (step + 1) % self.every:
            return
        t0 = time.perf_counter()
        w_self, send, recv = gossip_plan(self.world_size, self.rank, self.topology, self._round)
        self._round += 1
        x = flatten(self.params)
        bufs = [torch.empty_like(x) for _ in recv]
        ops = [dist.P2POp(dist.isend, x, peer) for peer in send]
        ops += [dist.P2POp(dist.irecv, buf, peer) for buf, (peer, _) in zip(bufs, recv,
                                                                          strict=True)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        out = x * w_self
        for buf, (_, w) in zip(bufs, recv, strict=True):
            out.add_(buf, alpha=w)
        copy_flat_(self.params, out)
        self._count_bytes(x, copies=len(send))
        self.stats.sync_seconds += time.perf_counter() - t0
        self.stats.syncs += 1
