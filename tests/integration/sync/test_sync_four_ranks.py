"""Hierarchical all-reduce, SFB and GADMM on 4 real gloo ranks.

Hierarchical and SFB gradients equal the flat all-reduce's; GADMM over point-to-point
send/recv is the in-process chain's algorithm, and its training-loop form reaches the
centralised logistic-regression loss.

One 4-rank run does every check and returns plain numbers; the tests assert on them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from services.common.errors import ConfigError
from services.worker.distributed import run_local_ranks
from services.worker.sync import make_sync
from services.worker.sync.base import copy_flat_, flatten
from services.worker.sync.gadmm import LogisticWorker, logistic_objective, run_chain, simulate
from tests.unit.worker.gadmm_problem import L2, centralised_loss, loss, problem


def wide_model(seed: int) -> torch.nn.Module:
    """Two layers where 8 rows of factors are smaller than the gradient, one where not."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def against_flat(rank: int, world: int, name: str, **params: Any) -> dict[str, Any]:
    """Train with ``name`` beside a replica averaged by a flat all-reduce; the largest
    gradient difference over 3 steps. Ranks have batches of 5..8 rows (SFB pads)."""
    sync = make_sync(name, **params)
    model = wide_model(seed=rank)          # prepare makes every replica rank 0's (seed 0)
    forward = sync.prepare(model)
    reference = wide_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    diff, scale = 0.0, 0.0
    for step in range(3):
        x, y = torch.randn(5 + rank, 40, generator=gen), torch.randn(5 + rank, 1, generator=gen)
        for net, o in ((forward, opt), (reference, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        sync.after_backward(step)
        ref_grads = [p.grad for p in reference.parameters()]
        ref = flatten(ref_grads)
        dist.all_reduce(ref)
        copy_flat_(ref_grads, ref.div_(world))
        got = flatten([p.grad for p in model.parameters()])
        diff, scale = max(diff, float((got - ref).abs().max())), max(scale, float(ref.abs().max()))
        opt.step()
        ref_opt.step()
        sync.after_step(step)
    sync.close()
    return {"diff": diff, "scale": scale, "stats": sync.stats.as_dict(),
            "factor_layers": getattr(sync, "factor_layers", None),
            "param_bytes": sum(p.numel() * 4 for p in model.parameters())}


def bad_layout() -> str:
    sync = make_sync("hierarchical", ranks_per_node=3)
    try:
        sync.prepare(torch.nn.Linear(2, 2))
    except ConfigError as exc:
        return str(exc)
    return "no error"


GADMM_ROUNDS, GADMM_RHO = 10, 0.01


def gadmm_exact(rank: int, world: int) -> tuple[list[float], int]:
    """The paper's GADMM, this rank being chain worker ``rank``: its model, bytes sent."""
    x, y = problem()
    worker = LogisticWorker(x.chunk(world)[rank], y.chunk(world)[rank], index=rank,
                            world=world, total=len(y), rho=GADMM_RHO, l2=L2)
    sent = run_chain(worker, GADMM_ROUNDS)
    return worker.theta.tolist(), sent


def gadmm_training(rank: int, world: int) -> dict[str, Any]:
    """``--sync gadmm`` in a training loop: SGD on each rank's slice, 60 steps."""
    x, y = problem()
    xs, ys = x.chunk(world)[rank].float(), y.chunk(world)[rank].float()
    model = torch.nn.Linear(x.shape[1], 1, bias=False)
    sync = make_sync("gadmm", rho=0.2)
    sync.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    for step in range(60):
        opt.zero_grad()
        logistic_objective(model.weight.view(-1), xs, ys, total=len(y), l2=L2,
                           share=1 / world).backward()
        sync.after_backward(step)
        opt.step()
        sync.after_step(step)
    apart = sync.consensus_distance()
    sync.finish()
    return {"apart": apart, "loss": loss(model.weight.view(-1), x, y),
            "stats": sync.stats.as_dict()}


def checks(rank: int, world: int) -> dict[str, Any]:
    return {"hier": against_flat(rank, world, "hierarchical", ranks_per_node=2),
            "hier_k1": against_flat(rank, world, "hierarchical", ranks_per_node=1),
            "sfb": against_flat(rank, world, "sfb"),
            "bad_layout": bad_layout(),
            "gadmm_exact": gadmm_exact(rank, world),
            "gadmm_training": gadmm_training(rank, world)}


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_local_ranks(checks, 4, timeout_s=120)


@pytest.mark.parametrize("name", ["hier", "hier_k1", "sfb"])
def test_gradients_equal_the_flat_allreduce(four: list[dict[str, Any]], name: str) -> None:
    for r in four:
        assert r[name]["scale"] > 1e-3                        # there is a gradient to compare
        assert r[name]["diff"] <= 1e-6 * r[name]["scale"] + 1e-7, (name, r[name])


def test_hierarchical_sends_one_payload_per_node_across_nodes(
        four: list[dict[str, Any]]) -> None:
    flat_cross = 4 * four[0]["hier"]["param_bytes"]   # all 4 ranks' payload in one collective
    for r in four:
        assert r["hier"]["stats"]["cross_node_bytes"] / 3 == flat_cross / 2   # K = 2: half
        assert r["hier_k1"]["stats"]["cross_node_bytes"] / 3 == flat_cross   # K = 1: flat


def test_sfb_sends_factors_for_the_wide_layers_only(four: list[dict[str, Any]]) -> None:
    for r in four:
        assert r["sfb"]["factor_layers"] == 2                 # 64x40 and 64x64; not 1x64
        assert r["sfb"]["stats"]["bytes_per_step"] < 0.5 * r["sfb"]["param_bytes"]


def test_a_node_size_that_does_not_divide_the_world_is_refused(
        four: list[dict[str, Any]]) -> None:
    for r in four:
        assert "must divide the world size 4" in r["bad_layout"]


def test_gadmm_on_real_ranks_is_the_chain_algorithm(four: list[dict[str, Any]]) -> None:
    x, y = problem()
    workers = [LogisticWorker(xs, ys, index=i, world=4, total=len(y), rho=GADMM_RHO, l2=L2)
               for i, (xs, ys) in enumerate(zip(x.chunk(4), y.chunk(4), strict=True))]
    simulate(workers, GADMM_ROUNDS)
    best = centralised_loss(x, y)
    for r, w in zip(four, workers, strict=True):
        theta, _ = r["gadmm_exact"]
        torch.testing.assert_close(torch.tensor(theta, dtype=torch.float64), w.theta)
        assert loss(w.theta, x, y) - best < 1e-3
    sent = [r["gadmm_exact"][1] for r in four]
    assert sent[0] == sent[3] == sent[1] / 2 == sent[2] / 2 > 0   # ends have one neighbour


def test_gadmm_training_loop_reaches_the_centralised_loss(four: list[dict[str, Any]]) -> None:
    x, y = problem()
    best = centralised_loss(x, y)
    for r in four:
        g = r["gadmm_training"]
        assert g["apart"] < 1e-2                   # the chain agrees before the final average
        assert g["loss"] - best < 1e-3
        assert g["stats"]["syncs"] == 60 + 1        # a round a step, then the final average
