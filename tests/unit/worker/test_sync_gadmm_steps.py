"""GADMM's exact form, round by round, against the paper's equations written out.

Two workers (head 0, tail 1) share the constraint θ_0 = θ_1 with dual λ (Elgabli et al. 2020,
eqs. 9-11)::

    θ_0^{k+1} = argmin f_0(θ) + λ^k·(θ − θ_1^k)     + ρ/2 ||θ − θ_1^k||²
    θ_1^{k+1} = argmin f_1(θ) + λ^k·(θ_0^{k+1} − θ) + ρ/2 ||θ_0^{k+1} − θ||²
    λ^{k+1}   = λ^k + ρ (θ_0^{k+1} − θ_1^{k+1})

The tail solves against the head's NEW model (a Jacobi update, both against round k's, or a
dual of the opposite sign, fails). Each argmin here is scipy's BFGS on the objective written
out with numpy, independent of the worker's Newton solver.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import minimize

from services.worker.sync.gadmm import LogisticWorker, simulate
from tests.unit.worker.gadmm_problem import L2, problem

RHO, ROUNDS = 0.05, 6


def _argmin(x: np.ndarray, y: np.ndarray, total: int, edge_lin: np.ndarray,
            anchor: np.ndarray) -> np.ndarray:
    """argmin f(θ) + edge_lin·θ + ρ/2 ||θ − anchor||², f = Σ log-loss / total + (L2/2)/2 ||θ||²."""
    share = L2 / 2

    def fun(t: np.ndarray) -> tuple[float, np.ndarray]:
        z = x @ t
        loss = np.sum(np.logaddexp(0.0, z) - y * z) / total + share / 2 * t @ t
        grad = x.T @ (1 / (1 + np.exp(-z)) - y) / total + share * t
        d = t - anchor
        return (loss + edge_lin @ t + RHO / 2 * d @ d,
                grad + edge_lin + RHO * d)

    res = minimize(fun, anchor, jac=True, method="BFGS", options={"gtol": 1e-12,
                                                                 "maxiter": 1000})
    return np.asarray(res.x)


def test_head_tail_alternation_and_duals_follow_the_paper() -> None:
    x, y = problem()
    total = len(y)
    (x0, x1), (y0, y1) = x.chunk(2), y.chunk(2)
    workers = [LogisticWorker(xs, ys, index=i, world=2, total=total, rho=RHO, l2=L2)
               for i, (xs, ys) in enumerate(((x0, y0), (x1, y1)))]
    parts = [(x0.numpy(), y0.numpy()), (x1.numpy(), y1.numpy())]
    dim = x.shape[1]
    theta = [np.zeros(dim), np.zeros(dim)]
    lam = np.zeros(dim)
    for _ in range(ROUNDS):
        simulate(workers, 1)
        # head: + λ·(θ − θ_1) → linear term +λ;  tail: + λ·(θ_0 − θ) → linear term −λ
        theta[0] = _argmin(*parts[0], total, lam, theta[1])
        theta[1] = _argmin(*parts[1], total, -lam, theta[0])
        lam = lam + RHO * (theta[0] - theta[1])
        for worker, want in zip(workers, theta, strict=True):
            np.testing.assert_allclose(worker.theta.numpy(), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(workers[0].edges.lam_right.numpy(), lam, rtol=1e-5,
                                   atol=1e-7)
        np.testing.assert_allclose(workers[1].edges.lam_left.numpy(), lam, rtol=1e-5,
                                   atol=1e-7)
    assert float(np.abs(lam).max()) > 1e-3                     # the duals did move
    assert float(torch.tensor(theta[0] - theta[1]).abs().max()) < 1.0
