"""Gossip with momentum (DmSGD) and GADMM's training-loop form on two gloo ranks, step by step
against their updates written out here.

Optimizer and strategy are built as the Trainer builds them (``make_optimizer`` and
``TrainerConfig.sync_config().build()``). Each rank simulates both replicas of a
least-squares problem (its own rows: ``f_r(w) = mean((A_r w − y_r)²)``, gradient
``2/N A_rᵀ(A_r w − y_r)``) and checks its own parameters after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.worker.config import TrainerConfig
from services.worker.dense_optimizers import make_optimizer
from services.worker.distributed import run_local_ranks

STEPS, LR, BETA, RHO, ROWS, DIM = 12, 0.05, 0.9, 0.5, 16, 4


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    a = [torch.randn(ROWS, DIM, generator=gen) for _ in range(2)]
    y = [torch.randn(ROWS, generator=gen) + 3.0 * r for r in range(2)]   # the ranks disagree
    return a, y


def _grad(a: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2.0 / ROWS * a.t() @ (a @ w - y)


def _train(rank: int, cfg: TrainerConfig) -> tuple[Any, torch.nn.Linear, list[torch.Tensor]]:
    """Run STEPS steps on this rank's rows; the weights after each step."""
    a, y = _data()
    torch.manual_seed(rank)                  # different inits: prepare makes them rank 0's
    model = torch.nn.Linear(DIM, 1, bias=False)
    sync = cfg.sync_config().build()
    sync.prepare(model)
    opt = make_optimizer(cfg.dense_optimizer, model, cfg)
    start = model.weight.detach().reshape(-1).clone()
    after = [start]
    for step in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(a[rank]).reshape(-1), y[rank]).backward()
        sync.after_backward(step)
        opt.step()
        sync.after_step(step)
        after.append(model.weight.detach().reshape(-1).clone())
    return sync, model, after


def dmsgd(rank: int) -> dict[str, float]:
    """DmSGD (adapt then combine): m_i = β m_i + g_i(x_i); x_i = Σ_j W_ij (x_j − γ m_j),
    W = [[1/2, 1/2], [1/2, 1/2]] (the two-rank ring)."""
    cfg = TrainerConfig(sync="gossip", dense_optimizer="sgd", momentum=BETA, lr=LR)
    sync, _, got = _train(rank, cfg)
    a, y = _data()
    x = [got[0].clone(), got[0].clone()]
    m = [torch.zeros(DIM), torch.zeros(DIM)]
    worst = 0.0
    for k in range(STEPS):
        m = [BETA * m[j] + _grad(a[j], y[j], x[j]) for j in range(2)]
        local = [x[j] - LR * m[j] for j in range(2)]
        x = [0.5 * local[0] + 0.5 * local[1] for _ in range(2)]
        worst = max(worst, float((got[k + 1] - x[rank]).abs().max()))
    sync.close()
    return {"worst": worst, "moved": float((got[-1] - got[0]).abs().max())}


def gadmm(rank: int) -> dict[str, float]:
    """GADMM's linearised form, head 0 and tail 1: each step both take an SGD step on
    f_n + the edge terms against the neighbour's model as last received,
    head ∇ += ρ(θ_0 − θ̂_1) + λ,  tail ∇ += ρ(θ_1 − θ̂_0) − λ;
    even rounds the head sends, odd rounds the tail sends and then λ += ρ(θ̂_0 − θ̂_1)."""
    cfg = TrainerConfig(sync="gadmm", dense_optimizer="sgd", lr=LR, gadmm_rho=RHO)
    sync, _, got = _train(rank, cfg)
    a, y = _data()
    theta = [got[0].clone(), got[0].clone()]
    seen = [got[0].clone(), got[0].clone()]     # θ̂_0 (the tail's copy), θ̂_1 (the head's)
    lam = torch.zeros(DIM)
    worst = 0.0
    for k in range(STEPS):
        g0 = _grad(a[0], y[0], theta[0]) + RHO * (theta[0] - seen[1]) + lam
        g1 = _grad(a[1], y[1], theta[1]) + RHO * (theta[1] - seen[0]) - lam
        theta = [theta[0] - LR * g0, theta[1] - LR * g1]
        if k % 2 == 0:
            seen[0] = theta[0].clone()
        else:
            seen[1] = theta[1].clone()
            lam = lam + RHO * (seen[0] - seen[1])
        worst = max(worst, float((got[k + 1] - theta[rank]).abs().max()))
    edges = sync.edges
    assert edges is not None
    held = edges.lam_right if rank == 0 else edges.lam_left
    sync.close()
    return {"worst": worst, "dual_error": float((held - lam).abs().max()),
            "dual": float(lam.abs().max())}


def two_rank_checks(rank: int, world: int) -> dict[str, Any]:
    return {"dmsgd": dmsgd(rank), "gadmm": gadmm(rank)}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_local_ranks(two_rank_checks, 2, timeout_s=120)


def test_gossip_with_momentum_is_dmsgd_step_by_step(two: list[dict[str, Any]]) -> None:
    for rank_result in two:
        r = rank_result["dmsgd"]
        assert r["moved"] > 0.1, r
        assert r["worst"] < 1e-5, r


def test_gadmm_alternates_heads_and_tails_and_moves_the_dual(two: list[dict[str, Any]]
                                                              ) -> None:
    for rank_result in two:
        r = rank_result["gadmm"]
        assert r["dual"] > 1e-2, r
        assert r["worst"] < 1e-5, r
        assert r["dual_error"] < 1e-5, r
