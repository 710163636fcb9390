"""DCT-MP on DES's wire (``embedding_path="des"``, ``activation_keep < 1``): the shards
threshold the partial sums they send (``dct_mp``), the gradients go back at the same
positions, τ is reused across lookups, and evaluation is not thresholded.

Two real PS shards on port 0 in the test's loop. Wrong implementations caught: the gradient
thresholded on its own magnitudes (other positions than the forward's: the rows' update
differs from the one written out), τ recomputed on every lookup (every message would keep
exactly ``ceil(keep·n)`` entries), the thresholding applied at evaluation (its AUC and
log-loss would differ from the unthresholded trainer's on the same rows and weights).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.codecs.sparse import kept_count
from services.common.errors import ConfigError
from services.common.sharding import shard_of
from services.loader.planted import SyntheticConfig, SyntheticDataset
from services.ps.service import PSService
from services.ps.tables import OptimizerConfig, OptimizerKind, TableConfig
from services.worker.config import TrainerConfig, ps_table_configs
from services.worker.models import ModelConfig
from services.worker.trainer import Trainer
from tests.integration.worker.conftest import running_shards

DATA = SyntheticConfig(seed=5, vocab_sizes=[50, 200, 1000, 400, 300], num_multi_hot=2,
                       mean_multi_hot_length=4.0, zipf_exponent=1.2)
FEATURES = DATA.sparse_names
MODEL = ModelConfig(name="dlrm", bottom_mlp=[16, 8], top_mlp=[16])
DIM = 8


def _tables(prefixes: tuple[str, ...]) -> list[TableConfig]:
    return [TableConfig(name=t["name"], dim=DIM, seed=0,
                        optimizer=OptimizerConfig(kind="adagrad", lr=0.1))
            for p in prefixes for t in ps_table_configs({f: DIM for f in FEATURES}, prefix=p)]


@pytest.fixture
async def shards() -> AsyncIterator[list[PSService]]:
    """Started with one prefix's tables (a Trainer's request), the rest created once they
    are up (LocalPS.create_tables says why)."""
    sgd = [TableConfig(name=name, dim=DIM, seed=0,
                       optimizer=OptimizerConfig(kind=OptimizerKind.SGD, lr=1.0))
           for name in ("sgd_a", "sgd_b")]
    async with running_shards(_tables(("ek_",)),
                              created_later=sgd + _tables(("ef_", "tr_"))) as services:
        yield services


def _bags(seed: int, samples: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, size=samples)
    return rng.integers(0, 500, size=int(lengths.sum())).astype(np.uint64), lengths


async def test_the_gradient_goes_back_at_the_positions_the_forward_kept(shards) -> None:
    """SGD with lr 1 on the PS: each row moves by minus the sum, over the samples holding
    it, of the gradient at the positions its shard's partial sum kept (fp16)."""
    ids, lengths = _bags(0)
    async with PSClient([s.address for s in shards]) as ps:
        before = await ps.lookup("sgd_a", np.unique(ids))
        pooled, masks = await ps.pooled_lookup_masked("sgd_a", ids, lengths, keep=0.25)
        grads = np.random.default_rng(1).normal(size=pooled.shape).astype(np.float32)
        await ps.pooled_push("sgd_a", ids, lengths, grads, masks=masks)
        after = await ps.lookup("sgd_a", np.unique(ids))
    sample = np.repeat(np.arange(lengths.size), lengths)
    owner = shard_of(ids, 2)
    expected = before.copy()
    at = {int(i): k for k, i in enumerate(np.unique(ids))}
    held_masks = [m for m in masks]
    for part, k in enumerate(sorted(set(owner.tolist()))):
        mine = owner == k
        held = np.flatnonzero(np.bincount(sample[mine], minlength=lengths.size))
        full = np.zeros(pooled.shape, dtype=bool)
        full[held] = held_masks[part]
        g16 = np.where(full, grads.astype(np.float16).astype(np.float32), 0)
        for i, b in zip(ids[mine], sample[mine], strict=True):
            expected[at[int(i)]] -= g16[b]
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    kept = sum(int(m.sum()) for m in held_masks)
    assert 0 < kept < sum(m.size for m in held_masks)  # it did threshold


async def test_tau_is_reused_across_lookups_not_recomputed_per_message(shards) -> None:
    """With τ reused for 32 lookups, a message's kept count follows its own data; with a
    quantile per message every one would keep exactly ceil(keep·n)."""
    exact, counts = [], []
    async with PSClient([s.address for s in shards]) as ps:
        for step in range(6):
            ids, lengths = _bags(10 + step)
            _, masks = await ps.pooled_lookup_masked("sgd_b", ids, lengths, keep=0.25)
            for m in masks:
                counts.append(int(m.sum()))
                exact.append(kept_count(0.25, m.size))
    assert counts[:2] == exact[:2]  # the first lookup computed τ on each shard
    assert counts != exact
    assert all(e / 2 <= c <= 2 * e for c, e in zip(counts, exact, strict=True))


def _trainer(shards: list[PSService], prefix: str, **settings: object) -> Trainer:
    return Trainer(model=MODEL, ps_addresses=[s.address for s in shards],
                   tables={f: prefix + f for f in FEATURES}, lr=1e-2, seed=3, mode="sync",
                   embedding_path="des", **settings)


async def test_evaluation_is_not_thresholded_and_training_is(shards) -> None:
    data = SyntheticDataset(DATA)
    test = list(data.batches(256, 512, "test"))
    results = {}
    for prefix, keep in (("ek_", 0.25), ("ef_", 1.0)):  # identical rows and dense weights
        async with _trainer(shards, prefix, activation_keep=keep) as t:
            results[keep] = await t.evaluate(test)
    assert results[0.25] == results[1.0]
    async with _trainer(shards, "tr_", activation_keep=0.25) as t:
        summary = await t.fit(list(data.batches(128, 128 * 4)))
    for stream, direction in (("pooled_down", "received"), ("pooled_grads_up", "sent")):
        stats = summary.codec_bytes[stream]["dct_mp"][direction]
        assert 0 < stats["wire_bytes"] < stats["raw_bytes"] / 3, (stream, stats)
    assert not summary.activation_bytes  # no second thresholding in the trainer


def test_dct_mp_on_des_refuses_a_codec_of_its_own() -> None:
    with pytest.raises(ConfigError, match="grads_codec must be 'none'"):
        TrainerConfig(embedding_path="des", activation_keep=0.25, grads_codec="fp16")
    with pytest.raises(ConfigError, match="rows_codec and grads_codec"):
        TrainerConfig(embedding_path="des", activation_keep=0.25, rows_codec="fp16")
    TrainerConfig(embedding_path="rows", activation_keep=0.25, grads_codec="fp16")
