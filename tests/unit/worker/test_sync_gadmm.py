"""GADMM on a chain held in one process reaches the centralised logistic-regression loss."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.models import build_model
from services.worker.sync import SyncConfig, make_sync
from services.worker.sync.gadmm import ChainEdges, LogisticWorker, simulate
from tests.unit.worker.gadmm_problem import L2, centralised_loss, loss, problem


def chain(world: int, rho: float) -> list[LogisticWorker]:
    x, y = problem()
    return [LogisticWorker(xs, ys, index=i, world=world, total=len(y), rho=rho, l2=L2)
            for i, (xs, ys) in enumerate(zip(x.chunk(world), y.chunk(world), strict=True))]


def test_the_chain_reaches_the_centralised_loss_within_1e_3() -> None:
    x, y = problem()
    best = centralised_loss(x, y)
    workers = chain(4, rho=0.01)
    alone = [loss(w.solve(), x, y) - best for w in chain(4, rho=0.01)]  # no neighbours yet
    assert max(alone) > 1e-2                                  # the slices disagree
    sent = simulate(workers, 10)
    for w in workers:                                         # every replica, not a mean
        assert loss(w.theta, x, y) - best < 1e-3
    assert sent == 10 * (1 + 2 + 2 + 1) * 6 * 8               # each to its 1 or 2 neighbours


def test_edges_only_link_chain_neighbours() -> None:
    theta = torch.zeros(3)
    assert ChainEdges(0, 4, theta, 1.0).neighbours == [1]
    assert ChainEdges(2, 4, theta, 1.0).neighbours == [1, 3]
    assert ChainEdges(3, 4, theta, 1.0).neighbours == [2]
    assert ChainEdges(0, 1, theta, 1.0).grad(torch.ones(3)).abs().max() == 0  # no edges


@pytest.mark.parametrize("rho", [0.0, -1.0, True])
def test_a_bad_rho_is_refused(rho: object) -> None:
    with pytest.raises(ConfigError, match="rho"):
        make_sync("gadmm", rho=rho)


def test_bad_gadmm_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="outside a chain"):
        ChainEdges(4, 4, torch.zeros(2), 1.0)
    with pytest.raises(ConfigError, match=r"x must be \(B, d\)"):
        LogisticWorker(torch.zeros(5, 2), torch.zeros(4), index=0, world=2, total=9)
    with pytest.raises(ConfigError, match="rho"):
        SyncConfig(name="gadmm", rho=0.0)
    with pytest.raises(ConfigError, match="uncompressed"):
        TrainerConfig(sync="gadmm", dense_optimizer="sgd", dense_codec="fp16")
    with pytest.raises(ConfigError, match="needs dense_optimizer 'sgd'"):
        TrainerConfig(sync="gadmm")                              # Adam, the default
    config = TrainerConfig(sync="gadmm", dense_optimizer="sgd", gadmm_rho=0.5)
    assert config.sync_config().params() == {"rho": 0.5}


def test_the_lr_model_is_one_linear_layer_over_embeddings_and_dense() -> None:
    model = build_model("lr", sparse_dims={"a": 3, "b": 2}, num_dense=4)
    assert [tuple(p.shape) for p in model.parameters()] == [(1, 9), (1,)]
    pooled = {"a": torch.randn(5, 3), "b": torch.randn(5, 2)}
    dense = torch.randn(5, 4)
    flat = torch.cat([pooled["a"], pooled["b"], dense], 1)
    linear = model.linear
    torch.testing.assert_close(model(pooled, dense), (flat @ linear.weight.t()).squeeze(1)
                               + linear.bias)
