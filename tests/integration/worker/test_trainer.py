"""The Trainer against two real PS shard processes, on planted synthetic data in memory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from clients.ps_process import PSClientProcess
from services.common.batch import Batch
from services.common.errors import ConfigError, InvalidArgument
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.local.processes import LocalPS
from services.worker.config import ps_table_configs
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=3)
FEATURES = DATA.sparse_names
PREFIXES = ("sa_", "sb_", "pa_", "pb_", "hy_", "as_", "le_", "bad_", "ln_")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPS]:
    """Two PS shards; each test trains on its own fresh tables (a name prefix each), all but
    the first prefix's created once the shards are up (LocalPS.create_tables)."""
    first, *rest = [ps_table_configs({f: 16 for f in FEATURES}, prefix=p) for p in PREFIXES]
    with LocalPS(2, first) as ps:
        ps.create_tables([t for tables in rest for t in tables])
        yield ps


@pytest.fixture(scope="module")
def data() -> SyntheticDataset:
    return SyntheticDataset(DATA)


def tables_of(prefix: str) -> dict[str, str]:
    return {f: prefix + f for f in FEATURES}


def trainer(cluster: LocalPS, prefix: str, **settings: object) -> Trainer:
    return Trainer(model=ModelConfig(name="dlrm"), ps_addresses=cluster.addresses,
                   tables=tables_of(prefix), lr=3e-3, **settings)


async def test_sync_mode_is_bit_reproducible(cluster: LocalPS, data: SyntheticDataset) -> None:
    batches = list(data.batches(256, 256 * 12))
    losses = []
    for prefix in ("sa_", "sb_"):  # two fresh sets of tables with identical initial rows
        async with trainer(cluster, prefix, mode="sync", seed=7) as t:
            summary = await t.fit(batches)
        assert summary.steps == 12 and summary.staleness_max == 0
        assert list(t.recent_losses) == summary.recent_losses
        losses.append(summary.recent_losses)
    assert losses[0] == losses[1]
    assert all(np.isfinite(losses[0])) and len(set(losses[0])) > 1
    assert np.mean(losses[0][-4:]) < np.mean(losses[0][:4])  # it learns


async def test_ps_client_process_trains_exactly_as_in_process(cluster: LocalPS,
                                                              data: SyntheticDataset) -> None:
    """ps_process moves the steps' PS traffic into a child process and changes nothing else:
    sync mode gives the same losses bit for bit, and the summary counts the child's bytes."""
    batches = list(data.batches(256, 256 * 8))
    runs = {}
    for prefix, ps_process in (("pa_", False), ("pb_", True)):
        async with trainer(cluster, prefix, mode="sync", seed=7, ps_process=ps_process) as t:
            runs[ps_process] = (await t.fit(batches), list(t.recent_losses))
            assert isinstance(t.rows, PSClientProcess) == ps_process
            assert t.rows.dims[prefix + FEATURES[0]] == 16  # the child reports the tables
    assert runs[True][1] == runs[False][1] and len(runs[True][1]) == 8
    summary = runs[True][0]
    assert summary.wire_bytes == runs[False][0].wire_bytes  # the same messages
    assert summary.codec_bytes == runs[False][0].codec_bytes
    assert summary.worker_cpu_ms_per_step > 0


async def test_ps_client_process_gives_the_hot_chain_a_lane_of_its_own(
        cluster: LocalPS, data: SyntheticDataset) -> None:
    """With ps_process the head ids' push-then-lookup chain, which every step waits for,
    goes through the worker's own PS client, not behind the bulk traffic of the child; the
    summary counts the bytes of both."""
    async with trainer(cluster, "ln_", mode="hybrid", staleness=4, ps_process=True,
                       seed=7) as t:
        summary = await t.fit(data.batches(256, 256 * 24))
        lane, child = t.ps, t.rows
        assert isinstance(child, PSClientProcess) and lane is not None
        assert t.pipeline.head_count() > 0 and t.pipeline.clients() == [child, lane]
        lane_bytes, child_bytes = lane.wire_bytes(), child.wire_bytes()
    assert lane_bytes["push_out"] > 0 and lane_bytes["push_in"] > 0  # the chain's messages
    assert child_bytes["lookup_out"] > 0 and child_bytes["push_out"] > 0  # the rest
    assert summary.wire_bytes == {k: lane_bytes[k] + child_bytes[k] for k in lane_bytes}
    assert summary.steps == 24 and np.isfinite(summary.recent_losses).all()


async def test_hybrid_staleness_never_exceeds_bound(cluster: LocalPS,
                                                    data: SyntheticDataset) -> None:
    s = 2
    # hot_ratio 0, head_rate 0: every row under the window (the planted tables are all hot)
    async with trainer(cluster, "hy_", mode="hybrid", staleness=s, admin_port=0,
                       hot_ratio=0.0, head_rate=0.0) as t:
        summary = await t.fit(data.batches(128, 128 * 40))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{t.admin_port}") as http:
            progress = (await http.get("/v1/progress")).json()
            metrics = (await http.get("/metrics")).text
    assert progress["step"] == 40 and progress["samples"] == 40 * 128
    assert progress["state"] == "done" and progress["staleness_max"] == summary.staleness_max
    assert progress["loss"] == pytest.approx(np.mean(summary.recent_losses[-40:]))
    assert "persimmon_worker_samples_total 5120.0" in metrics
    assert "persimmon_worker_lookup_seconds_count 40.0" in metrics
    assert "persimmon_worker_push_seconds_count 40.0" in metrics
    assert summary.steps == 40 and len(summary.recent_losses) == 40
    assert summary.staleness_max <= s - 1  # S slots: at most S - 1 pushes in flight
    assert summary.staleness_max >= 1  # lookups really ran ahead of pushes (pipelining)
    assert set(summary.wire_bytes) == {"lookup_out", "lookup_in", "push_out", "push_in"}
    assert all(n > 0 for n in summary.wire_bytes.values())


async def test_async_mode_runs_ahead_unbounded_by_staleness(cluster: LocalPS,
                                                            data: SyntheticDataset) -> None:
    async with trainer(cluster, "as_", mode="async", staleness=1, prefetch=6) as t:
        summary = await t.fit(data.batches(128, 128 * 30), steps=20)
    assert summary.steps == 20 and summary.mode == "async"
    assert summary.staleness_max >= 1  # staleness=1 would force 0 in hybrid mode


async def test_hybrid_training_beats_chance_on_test_split(cluster: LocalPS,
                                                          data: SyntheticDataset) -> None:
    train = list(data.batches(256, 20_000))
    test = list(data.batches(2048, 8192, split="test"))
    async with trainer(cluster, "le_", mode="hybrid", staleness=4, eval_every=40) as t:
        summary = await t.fit(train, eval_batches=test)
    oracle = data.oracle(8192)["auc"]
    assert summary.eval_samples == 8192 and summary.steps == len(train)
    assert 0.72 < summary.auc <= oracle + 0.01, (summary.auc, oracle)
    assert summary.logloss < 0.56  # the constant predictor's logloss is ~0.58
    assert [h["step"] for h in t.history] == [40, 79] == [h["step"] for h in summary.history]
    assert summary.samples_per_s > 0 and summary.staleness_max <= 3  # S - 1
    # no hot tables by default: the planted tables' frequent ids are head ids instead
    assert summary.hot_tables == [] and summary.head_ids > 0


async def test_bad_settings_and_inputs_are_clear_errors(cluster: LocalPS,
                                                        data: SyntheticDataset) -> None:
    with pytest.raises(ConfigError, match="mode"):
        trainer(cluster, "bad_", mode="bulk")
    with pytest.raises(ConfigError, match="staleness"):
        trainer(cluster, "bad_", staleness=-1)
    with pytest.raises(ConfigError, match="rows_codec"):
        trainer(cluster, "bad_", rows_codec="nope")
    batch = next(data.batches(64, 64))
    t = Trainer(model="dlrm", ps_addresses=cluster.addresses,
                tables={f: "missing_" + f for f in FEATURES})
    with pytest.raises(ConfigError, match="do not exist"):
        await t.fit([batch])
    await t.close()
    partial = Batch(batch_id=0, labels=batch.labels, dense=batch.dense,
                    sparse={FEATURES[0]: batch.sparse[FEATURES[0]]})
    async with trainer(cluster, "bad_") as t:
        with pytest.raises(InvalidArgument, match="lacks sparse features"):
            await t.fit([partial])
        assert t.step == 0 and not t.recent_losses
        stats = await t.ps.stats("bad_C1")
        assert sum(s.tables["bad_C1"].rows for s in stats) == 0  # nothing was pushed


class _FailsAtThirdStep(torch.nn.Module):
    """A model whose forward raises at its third call in training (the kernels' warm-up
    before the first step calls it in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.calls = 0

    def forward(self, pooled: dict, dense: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if self.calls == 3:
            raise RuntimeError("forward failed at step 3")
        return self.linear(dense).squeeze(-1) + sum(p.sum(-1) for p in pooled.values())


@pytest.mark.parametrize("mode", ["hybrid", "sync"])
async def test_an_error_in_a_training_step_ends_fit_with_that_error(
        cluster: LocalPS, data: SyntheticDataset, mode: str) -> None:
    batches = list(data.batches(64, 64 * 8))
    t = Trainer(model=_FailsAtThirdStep(), ps_addresses=cluster.addresses,
                tables=tables_of("bad_"), mode=mode)
    async with t:
        with pytest.raises(RuntimeError, match="forward failed at step 3"):
            await asyncio.wait_for(t.fit(batches), 60)  # raised, never a hang
    assert t.step == 2 and len(t.recent_losses) == 2


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
async def test_waiting_batches_ride_on_the_push_that_frees_their_slot(
        cluster: LocalPS, data: SyntheticDataset, mode: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch waiting for a staleness slot is looked up in the same messages as the push
    that frees it: one message per shard for such a step, not two (sync mode: every step
    after the first; hybrid: whenever the window is full when its plan is ready)."""
    calls = {"lookup": 0, "ride": 0}
    async with trainer(cluster, "le_", mode=mode, staleness=2,
                       head_rate=0.0) as t:  # every row windowed
        rows = t.rows  # the rows client start() connected, which the steps call
        lookup, ride = rows.lookup_sharded, rows.push_then_lookup

        async def counted_lookup(*args: object) -> np.ndarray:
            calls["lookup"] += 1
            return await lookup(*args)  # type: ignore[arg-type]

        async def counted_ride(*args: object) -> object:
            calls["ride"] += 1
            return await ride(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(rows, "lookup_sharded", counted_lookup)
        monkeypatch.setattr(rows, "push_then_lookup", counted_ride)
        summary = await t.fit(data.batches(128, 128 * 20))
    assert summary.steps == 20 and summary.staleness_max <= (0 if mode == "sync" else 1)
    assert calls["lookup"] + calls["ride"] == 20
    assert calls["ride"] >= (19 if mode == "sync" else 1)
