"""Sync strategies on real gloo process groups (local ranks).

Starting ranks costs time, so one 4-rank run does many checks and returns plain numbers; the
tests below assert on them one property at a time.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sklearn.metrics import roc_auc_score

from services.common.errors import ConfigError
from services.worker.compression import CodecAverager
from services.worker.distributed import run_local_ranks
from services.worker.evaluation import EvalAccumulator, gather_accumulator
from services.worker.sync import make_sync
from services.worker.sync.base import flatten


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def global_mean(params: list[torch.Tensor]) -> torch.Tensor:
    x = flatten(params).double()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def perturb(params: list[torch.Tensor], rank: int) -> None:
    """Make the replicas differ (after prepare, which made them equal)."""
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) + rank)


def run_averaging(name: str, steps: int, **params: Any) -> dict[str, Any]:
    """Pure syncs (no training): the global mean and consensus distance after every step."""
    sync = make_sync(name, **params)
    sync.prepare(tiny_model())
    perturb(sync.params, dist.get_rank())
    mean0 = global_mean(sync.params)
    dists = [sync.consensus_distance()]
    mean_drift = []
    for step in range(steps):
        sync.after_step(step)
        dists.append(sync.consensus_distance())
        mean_drift.append(float((global_mean(sync.params) - mean0).abs().max()))
    to_mean0 = float((flatten(sync.params).double() - mean0).abs().max())
    sync.close()
    return {"dists": dists, "mean_drift": mean_drift, "to_mean0": to_mean0,
            "scale": float(mean0.abs().max()), "stats": sync.stats.as_dict(),
            "param_bytes": sum(p.numel() * 4 for p in sync.params)}


def train_and_compare(rank: int, world: int, **params: Any) -> dict[str, float]:
    """Gradient averaging on different data per rank equals one process on all the data."""
    data_gen = torch.Generator().manual_seed(7)
    xs = torch.randn(world, 6, 4, generator=data_gen)
    ys = torch.randn(world, 6, 1, generator=data_gen)
    sync = make_sync("allreduce", **params)
    model = tiny_model(seed=rank)        # different inits: prepare must equalise them
    train_model = sync.prepare(model)
    reference = tiny_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(train_model(xs[rank]), ys[rank]).backward()
        sync.after_backward(step)
        opt.step()
        sync.after_step(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(xs.reshape(-1, 4)), ys.reshape(-1, 1)).backward()
        ref_opt.step()
    diff = float((flatten(sync.params) - flatten(list(reference.parameters()))).abs().max())
    out = {"to_reference": diff, "consensus": sync.consensus_distance(),
           "bytes_per_step": sync.stats.bytes_per_step, "syncs": sync.stats.syncs,
           "is_ddp": train_model is not model}
    sync.close()
    return out


def run_shadow(rank: int, syncs: int, **params: Any) -> dict[str, float]:
    """lr = 0: run steps until ``syncs`` background rounds were applied, then close."""
    sync = make_sync("shadow", **params)
    sync.prepare(tiny_model())
    perturb(sync.params, rank)
    mean0 = global_mean(sync.params)
    step = 0
    while sync.stats.syncs < syncs:
        sync.after_step(step)
        step += 1
    sync.close()
    return {"to_mean0": float((flatten(sync.params).double() - mean0).abs().max()),
            "consensus": sync.consensus_distance(), "syncs": sync.stats.syncs}


def run_with_codec(codec: str) -> dict[str, Any]:
    """DS-Sync whose group averages go through a codec (the compression slot)."""
    averager = CodecAverager(codec)
    out = run_averaging("ds_sync", 2, group_size=2, averager=averager)
    out["codec_wire_bytes"] = averager.wire_bytes
    return out


def run_finish(name: str, **params: Any) -> dict[str, Any]:
    """Replicas apart, one step, then finish(): one model, the global mean; then go on."""
    sync = make_sync(name, **params)
    sync.prepare(tiny_model())
    perturb(sync.params, dist.get_rank())
    mean0 = global_mean(sync.params)
    sync.after_step(0)
    ran = sync.finish()
    out = {"ran": ran, "consensus": sync.consensus_distance(),
           "to_mean0": float((flatten(sync.params).double() - mean0).abs().max()),
           "scale": float(mean0.abs().max())}
    sync.after_step(1)                      # training may go on after finish
    sync.close()
    out["steps"] = sync.stats.steps
    return out


def config_error_at_prepare(name: str, **params: Any) -> str:
    try:
        make_sync(name, **params).prepare(tiny_model())
    except ConfigError as exc:
        return str(exc)
    return "no error"


def four_rank_checks(rank: int, world: int) -> dict[str, Any]:
    acc = EvalAccumulator()
    g = np.random.default_rng(rank)
    acc.update((g.random(50) < 0.5).astype(np.float32), g.standard_normal(50))
    everyone = gather_accumulator(acc)
    return {
        "ds_hypercube": run_averaging("ds_sync", 2, group_size=2, schedule="hypercube"),
        "ds_permutation": run_averaging("ds_sync", 6, group_size=2, schedule="permutation",
                                        seed=3),
        "ds_g4": run_averaging("ds_sync", 1, group_size=4),
        "local_sgd": run_averaging("local_sgd", 4, every=2),
        "gossip_ring": run_averaging("gossip", 4, topology="ring"),
        "gossip_exp": run_averaging("gossip", 4, topology="exp"),
        "gossip_onepeer": run_averaging("gossip", 2, topology="onepeer_exp"),
        "ddp": train_and_compare(rank, world),
        "flat": train_and_compare(rank, world, use_ddp=False),
        "shadow": run_shadow(rank, 3),
        "shadow_elastic": run_shadow(rank, 80, elastic_alpha=0.25),
        **{f"finish_{name}": run_finish(name) for name in FINISHING},
        "ds_fp16": run_with_codec("fp16"),
        "err_group": config_error_at_prepare("ds_sync", group_size=3),
        "err_alpha": config_error_at_prepare("shadow", elastic_alpha=0.5),
        "auc_all": (everyone.count, everyone.result().auc, *everyone.arrays()),
    }


FINISHING = ("ds_sync", "local_sgd", "gossip", "shadow")


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_local_ranks(four_rank_checks, 4, timeout_s=120)


TOL = 1e-5


def _never_increases(dists: list[float]) -> bool:
    return all(b <= a * (1 + 1e-6) + 1e-9 for a, b in zip(dists, dists[1:], strict=False))


@pytest.mark.parametrize("check", ["ds_hypercube", "ds_permutation", "ds_g4", "local_sgd",
                                   "gossip_ring", "gossip_exp", "gossip_onepeer"])
def test_pure_syncs_keep_the_global_mean_and_never_increase_consensus_distance(
        four: list[dict[str, Any]], check: str) -> None:
    for rank_result in four:
        r = rank_result[check]
        assert r["dists"][0] > 1.0                         # replicas really started apart
        assert max(r["mean_drift"]) <= TOL * max(r["scale"], 1.0)
        assert _never_increases(r["dists"]), r["dists"]


def test_ds_sync_groups_average_and_a_hypercube_cycle_gives_the_global_average(
        four: list[dict[str, Any]]) -> None:
    for rank_result in four:
        hyper = rank_result["ds_hypercube"]
        assert hyper["dists"][1] > 0.1                    # one pairing round: not mixed yet
        assert hyper["dists"][2] < 1e-5                   # second round: everyone agrees
        assert hyper["to_mean0"] < TOL * hyper["scale"]
        assert rank_result["ds_g4"]["to_mean0"] < TOL * rank_result["ds_g4"]["scale"]
        perm = rank_result["ds_permutation"]
        assert perm["dists"][-1] < 0.5 * perm["dists"][0]


def test_local_sgd_averages_only_every_h_steps(four: list[dict[str, Any]]) -> None:
    r = four[0]["local_sgd"]
    d = r["dists"]
    assert d[1] == pytest.approx(d[0])                    # step 0: no sync
    assert d[2] < 1e-5 and d[4] < 1e-5                    # steps 1 and 3: synced
    assert r["stats"]["syncs"] == 2
    assert r["stats"]["bytes_per_step"] == pytest.approx(r["param_bytes"] / 2)


def test_gossip_mixes_and_reports_bytes_per_neighbour(four: list[dict[str, Any]]) -> None:
    for key in ("gossip_ring", "gossip_exp"):
        r = four[0][key]
        assert r["dists"][-1] < 0.1 * r["dists"][0]
    ring = four[0]["gossip_ring"]
    assert ring["stats"]["bytes_per_step"] == pytest.approx(2 * ring["param_bytes"])
    # one-peer exponential graph on 4 ranks: exact average after log2(4) = 2 rounds
    assert four[0]["gossip_onepeer"]["dists"][-1] < 1e-5


@pytest.mark.parametrize("engine", ["ddp", "flat"])
def test_allreduce_keeps_replicas_identical_and_equals_one_big_batch(
        four: list[dict[str, Any]], engine: str) -> None:
    for rank_result in four:
        r = rank_result[engine]
        assert r["consensus"] == 0.0
        assert r["to_reference"] < 1e-5
        assert r["syncs"] == 4
        assert r["bytes_per_step"] == 4 * (4 * 3 + 3 + 3 + 1)
        assert r["is_ddp"] == (engine == "ddp")


@pytest.mark.parametrize("check", ["shadow", "shadow_elastic"])
def test_shadow_with_lr_zero_brings_replicas_to_their_initial_mean(
        four: list[dict[str, Any]], check: str) -> None:
    for rank_result in four:
        r = rank_result[check]
        assert r["syncs"] >= (3 if check == "shadow" else 80)
        assert r["to_mean0"] < 1e-4
        assert r["consensus"] < 1e-4


def test_ds_sync_composes_with_a_codec(four: list[dict[str, Any]]) -> None:
    for rank_result in four:
        r = rank_result["ds_fp16"]
        assert r["stats"]["bytes_sent"] == r["codec_wire_bytes"] > 0   # the codec's bytes
        assert r["dists"][-1] < 1e-2 * r["dists"][0]                   # mixed, up to fp16
        assert max(r["mean_drift"]) <= 1e-2 * max(r["scale"], 1.0)


@pytest.mark.parametrize("name", FINISHING)
def test_finish_gives_every_replica_the_global_mean(four: list[dict[str, Any]],
                                                   name: str) -> None:
    for rank_result in four:
        r = rank_result[f"finish_{name}"]
        assert r["ran"] and r["steps"] == 2
        assert r["consensus"] < 1e-5
        assert r["to_mean0"] < TOL * max(r["scale"], 1.0)


def test_bad_group_settings_fail_at_prepare_on_every_rank(four: list[dict[str, Any]]) -> None:
    for rank_result in four:
        assert "must be >= 2 and divide the world size 4" in rank_result["err_group"]
        assert "elastic_alpha * world_size must be <= 1" in rank_result["err_alpha"]


def test_gathered_eval_accumulator_sees_every_rank(four: list[dict[str, Any]]) -> None:
    count, gathered_auc, y, z = four[2]["auc_all"]
    assert count == 200 and y.size == 200
    assert gathered_auc == pytest.approx(roc_auc_score(y, z), abs=1e-12)
    assert all(math.isclose(r["auc_all"][1], gathered_auc) for r in four)
