"""The Trainer's compression switches against real PS shard processes: DCT-MP activations,
1-bit optimizers (and their refusal of embeddings), and bad combinations."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import generate_latest
from torch import nn

from services.common.errors import ConfigError
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.local.processes import LocalPS
from services.ps.tables import OptimizerConfig
from services.worker.config import ps_table_configs
from services.worker.models import ModelConfig
from services.worker.sync import make_sync
from services.worker.trainer import Trainer

DATA = SyntheticConfig(seed=5)
FEATURES = DATA.sparse_names
PREFIXES = ("mp_", "ob_", "bad_", "ada_")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPS]:
    """Two PS shards, all but the first prefix's tables created once they are up
    (LocalPS.create_tables)."""
    first, *rest = [ps_table_configs({f: 8 for f in FEATURES}, prefix=p) for p in PREFIXES]
    with LocalPS(2, first) as ps:
        ps.create_tables([t for tables in rest for t in tables])
        yield ps


def trainer(cluster: LocalPS, prefix: str, model: nn.Module | ModelConfig | None = None,
            **settings: object) -> Trainer:
    return Trainer(model=model or ModelConfig(name="dlrm"), ps_addresses=cluster.addresses,
                   tables={f: prefix + f for f in FEATURES}, mode="sync", lr=3e-3, **settings)


async def test_dct_mp_thresholds_activations_and_still_learns(cluster: LocalPS) -> None:
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 16))
    async with trainer(cluster, "mp_", activation_keep=0.1) as t:
        summary = await t.fit(batches)
        before = [r for r in t.codec_rows() if r["stream"] == "activations"]
        held_out = await t.evaluate(batches[:4])  # as served: nothing thresholded or counted
        assert [r for r in t.codec_rows() if r["stream"] == "activations"] == before
    act = summary.activation_bytes
    width = 8 * len(FEATURES)
    assert act["steps"] == 16 and act["raw_bytes"] == 16 * 8 * 128 * width
    assert 5 <= act["ratio"] <= 20  # about 1 / keep: tau reused, refreshed when it drifts
    assert held_out["samples"] == 4 * 128
    losses = summary.recent_losses
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    scraped = generate_latest(t.progress.registry).decode()  # bytes exported per stream
    for stream, codec, direction in (("rows_down", "none", "received"),
                                     ("grads_up", "none", "sent"),
                                     ("activations", "dct_mp", "sent")):
        for kind in ("raw", "wire"):
            assert (f'persimmon_codec_bytes_total{{codec="{codec}",direction="{direction}",'
                    f'kind="{kind}",stream="{stream}"}}') in scraped


async def test_onebit_adam_trains_and_counts_its_bytes(cluster: LocalPS) -> None:
    batches = list(SyntheticDataset(DATA).batches(128, 128 * 16))
    async with trainer(cluster, "ob_", dense_optimizer="onebit_adam",
                       onebit_freeze_step=5) as t:
        summary = await t.fit(batches)
    dense = summary.dense_bytes
    assert dense["steps"] == 16 and dense["raw_bytes"] > dense["wire_bytes"] > 0
    losses = summary.recent_losses
    assert np.isfinite(losses).all() and np.mean(losses[-4:]) < np.mean(losses[:4])


class _WithEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 1)


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
async def test_onebit_optimizers_refuse_embedding_rows(cluster: LocalPS, name: str) -> None:
    batch = next(SyntheticDataset(DATA).batches(16, 16))
    async with trainer(cluster, "bad_", model=_WithEmbedding(), dense_optimizer=name) as t:
        with pytest.raises(ConfigError, match="zero variance"):
            await t.fit([batch])
    with pytest.raises(ConfigError, match="zeros"):  # nor as a PS table's optimizer
        OptimizerConfig(kind=name)


def test_bad_compression_combinations_are_config_errors(cluster: LocalPS) -> None:
    with pytest.raises(ConfigError, match="compresses its own all-reduce"):
        trainer(cluster, "bad_", dense_optimizer="onebit_adam", dense_codec="fp16")
    with pytest.raises(ConfigError, match="do not pass a sync"):
        trainer(cluster, "bad_", sync=make_sync("allreduce"), dense_codec="dct")
    with pytest.raises(ConfigError, match="dense_codec"):
        trainer(cluster, "bad_", dense_codec="gzip")
    with pytest.raises(ConfigError, match="activation_keep"):
        trainer(cluster, "bad_", activation_keep=0.0)


async def test_grads_adaquant_through_the_child_process_rises_from_s0(cluster: LocalPS) -> None:
    """The PS push path's adaquant, fed the mean loss through the PS client's child process:
    s starts at s0 = 2 and rises as the loss falls; every push is adaquant-coded."""
    steps = 24
    batches = list(SyntheticDataset(DATA).batches(128, 128 * steps))
    async with trainer(cluster, "ada_", ps_process=True,
                       grads_codec="adaquant:s0=2,window=4") as t:
        summary = await t.fit(batches)
    levels = list(t.adaquant_levels["grads"])
    assert len(levels) == steps and levels[0] == 2
    assert levels[-1] > 2, levels                         # more levels as the loss fell
    assert np.mean(summary.recent_losses[-4:]) < np.mean(summary.recent_losses[:4])
    sent = summary.codec_bytes["grads_up"]["adaquant"]["sent"]
    assert sent["arrays"] == 2 * steps and sent["wire_bytes"] < sent["raw_bytes"] / 4
