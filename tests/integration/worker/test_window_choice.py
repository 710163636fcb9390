"""``staleness auto``: no window (S = 1) with the shards in the worker's process, a window
behind a real network round trip (a gRPC shard behind a user-space latency proxy), and a
number given for the staleness still pins it."""

from __future__ import annotations

import pytest

from bench.netem import LatencyProxy
from clients.ps_client import PSClient
from services.common.config import from_dict
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.ps.tables import TableConfig
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.embedding import window
from services.worker.embedding.window import MAX_AUTO_WINDOW, auto_window, choose_window
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer
from tests.integration.worker.conftest import running_shards

DATA = SyntheticConfig(seed=2)
TABLES = ps_table_configs({f: 8 for f in DATA.sparse_names})


def test_the_window_grows_with_the_round_trip_and_is_bounded() -> None:
    windows = [auto_window(ms) for ms in (0.0, 0.01, 0.3, 1.0, 4.0, 9.0, 50.0, 1e6)]
    assert windows[:2] == [1, 1]  # no round trip: nothing to hide, no staleness
    assert all(w >= 2 for w in windows[2:])
    assert windows == sorted(windows) and windows[-1] == MAX_AUTO_WINDOW
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="round_trip_ms"):
            auto_window(bad)


def test_auto_is_the_default_and_a_number_pins_the_window() -> None:
    assert TrainerConfig().auto_window
    assert TrainerConfig(staleness="4").window == 4  # a flag's string
    assert not TrainerConfig(staleness=4).auto_window
    assert not TrainerConfig(mode="sync").auto_window
    for bad in ("often", -1, True):
        with pytest.raises(Exception, match="staleness must be 'auto' or an int"):
            TrainerConfig(staleness=bad)


async def test_embedded_shards_get_no_window() -> None:
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 6))
    async with Trainer(model=ModelConfig(name="dlrm"), rows_client=InProcessShards(TABLES),
                       lr=3e-3) as trainer:
        summary = await trainer.fit(batches)
    assert summary.staleness == 1 and summary.staleness_max == 0
    assert summary.window_choice is not None and summary.window_choice["window"] == 1
    assert "in this process" in summary.window_choice["reason"]


async def test_a_round_trip_to_hide_gets_a_window() -> None:
    tables = [from_dict(TableConfig, t, where="table") for t in TABLES]
    async with running_shards(tables, 1) as (shard,):
        with LatencyProxy([shard.address], rtt_ms=6.0) as proxy:
            async with PSClient(proxy.addresses) as rows:
                choice = await choose_window(rows)
                assert choice.round_trip_ms >= 5.0 and choice.window >= 2
                batches = list(SyntheticDataset(DATA).batches(128, 128 * 8))
                async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows,
                                   lr=3e-3) as trainer:
                    summary = await trainer.fit(batches)
                assert summary.staleness == summary.window_choice["window"] >= 2
                assert 0 < summary.staleness_max < summary.staleness


async def test_a_running_job_measures_its_window_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every few steps (here 4) the job times its own lookups through the proxy against its
    steps' compute, and the summary and the live figures carry each measurement."""
    monkeypatch.setattr(window, "RETUNE_STEPS", 4)
    tables = [from_dict(TableConfig, t, where="table") for t in TABLES]
    async with running_shards(tables, 1) as (shard,):
        with LatencyProxy([shard.address], rtt_ms=6.0) as proxy:
            async with PSClient(proxy.addresses) as rows:
                batches = list(SyntheticDataset(DATA).batches(128, 128 * 14))
                async with Trainer(model=ModelConfig(name="dlrm"), rows_client=rows,
                                   lr=3e-3) as trainer:
                    summary = await trainer.fit(batches)
                    live = trainer.progress.as_dict()["window"]
    remeasured = summary.window_choice["remeasured"]
    steps = [m["step"] for m in remeasured]  # (a step with no lookup timed since is passed)
    assert steps[:2] == [4, 8] and all(step % 4 == 0 for step in steps)
    for m in remeasured:  # a batch's lookup crosses the proxy: at least its round trip
        assert m["round_trip_ms"] >= 5.0 and m["step_ms"] > 0
        assert m["window"] >= 2  # a 6 ms trip hides behind at least one step in flight
    assert live == remeasured[-1]
    assert summary.staleness == remeasured[-1]["window"]
    assert summary.staleness_max < max([summary.window_choice["window"],
                                        *(m["window"] for m in remeasured)])
