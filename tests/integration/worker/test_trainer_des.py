"""``embedding_path="des"``: the shards pool, the Trainer trains as on the rows path.

Two real PS shards on port 0 in the test's loop; each run gets its own tables (a name prefix)
with identical initial rows. In sync mode one worker's DES run and rows run see the same rows
at every step, so they must agree up to float rounding: the shards add partial sums in another
order than the worker's pooling kernel (float32, about 1e-7 relative per sum), which 12 Adam
and Adagrad steps cannot blow up past 1e-4. A wrong DES (mean divided twice, a feature's
gradient pushed to the wrong samples or not at all, features swapped) moves the losses by
far more than that from the first step on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

from clients.ps_process import PSClientProcess
from services.common.errors import ConfigError
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.inprocess import InProcessShards
from services.ps.service import PSService
from services.ps.tables import OptimizerConfig, TableConfig
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer
from tests.integration.worker.conftest import running_shards

# multi-hot features (2 of 5, up to 8 ids a sample) and vocabularies that spread over shards
DATA = SyntheticConfig(seed=5, vocab_sizes=[50, 200, 1000, 400, 300], num_multi_hot=2,
                       mean_multi_hot_length=4.0, zipf_exponent=1.2)
FEATURES = DATA.sparse_names
PREFIXES = ("rs_", "ds_", "rm_", "dm_", "dh_", "dc_", "pa_", "pb_")
MODEL = ModelConfig(name="dlrm", bottom_mlp=[16, 8], top_mlp=[16])


def _tables(prefixes: tuple[str, ...]) -> list[TableConfig]:
    return [TableConfig(name=t["name"], dim=8, seed=0,
                        optimizer=OptimizerConfig(kind="adagrad", lr=0.1))
            for p in prefixes for t in ps_table_configs({f: 8 for f in FEATURES}, prefix=p)]


@pytest.fixture
async def shards() -> AsyncIterator[list[PSService]]:
    """Started with one prefix's tables, the others created once they are up (a request of
    all 40 would compile for seconds where numba's cache is cold; a Trainer sends 5)."""
    async with running_shards(_tables(PREFIXES[:1]),
                              created_later=_tables(PREFIXES[1:])) as services:
        yield services


@pytest.fixture(scope="module")
def data() -> SyntheticDataset:
    return SyntheticDataset(DATA)


def _trainer(shards: list[PSService], prefix: str, **settings: object) -> Trainer:
    return Trainer(model=MODEL, ps_addresses=[s.address for s in shards],
                   tables={f: prefix + f for f in FEATURES}, lr=1e-2, seed=3, **settings)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
async def test_des_trains_as_the_rows_path_in_sync_mode(shards, data, pooling) -> None:
    train, test = list(data.batches(128, 128 * 12)), list(data.batches(512, 1024, "test"))
    runs = {}
    for path, prefix in (("rows", "rs_" if pooling == "sum" else "rm_"),
                         ("des", "ds_" if pooling == "sum" else "dm_")):
        async with _trainer(shards, prefix, mode="sync", pooling=pooling,
                            embedding_path=path) as t:
            summary = await t.fit(train, eval_batches=test)
            ids = np.unique(np.concatenate([b.sparse[FEATURES[-1]].values for b in train]))
            rows = await t.ps.lookup(prefix + FEATURES[-1], ids)  # a multi-hot feature's rows
            weights = torch.cat([p.detach().flatten() for p in t.module.parameters()])
            runs[path] = summary, rows, weights, t.ps.wire_bytes()
    (rows_run, rows_rows, rows_w, rows_bytes), (des_run, des_rows, des_w, des_bytes) = \
        runs["rows"], runs["des"]
    assert des_run.steps == rows_run.steps == 12 and des_run.staleness_max == 0
    np.testing.assert_allclose(des_run.recent_losses, rows_run.recent_losses, rtol=1e-4)
    assert len(set(rows_run.recent_losses)) > 1  # it trains: the losses move
    # the two paths sum a row's gradient in different orders (float32): Adagrad's scale-free
    # first steps make a near-zero gradient's round-off visible (4e-4 relative seen on an
    # AVX-512 machine); a wrong DES (a pooling or a spreading mistake) is off by far more
    np.testing.assert_allclose(des_rows, rows_rows, rtol=1e-3, atol=1e-6)
    assert not np.allclose(rows_rows, des_rows[::-1])  # the rows did move apart per id
    torch.testing.assert_close(des_w, rows_w, rtol=1e-4, atol=1e-6)
    assert abs(des_run.auc - rows_run.auc) < 1e-4
    # the DES messages went out: bytes on the pooled streams, none on the rows streams
    assert des_run.codec_bytes.get("pooled_down") and not des_run.codec_bytes.get("rows_down")
    up = des_run.codec_bytes["pooled_grads_up"]["none"]["sent"]
    assert up["wire_bytes"] == up["raw_bytes"] > 0  # float32 gradients, also after a mean
    assert des_bytes != rows_bytes


async def test_des_in_hybrid_mode_keeps_the_bound_and_the_hot_tables(shards, data) -> None:
    """Hybrid's slots, riders and hot chain carry pooled requests: the staleness bound holds,
    the hot tables are chosen and every table trains (the loss falls)."""
    train = list(data.batches(128, 128 * 24))
    async with _trainer(shards, "dh_", mode="hybrid", staleness=3, hot_ratio=0.5,
                        embedding_path="des") as t:
        summary = await t.fit(train)
    assert summary.steps == 24 and 0 < summary.staleness_max <= 2
    assert 0 < len(summary.hot_tables) < len(FEATURES)  # the chain and the slots both serve
    assert np.mean(summary.recent_losses[-6:]) < np.mean(summary.recent_losses[:6])


async def test_des_refuses_a_rows_client_without_pooled_calls(data) -> None:
    embedded = InProcessShards(
        [TableConfig(name=f, dim=8) for f in FEATURES], num_shards=2)
    trainer = Trainer(model=MODEL, rows_client=embedded, embedding_path="des", mode="sync")
    with pytest.raises(ConfigError, match="embedding_path 'des' needs a rows client"):
        await trainer.fit(list(data.batches(64, 128)))


async def test_des_through_the_ps_client_process_trains_exactly_as_in_process(
        shards, data) -> None:
    """``ps_process`` serves the pooled calls too (mean pooling's mode crosses to the child):
    the same losses, bit for bit, and the same messages."""
    train = list(data.batches(128, 128 * 4))
    runs = {}
    for prefix, ps_process in (("pa_", False), ("pb_", True)):
        async with _trainer(shards, prefix, mode="sync", pooling="mean", embedding_path="des",
                            ps_process=ps_process) as t:
            summary = await t.fit(train)
            assert isinstance(t.rows, PSClientProcess) == ps_process
        runs[ps_process] = summary
    assert runs[True].recent_losses == runs[False].recent_losses
    assert runs[True].wire_bytes == runs[False].wire_bytes


async def test_dct_mp_on_the_des_wire_keeps_its_density_and_reuses_its_threshold(
        shards, data) -> None:
    """DCT-MP on DES's wire: the shards send the partial sums and the worker the pooled
    gradients as index+value pairs (int32 + fp16: 6 bytes a kept entry against 4 dense) at a
    kept density within [keep/2, 2·keep], with τ recomputed far less often than once a
    message (the paper's threshold reuse, not a top-k per step): every 8 steps per table,
    and when a step's density drifts out of [keep/2, 2·keep] (here about a quarter of the
    messages, as the rows grow from their tiny initial values)."""
    codec = "dct:keep=0.25,refresh=8"
    train = list(data.batches(128, 128 * 16))
    async with _trainer(shards, "dc_", mode="sync", embedding_path="des",
                        rows_codec=codec + ",error_feedback=false", grads_codec=codec) as t:
        summary = await t.fit(train)
        assert t.ps is not None
        grads_codecs = t.ps.grads_codecs()  # DES pushes pooled gradients only
    for stream, direction in (("pooled_down", "received"), ("pooled_grads_up", "sent")):
        stats = summary.codec_bytes[stream]["dct"][direction]
        density = (stats["wire_bytes"] / 6) / (stats["raw_bytes"] / 4)
        assert 0.125 <= density <= 0.5, (stream, density)
    messages = sum(c.stats.arrays for c in grads_codecs)
    refreshes = sum(c.refreshes for c in grads_codecs)
    assert messages == 16 * len(FEATURES) * 2 and 0 < refreshes <= messages / 2
    assert np.mean(summary.recent_losses[-4:]) < np.mean(summary.recent_losses[:4])


def test_des_refuses_error_feedback_on_the_partial_sums() -> None:
    with pytest.raises(ConfigError, match="error_feedback=false"):
        TrainerConfig(embedding_path="des", rows_codec="dct:keep=0.25")
    TrainerConfig(embedding_path="des", rows_codec="dct:keep=0.25,error_feedback=false")


def test_persimmon_train_runs_des_against_shard_processes() -> None:
    from services.local.train import ps_placement

    des = TrainerConfig(embedding_path="des")
    assert ps_placement("auto", 1, TrainerConfig()) == "embedded"
    assert ps_placement("auto", 1, des) == "processes"
    with pytest.raises(ConfigError, match="embedding_path=des"):
        ps_placement("embedded", 1, des)
