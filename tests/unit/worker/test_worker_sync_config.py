"""Sync strategies without a process group: factory errors, schedules, graphs, no-op behaviour."""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest
import torch

from services.cli import build_parser
from services.common.config import add_flags, flag_values, from_dict, load_config
from services.common.errors import ConfigError
from services.worker.config import TrainerConfig
from services.worker.distributed import init_distributed
from services.worker.sync import (
    STRATEGIES,
    DSSync,
    GossipSync,
    SyncConfig,
    SyncStrategy,
    ds_rounds,
    gossip_plan,
    make_sync,
    strategy_params,
)


def _mixing_matrix(groups: list[list[int]], n: int) -> np.ndarray:
    w = np.zeros((n, n))
    for g in groups:
        for i, j in itertools.product(g, g):
            w[i, j] = 1.0 / len(g)
    return w


@pytest.mark.parametrize("n, g", [(2, 2), (4, 2), (8, 2), (8, 4), (16, 4), (32, 8), (8, 8)])
def test_hypercube_cycle_is_exactly_the_global_average(n: int, g: int) -> None:
    rounds = ds_rounds(n, g, "hypercube")
    assert len(rounds) == -(-int(np.log2(n)) // int(np.log2(g)))
    total = np.eye(n)
    for groups in rounds:
        assert sorted(r for grp in groups for r in grp) == list(range(n))   # a partition
        assert all(len(grp) == g for grp in groups)
        total = _mixing_matrix(groups, n) @ total
    np.testing.assert_allclose(total, np.full((n, n), 1.0 / n), atol=1e-12)


def test_permutation_schedule_is_seeded_partitions_that_mix() -> None:
    a = ds_rounds(6, 3, "permutation", period=5, seed=1)
    assert a == ds_rounds(6, 3, "permutation", period=5, seed=1)    # every rank agrees
    assert a != ds_rounds(6, 3, "permutation", period=5, seed=2)
    total = np.eye(6)
    for groups in a * 4:
        assert sorted(r for grp in groups for r in grp) == list(range(6))
        total = _mixing_matrix(groups, 6) @ total
    assert np.abs(total - 1.0 / 6).max() < 1e-3


@pytest.mark.parametrize("n, g, schedule, match", [
    (6, 2, "hypercube", "power-of-two"),
    (8, 3, "hypercube", "divide"),
    (6, 4, "permutation", "divide"),
    (4, 2, "spiral", "schedule"),
])
def test_bad_ds_schedules(n: int, g: int, schedule: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ds_rounds(n, g, schedule)


@pytest.mark.parametrize("topology", ["ring", "exp", "onepeer_exp"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_gossip_graphs_are_doubly_stochastic_and_consistent(topology: str, n: int) -> None:
    for round_ in range(3):
        w = np.zeros((n, n))
        sends: dict[int, list[int]] = {}
        for i in range(n):
            w_self, send, recv = gossip_plan(n, i, topology, round_)
            w[i, i] = w_self
            sends[i] = send
            for j, wij in recv:
                w[i, j] += wij
        np.testing.assert_allclose(w.sum(1), 1.0)
        np.testing.assert_allclose(w.sum(0), 1.0)
        for i in range(n):   # i receives from j exactly when j sends to i
            senders = sorted(j for j in range(n) if i in sends[j])
            assert senders == sorted(j for j, _ in gossip_plan(n, i, topology, round_)[2])


def test_make_sync_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="unknown sync strategy 'allgather'"):
        make_sync("allgather")
    with pytest.raises(ConfigError, match="'ds_sync' does not take \\['topology'\\]"):
        make_sync("ds_sync", topology="ring")
    with pytest.raises(ConfigError, match="every must be an int >= 1"):
        make_sync("local_sgd", every=0)
    with pytest.raises(ConfigError, match="group_size"):
        make_sync("ds_sync", group_size=1)
    with pytest.raises(ConfigError, match="topology"):
        make_sync("gossip", topology="star")
    with pytest.raises(ConfigError, match="elastic_alpha"):
        make_sync("shadow", elastic_alpha=1.5)
    with pytest.raises(ConfigError, match="comm_hook must be a \\(state, hook\\) pair"):
        make_sync("allreduce", comm_hook=("state", "not callable"))
    with pytest.raises(ConfigError, match="needs use_ddp=True"):
        make_sync("allreduce", use_ddp=False, comm_hook=(None, lambda s, b: None))
    assert strategy_params("gossip") == ["topology", "every"]


def test_sync_config_passes_only_what_the_strategy_takes() -> None:
    cfg = from_dict(SyncConfig, {"name": "ds_sync", "group_size": 4, "schedule": "permutation",
                                 "topology": "exp"})
    assert cfg.params() == {"group_size": 4, "schedule": "permutation", "period": 8,
                            "seed": 0}
    strategy = cfg.build()
    assert strategy.name == "ds_sync" and strategy.group_size == 4
    assert SyncConfig(name="local_sgd").build().every == 8
    assert SyncConfig(name="gossip", every=3).params() == {"topology": "ring",
                                                         "every": 3}
    with pytest.raises(ConfigError, match="unknown sync strategy"):
        SyncConfig(name="nope")
    with pytest.raises(ConfigError, match="unknown keys"):
        from_dict(SyncConfig, {"name": "shadow", "alpha": 0.1})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_single_process_strategies_are_no_ops(name: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    strategy = make_sync(name)
    assert isinstance(strategy, SyncStrategy)
    assert strategy.prepare(model) is model
    with pytest.raises(ConfigError, match="already called"):
        strategy.prepare(model)
    model(torch.randn(4, 3)).sum().backward()
    for step in range(10):
        strategy.after_backward(step)
        strategy.after_step(step)
    assert strategy.consensus_distance() == 0.0
    assert strategy.finish() is False
    strategy.close()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    assert strategy.stats.steps == 10 and strategy.stats.bytes_sent == 0


def test_init_distributed_single_process_and_bad_env() -> None:
    info = init_distributed(environ={})
    assert (info.rank, info.world_size, info.initialized) == (0, 1, False)
    assert info.is_main
    with pytest.raises(ConfigError, match="rank must be in \\[0, 2\\)"):
        init_distributed(environ={"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "29500"})
    with pytest.raises(ConfigError, match="master_port"):
        init_distributed(environ={"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(ConfigError, match="not an integer"):
        init_distributed(environ={"WORLD_SIZE": "two"})
    with pytest.raises(ConfigError, match="backend must be one of"):
        init_distributed(backend="mpi", environ={})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            init_distributed(backend="nccl", environ={})


def test_trainer_config_chooses_the_strategy() -> None:
    cfg = TrainerConfig(sync="ds_sync", sync_group_size=4, sync_period=2,
                        sync_schedule="permutation")
    strategy = cfg.sync_config().build()
    assert isinstance(strategy, DSSync)
    assert (strategy.group_size, strategy.every, strategy.schedule) == (4, 2, "permutation")
    assert TrainerConfig().sync_config().build().name == "allreduce"
    gossip = TrainerConfig(sync="gossip", gossip_topology="exp").sync_config().build()
    assert isinstance(gossip, GossipSync) and gossip.topology == "exp"
    # parameter averaging composes with a codec (the CodecAverager), not with a DDP-only hook
    assert TrainerConfig(sync="shadow", dense_codec="qsgd").sync == "shadow"


@pytest.mark.parametrize("settings, match", [
    ({"sync": "allgather"}, "unknown sync strategy"),
    ({"sync": "local_sgd", "sync_period": 0}, "every must be >= 1"),
    ({"sync": "ds_sync", "sync_group_size": 1}, "group_size"),
    ({"sync": "ds_sync", "sync_schedule": "spiral"}, "schedule"),
    ({"sync": "gossip", "gossip_topology": "star"}, "topology"),
    ({"sync": "shadow", "sync_elastic_alpha": 2.0}, "elastic_alpha"),
    ({"sync": "local_sgd", "dense_optimizer": "onebit_adam"}, "needs sync 'allreduce'"),
    ({"sync": "gossip", "dense_codec": "fp16"}, "uncompressed"),
    ({"sync": "shadow", "dense_codec": "powersgd"}, "averages parameters through a codec"),
])
def test_bad_sync_settings_are_config_errors(settings: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**settings)


def test_sync_flags_and_env_reach_the_trainer_config() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainerConfig)
    args = parser.parse_args(["--sync", "gossip", "--gossip-topology", "onepeer_exp",
                              "--sync-period", "3"])
    cfg = load_config(TrainerConfig, flags=flag_values(TrainerConfig, args), environ={})
    assert (cfg.sync, cfg.gossip_topology, cfg.sync_period) == ("gossip", "onepeer_exp", 3)
    env = {"PERSIMMON_WORKER_SYNC": "shadow", "PERSIMMON_WORKER_SYNC_ELASTIC_ALPHA": "0.25"}
    cfg = load_config(TrainerConfig, env_prefix="PERSIMMON_WORKER_", environ=env)
    assert (cfg.sync, cfg.sync_elastic_alpha) == ("shadow", 0.25)
    with pytest.raises(ConfigError, match="unknown sync strategy"):
        load_config(TrainerConfig, flags={"sync": "nope"}, environ={})


@pytest.mark.parametrize("command", ["train", "worker", "demo"])
def test_persimmon_commands_take_the_sync_flags(command: str) -> None:
    args = build_parser().parse_args([command, "--sync", "ds_sync", "--sync-group-size", "4",
                                      "--sync-period", "2", "--sync-schedule", "permutation"])
    cfg = load_config(TrainerConfig, flags=flag_values(TrainerConfig, args), environ={})
    assert cfg.sync_config().params() == {"group_size": 4, "schedule": "permutation",
                                          "every": 2, "period": 8, "seed": 0}


def test_momentum_sgd_for_dmsgd_and_bad_momentum() -> None:
    from torch import nn

    from services.worker.dense_optimizers import make_optimizer

    config = TrainerConfig(dense_optimizer="sgd", momentum=0.9, lr=0.1, sync="gossip")
    optimizer = make_optimizer("sgd", nn.Linear(3, 1), config)
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ConfigError, match="momentum must be in"):
        TrainerConfig(dense_optimizer="sgd", momentum=1.0)
    with pytest.raises(ConfigError, match="momentum is a setting of dense_optimizer 'sgd'"):
        TrainerConfig(dense_optimizer="adam", momentum=0.9)
