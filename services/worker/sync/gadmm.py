"""``gadmm``: Group ADMM (Elgabli et al. 2020): a chain of workers, heads and tails alternating.

Worker n of N holds its model ``θ_n``, its copies of its neighbours' models and the duals
``λ_{n-1}``, ``λ_n`` of the constraints ``θ_{n-1} = θ_n``, ``θ_n = θ_{n+1}`` (its two edges;
one at the chain's ends). Even ranks are *heads*, odd ranks *tails*. One iteration (ρ > 0):

1. heads: ``θ_n ← argmin f_n(θ) + λ_{n-1}·(θ_{n-1} − θ) + λ_n·(θ − θ_{n+1})
   + ρ/2 ||θ_{n-1} − θ||² + ρ/2 ||θ − θ_{n+1}||²``, then send ``θ_n`` to both neighbours;
2. tails: the same against the heads' new models, then send;
3. every edge: ``λ_n ← λ_n + ρ (θ_n − θ_{n+1})``, computed alike at both of its ends.

Each worker exchanges only with its two neighbours. Two forms here:

- :class:`LogisticWorker`: the paper's algorithm for L2-regularised logistic regression, the
  local argmin solved by Newton's method; :func:`simulate` runs a chain in one process and
  :func:`run_chain` on real ranks (point-to-point send/recv).
- :class:`GADMMSync` (``--sync gadmm``), the training-loop form: every step adds the gradient
  of the edge terms to the local gradient before the optimizer step (a linearised local
  solve); every ``every`` steps one group sends its parameters (heads on even rounds, tails on
  odd), and the duals move after the tails' turn. It converges for convex models
  (``--model lr``, the wide part) under plain SGD steps (Adam's rescaling lets the duals
  grow without bound); the run ends with the replicas' average.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from services.common.errors import ConfigError
from services.worker.sync.base import BaseSync, add_flat_, check_every, dense_grads, flatten

__all__ = ["ChainEdges", "GADMMSync", "LogisticWorker", "logistic_objective",
           "planted_logistic", "run_chain", "simulate"]


class ChainEdges:
    """One worker's side of its chain edges: neighbour models, duals, and their terms."""

    def __init__(self, index: int, world: int, theta: Tensor, rho: float) -> None:
        if not isinstance(rho, int | float) or isinstance(rho, bool) or not rho > 0:
            raise ConfigError(f"gadmm: rho must be > 0, got {rho!r}")
        if not 0 <= index < world:
            raise ConfigError(f"gadmm: index {index} is outside a chain of {world}")
        self.rho = float(rho)
        self.index = index
        zero = torch.zeros_like(theta)
        self.left = theta.clone() if index > 0 else None     # θ_{n-1}, as last received
        self.right = theta.clone() if index < world - 1 else None
        self.lam_left = zero.clone()                          # λ_{n-1}
        self.lam_right = zero.clone()                         # λ_n

    @property
    def neighbours(self) -> list[int]:
        """Chain indices of the neighbours, left first."""
        return [i for i, t in ((self.index - 1, self.left), (self.index + 1, self.right))
                if t is not None]

    def grad(self, theta: Tensor) -> Tensor:
        """Gradient of the edge terms of the augmented Lagrangian at ``theta``."""
        g = torch.zeros_like(theta)
        if self.left is not None:
            g += self.rho * (theta - self.left) - self.lam_left
        if self.right is not None:
            g += self.rho * (theta - self.right) + self.lam_right
        return g

    def curvature(self) -> float:
        """Their Hessian is this times the identity."""
        return self.rho * len(self.neighbours)

    def update_duals(self, own: Tensor) -> None:
        """``λ += ρ (θ_left_end − θ_right_end)`` on both edges, ``own`` being this worker's
        model as its neighbours last received it."""
        if self.left is not None:
            self.lam_left += self.rho * (self.left - own)
        if self.right is not None:
            self.lam_right += self.rho * (own - self.right)


def logistic_objective(theta: Tensor, x: Tensor, y: Tensor, *, total: int, l2: float,
                       share: float = 1.0) -> Tensor:
    """``sum_i BCE(x_i·θ, y_i) / total + share * l2/2 ||θ||²``: a worker's part ``f_n`` of the
    global mean log-loss plus L2 (``share`` = 1/N), or the whole objective (share 1)."""
    loss = F.binary_cross_entropy_with_logits(x @ theta, y, reduction="sum") / total
    return loss + share * l2 / 2 * theta.dot(theta)


def planted_logistic(rows: int, dim: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A logistic-regression problem (float64 rows with an intercept column, 0/1 labels drawn
    from a planted model), sorted by the first feature: contiguous slices are non-iid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    x[:, -1] = 1.0
    w = torch.randn(dim, generator=g, dtype=torch.float64)
    y = (torch.rand(rows, generator=g, dtype=torch.float64) < torch.sigmoid(x @ w)).double()
    order = torch.argsort(x[:, 0])
    return x[order], y[order]


class LogisticWorker:
    """One GADMM worker of logistic regression on its rows ``x`` (``B x d``), labels ``y``."""

    def __init__(self, x: Tensor, y: Tensor, *, index: int, world: int, total: int,
                 rho: float = 1.0, l2: float = 1e-2, newton_steps: int = 30) -> None:
        if x.dim() != 2 or y.shape != (x.shape[0],):
            raise ConfigError(f"gadmm: x must be (B, d) and y (B,), got {tuple(x.shape)} and "
                              f"{tuple(y.shape)}")
        self.x, self.y = x.double(), y.double()
        self.total, self.l2, self.world = total, l2, world
        self.newton_steps = newton_steps
        self.theta = torch.zeros(x.shape[1], dtype=torch.float64)
        self.edges = ChainEdges(index, world, self.theta, rho)

    def solve(self) -> Tensor:
        """The local argmin against the neighbours' current models (Newton's method)."""
        x, theta = self.x, self.theta.clone()
        eye = torch.eye(x.shape[1], dtype=x.dtype)
        reg = self.l2 / self.world + self.edges.curvature()
        for _ in range(self.newton_steps):
            p = torch.sigmoid(x @ theta)
            grad = x.t() @ (p - self.y) / self.total + self.l2 / self.world * theta \
                + self.edges.grad(theta)
            hess = (x.t() * (p * (1 - p))) @ x / self.total + reg * eye
            step = torch.linalg.solve(hess, grad)
            theta -= step
            if float(step.abs().max()) < 1e-12:
                break
        self.theta = theta
        return theta


def _give(workers: Sequence[LogisticWorker], sender: int) -> int:
    """Hand worker ``sender``'s model to its neighbours in-process; the bytes it sent."""
    w = workers[sender]
    for n in w.edges.neighbours:
        edges = workers[n].edges
        if n < sender:
            edges.right = w.theta.clone()
        else:
            edges.left = w.theta.clone()
    return len(w.edges.neighbours) * w.theta.numel() * w.theta.element_size()


def simulate(workers: Sequence[LogisticWorker], rounds: int,
             on_round: Callable[[int], None] | None = None) -> int:
    """Run ``rounds`` GADMM iterations over a chain held in this process (``workers`` in
    chain order); returns the bytes sent by all workers together."""
    sent = 0
    for r in range(rounds):
        for group in (0, 1):                         # heads, then tails
            for i in range(group, len(workers), 2):
                workers[i].solve()
            for i in range(group, len(workers), 2):
                sent += _give(workers, i)
        for w in workers:
            w.edges.update_duals(w.theta)
        if on_round is not None:
            on_round(r)
    return sent


def _exchange(edges: ChainEdges, own: Tensor, sending: bool) -> int:
    """Send ``own`` to both neighbours, or receive theirs (collective over the chain)."""
    if sending:
        works = [dist.isend(own.contiguous(), dst=n) for n in edges.neighbours]
        for work in works:
            if work is not None:   # None: this rank is not in the group (never here)
                work.wait()
        return len(works) * own.numel() * own.element_size()
    for n in edges.neighbours:
        buf = torch.empty_like(own)
        dist.recv(buf, src=n)
        if n < edges.index:
            edges.left = buf
        else:
            edges.right = buf
    return 0


def run_chain(worker: LogisticWorker, rounds: int) -> int:
    """Run ``rounds`` GADMM iterations with this rank as chain worker ``rank`` (every rank
    of the default group calls it); returns the bytes this rank sent."""
    sent = 0
    for _ in range(rounds):
        for group in (0, 1):
            mine = worker.edges.index % 2 == group
            if mine:
                worker.solve()
            sent += _exchange(worker.edges, worker.theta, mine)
        worker.edges.update_duals(worker.theta)
    return sent


class GADMMSync(BaseSync):
    """GADMM in the training loop: edge terms added to the gradients, groups alternating."""

    name = "gadmm"

    def __init__(self, *, every: int = 1, rho: float = 0.1) -> None:
        super().__init__()
        self.every = check_every(self.name, every)
        ChainEdges(0, 1, torch.zeros(1), rho)     # checks rho before any group exists
        self.rho = float(rho)
        self.edges: ChainEdges | None = None
        self._sent: Tensor | None = None          # this model as the neighbours last got it
        self._round = 0

    def _setup(self) -> None:
        if self.active and self.params:
            own = flatten(self.params)
            self.edges = ChainEdges(self.rank, self.world_size, own, self.rho)
            self._sent = own

    def _on_backward(self, step: int) -> None:
        if self.edges is None:
            return
        add_flat_(dense_grads(self.params), self.edges.grad(flatten(self.params)))

    def _on_step(self, step: int) -> None:
        if self.edges is None or (step + 1) % self.every:
            return
        t0 = time.perf_counter()
        group = self._round % 2                     # 0: heads send, 1: tails send
        sending = self.rank % 2 == group
        own = flatten(self.params) if sending or self._sent is None else self._sent
        self._sent = own
        self.stats.bytes_sent += _exchange(self.edges, own, sending)
        if group == 1:
            self.edges.update_duals(own)
        self._round += 1
        self.stats.syncs += 1
        self.stats.sync_seconds += time.perf_counter() - t0
