"""The Trainer on the PS's own shards in this process (an injected rows client, no sockets):
the typed summary, bounded histories, sync-mode reproducibility, and clear errors."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from torch import nn

from services.common.errors import ConfigError
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.worker.compute import CPU_SWITCH_INTERVAL, compute_threads
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.embedding.rows import RowsClient
from services.worker.models import ModelConfig
from services.worker.summary import RECENT_LOSSES, FitSummary, LossCurve
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=3)
FEATURES = DATA.sparse_names


def shards() -> InProcessShards:
    return InProcessShards(ps_table_configs({f: 8 for f in FEATURES}), num_shards=2)


def trainer(rows: RowsClient, **settings: object) -> Trainer:
    return Trainer(model=ModelConfig(name="dlrm"), rows_client=rows, lr=3e-3, **settings)


async def test_sync_mode_on_in_process_shards_is_reproducible_and_typed() -> None:
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 10))
    runs = []
    for _ in range(2):  # fresh shards: identical initial rows
        rows = shards()
        async with trainer(rows, mode="sync", seed=7) as t:
            runs.append(await t.fit(batches))
        assert t.rows is rows
    summary = runs[0]
    assert isinstance(summary, FitSummary)
    assert summary.recent_losses == runs[1].recent_losses and len(summary.recent_losses) == 10
    assert summary.steps == 10 and summary.samples == 1280 and summary.mode == "sync"
    assert summary.staleness_max == 0 and summary.staleness_mean == 0.0
    assert summary.loss == pytest.approx(np.mean(summary.recent_losses))
    assert summary.wire_bytes == dict.fromkeys(("lookup_out", "lookup_in", "push_out",
                                                "push_in"), 0)  # nothing crossed a wire
    assert summary.codec_bytes == {}
    assert [step for step, _ in summary.loss_curve] == list(range(10))
    assert summary.eval_samples is None and summary.auc == summary.train_auc
    as_json = json.loads(json.dumps(summary.as_dict()))
    assert as_json["steps"] == 10 and as_json["loss_curve"][0][0] == 0
    assert "losses" not in as_json and set(summary.timing) >= {"step_wall_ms", "step_cpu_ms"}
    # where the steps went: each phase's mean (read_hot and apply_hot: every group's rows,
    # read and updated by the compute thread on this synchronous route)
    phases = as_json["step_phases"]
    assert list(phases) == ["read_hot", "pool", "forward", "backward", "dense_update",
                            "apply_hot"]
    assert all(phases[p]["cpu_ms"] > 0 for p in ("read_hot", "apply_hot"))
    assert sum(t["wall_ms"] for t in phases.values()) <= summary.step_wall_ms


async def test_hybrid_mode_pushes_every_step_and_evaluates() -> None:
    data = SyntheticDataset(DATA)
    rows = shards()
    async with trainer(rows, mode="hybrid", staleness=3, eval_every=5) as t:
        summary = await t.fit(data.batches(128, 128 * 10),
                              eval_batches=list(data.batches(512, 1024, split="test")))
    assert 0 <= summary.staleness_max <= 2 and summary.steps == 10
    assert [h["step"] for h in summary.history] == [5, 10]
    assert summary.eval_samples == 1024 and not math.isnan(summary.auc)
    pushed = sum(t.stats().rows for s in rows.shards for t in s.tables.values())
    assert pushed > 0  # the rows were created and trained on the shards themselves


def test_loss_curve_stays_bounded_and_keeps_the_mean() -> None:
    curve = LossCurve(points=8)
    losses = np.arange(1000, dtype=np.float64)
    for step, loss in enumerate(losses):
        curve.add(step, float(loss))
    points = curve.points()
    assert len(points) <= 8 and curve.span == 128
    assert points[0] == (0, pytest.approx(np.mean(losses[:128])))
    assert [s for s, _ in points] == list(range(0, 1000, 128))
    assert points[-1][1] == pytest.approx(np.mean(losses[896:]))
    with pytest.raises(ValueError, match="points"):
        LossCurve(points=1)


async def test_a_cpu_fit_lowers_the_gil_switch_interval_while_it_trains() -> None:
    """Between steps (on_step runs on the loop while the compute thread waits) the interval
    is the compute thread's; after the fit it is the one before."""
    before = sys.getswitchinterval()
    seen: list[float] = []
    async with trainer(shards(), mode="hybrid", staleness=2, device="cpu",
                       on_step=lambda info: seen.append(sys.getswitchinterval())) as t:
        await t.fit(SyntheticDataset(DATA).batches(128, 128 * 3))
    assert seen == [CPU_SWITCH_INTERVAL] * 3 and sys.getswitchinterval() == before
    assert TrainerConfig().gil_switch_ms / 1e3 == CPU_SWITCH_INTERVAL  # the default setting
    seen.clear()
    async with trainer(shards(), mode="hybrid", staleness=2, device="cpu", gil_switch_ms=0,
                       on_step=lambda info: seen.append(sys.getswitchinterval())) as t:
        await t.fit(SyntheticDataset(DATA).batches(128, 128 * 3))
    assert seen == [before] * 3  # 0: left as it is
    with pytest.raises(ConfigError, match="gil_switch_ms"):
        TrainerConfig(gil_switch_ms=-1)


class _ThreadsSeen(nn.Module):
    """A DLRM that notes torch's intra-op threads at each forward (in the compute thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ModelConfig(name="dlrm").build(sparse_dims=dict.fromkeys(FEATURES, 8),
                                                    num_dense=DATA.num_dense)
        self.threads: list[int] = []

    def forward(self, pooled: dict[str, torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        self.threads.append(torch.get_num_threads())
        return self.inner(pooled, dense)


async def test_a_cpu_fit_on_rows_in_this_process_leaves_a_core_to_them() -> None:
    """With the shards in the process, torch runs on one core fewer than the process has
    (at least one) in every thread of the fit: the warm-up pass before the first step, the
    compute thread's steps, and the loop's thread between steps, whose first torch op came
    long before the fit (a thread keeps the count of its first op unless set from it).
    ``torch_threads`` bounds the count instead; the count before comes back after the fit."""
    torch.ones(2).sum()  # this thread's torch started before the fit
    before = torch.get_num_threads()
    for settings, expected in (({}, min(before, compute_threads(True))),
                               ({"torch_threads": 1}, 1)):
        model, on_loop = _ThreadsSeen(), []
        async with Trainer(model=model, rows_client=shards(), mode="sync", lr=3e-3,
                           on_step=lambda info, seen=on_loop: seen.append(torch.get_num_threads()),
                           **settings) as t:
            await t.fit(SyntheticDataset(DATA).batches(128, 128 * 3))
        assert model.threads == [expected] * 4  # the warm-up pass, then 3 steps
        assert on_loop == [expected] * 3
        assert torch.get_num_threads() == before
    assert compute_threads(True, cores=8) == 7 and compute_threads(True, cores=1) == 1
    assert compute_threads(False, cores=8) is None  # the rows elsewhere: torch's own
    with pytest.raises(ConfigError, match="torch_threads"):
        TrainerConfig(torch_threads=-1)


async def test_recent_losses_are_bounded() -> None:
    async with trainer(shards(), mode="async") as t:
        t.recent_losses.extend([1.0] * (RECENT_LOSSES + 5))  # as after a long run
        assert len(t.recent_losses) == RECENT_LOSSES


def test_a_rows_client_with_ps_addresses_or_of_the_wrong_kind_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="not both"):
        Trainer(model="dlrm", rows_client=shards(), ps_addresses=["127.0.0.1:1"])
    with pytest.raises(ConfigError, match="not both"):
        Trainer(model="dlrm", rows_client=shards(), ps_process=True)
    with pytest.raises(ConfigError, match="RowsClient"):
        Trainer(model="dlrm", rows_client=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ps_addresses"):
        Trainer(model="dlrm")


async def test_unknown_tables_on_the_in_process_shards_are_a_clear_error() -> None:
    t = Trainer(model="dlrm", rows_client=shards(), tables={"C1": "missing"})
    with pytest.raises(ConfigError, match="do not exist"):
        await t.start()


def test_ps_table_configs_set_per_table_lr_weight_decay_and_accumulator() -> None:
    a, b = FEATURES[:2]
    rows = InProcessShards(ps_table_configs({a: 8, b: 8}, table_lr={a: 0.5},
                                            weight_decay=1e-5, initial_accumulator=0.01))
    optimizers = {t: rows.shards[0].table(t).config.optimizer for t in (a, b)}
    assert (optimizers[a].lr, optimizers[b].lr) == (0.5, 0.05)
    assert optimizers[a].weight_decay == optimizers[b].weight_decay == 1e-5
    assert optimizers[a].initial_accumulator == optimizers[b].initial_accumulator == 0.01
    with pytest.raises(ConfigError, match="not among"):
        ps_table_configs({a: 8}, table_lr={"nope": 0.1})


def test_train_flags_parse_per_table_lrs_and_refuse_bad_ones() -> None:
    import argparse

    from services.local.train import _table_lrs

    assert _table_lrs("user=0.1, movie=0.02") == {"user": 0.1, "movie": 0.02}
    for bad in ("user", "user=fast", "=0.1"):
        with pytest.raises(argparse.ArgumentTypeError, match="FEATURE=LR"):
            _table_lrs(bad)
