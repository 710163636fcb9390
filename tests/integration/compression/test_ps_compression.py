"""Compression on the PS paths over real gRPC: per-id error feedback, gradients decoded on the
PS, and DES-style server-side partial pooling against the plain lookup+pool path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.ps_client import PSClient
from services.common.codecs import raw_array
from services.common.errors import InvalidArgument
from services.common.messages import (
    PooledLookupReply,
    PooledLookupRequest,
    PooledPushReply,
    PooledPushRequest,
)
from services.common.sharding import shard_of
from services.worker.pooling import plan_batch, pool_batch
from tests.integration.ps.conftest import digest, shard_stream, start_cluster

SGD_LR = 0.5  # table "item" of tests/integration/ps/conftest.py: SGD, lr 0.5, dim 4


@pytest.fixture
async def cluster():
    services = await start_cluster(2)
    yield services
    for s in services:
        await s.close()


def _addresses(services) -> list[str]:
    return [s.address for s in services]


@pytest.mark.parametrize("codec", ["topk", "dct", "uniform:bits=2,error_feedback=true"])
async def test_grads_residual_kept_per_id_through_the_ps(cluster, codec):
    """SGD applies exactly what was sent: per id, Σ applied = lr·(Σ pushed − residual)."""
    rng = np.random.default_rng(0)
    universe = np.arange(200, dtype=np.uint64)
    pushed = np.zeros((200, 4))
    async with PSClient(_addresses(cluster), grads_codec=codec) as ps:
        before = await ps.lookup("item", universe)
        for _ in range(12):
            ids = np.sort(rng.choice(200, size=80, replace=False)).astype(np.uint64)
            grads = rng.standard_normal((80, 4)).astype(np.float32)
            await ps.push_unique("item", ids, grads)
            pushed[ids.astype(np.int64)] += grads
        after = await ps.lookup("item", universe)
        residual = ps.grads_residual("item", universe)
        sent_bytes = ps.wire_bytes()["push_out"]
    np.testing.assert_allclose(before - after, SGD_LR * (pushed - residual), atol=2e-3)
    assert np.abs(residual).sum() > 0.1 * np.abs(pushed).sum()  # most was held back
    assert sent_bytes < 12 * 80 * 4 * 4  # and the pushes were smaller than fp32 grads


def _check_quantized(applied: np.ndarray, grads: np.ndarray, ids: np.ndarray, levels: int
                     ) -> np.ndarray:
    """Assert the applied step is a decoded QSGD value with s = ``levels`` (each shard's push
    is one bucket, fewer than 256 elements); return the levels l of every element."""
    steps = np.zeros_like(applied)
    for k in range(2):
        mine = shard_of(ids, 2) == k
        norm = np.linalg.norm(grads[mine])
        steps[mine] = applied[mine] / (norm / levels)
        np.testing.assert_allclose(steps[mine], np.round(steps[mine]), atol=1e-3)
        assert np.abs(steps[mine]).max() <= levels + 1e-3
        assert np.all(np.abs(applied[mine] - grads[mine]) <= norm / levels * (1 + 1e-4))
    assert not np.allclose(applied, grads, atol=1e-3)  # quantized, not raw
    return np.abs(np.round(steps)).astype(int)


async def test_quantized_grads_are_decoded_on_the_ps_before_its_optimizer(cluster):
    """The applied SGD step is a decoded QSGD value: sign·l·‖bucket‖/s with integer l ≤ s."""
    ids = np.arange(64, dtype=np.uint64)
    grads = np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32)
    async with PSClient(_addresses(cluster), grads_codec="qsgd") as ps:
        before = await ps.lookup("item", ids)
        await ps.push_unique("item", ids, grads)
        applied = (before - await ps.lookup("item", ids)) / SGD_LR
    _check_quantized(applied, grads, ids, 15)


async def test_adaquant_pushes_use_more_levels_as_the_reported_loss_falls(cluster):
    """s = ceil(sqrt(F_0/F_k)·s_0), F_0 the first loss (f0_steps=1): 2, 4, 8 as the loss falls
    1 → 1/4 → 1/16, and the PS decodes each push with the s its message carries (a codec
    stuck at s = 2 sends only even multiples of ‖bucket‖/8 and misses the error bound
    ‖bucket‖/8)."""
    ids = np.arange(64, dtype=np.uint64)
    rng = np.random.default_rng(1)
    async with PSClient(_addresses(cluster), grads_codec="adaquant:window=1,f0_steps=1") as ps:
        for loss, levels in ((1.0, 2), (0.25, 4), (0.0625, 8)):
            assert await ps.report_loss(loss) == levels
            grads = rng.standard_normal((64, 4)).astype(np.float32)
            before = await ps.lookup("item", ids)
            await ps.push_unique("item", ids, grads)
            applied = (before - await ps.lookup("item", ids)) / SGD_LR
            used = _check_quantized(applied, grads, ids, levels)
        assert np.any(used % 2 == 1)  # levels a coarser s cannot send
        with pytest.raises(InvalidArgument, match="finite"):
            await ps.report_loss(float("nan"))
        assert await ps.report_loss(0.0625) == 8  # the bad report changed nothing


async def test_uniform_rows_down_within_half_a_step(cluster):
    """Rows encoded by the PS with the codec the lookup names (parameters in the name)."""
    ids = np.arange(300, dtype=np.uint64)
    async with PSClient(_addresses(cluster)) as plain, \
            PSClient(_addresses(cluster), rows_codec="uniform:bits=3") as small:
        exact = await plain.lookup("item", ids)
        rows = await small.lookup("item", ids)
        stats = small.codec_stats.as_dict()
    bound = np.abs(exact).max(axis=1, keepdims=True) * (1 + 2.0**-7) / (2 * 3)
    assert np.all(np.abs(rows - exact) <= bound * (1 + 1e-5))
    assert not np.array_equal(rows, exact)
    wire = stats["rows_down"]["uniform"]["received"]
    # a bf16 scale and 4 codes of 3 bits a row (a padded byte at most per shard's message)
    assert wire["raw_bytes"] == 300 * 4 * 4
    assert 300 * 3.5 <= wire["wire_bytes"] <= 300 * 3.5 + 4


def _jagged(rng, batch: int, universe: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, 6, size=batch)
    lengths[3] = 0  # an empty sample
    ids = rng.integers(0, universe, size=int(lengths.sum())).astype(np.uint64)
    if lengths[0] >= 2:
        ids[1] = ids[0]  # a duplicate inside one sample
    return ids, lengths


async def _plain_step(ps, table, ids, lengths, grad_out, mode):
    """The worker's plain path: unique lookup, embedding_bag, backward, per-row push."""
    plan = plan_batch({"f": (ids, lengths)}, table_of={"f": table}, num_shards=ps.num_shards)
    layout = plan.groups[0].layout
    pooled = pool_batch(plan, [await ps.lookup_sharded(layout)], mode=mode)
    pooled.pooled["f"].backward(torch.from_numpy(grad_out))
    await ps.push_sharded(layout, pooled.row_grads()[0])
    return pooled.pooled["f"].detach().numpy()


@pytest.mark.parametrize("mode", ["sum", "mean"])
async def test_des_pooling_equals_plain_lookup_and_pool(mode):
    """Forward partials summed over shards equal plain pooling; after the pooled push every
    row (Adagrad table) equals the row the plain push gives."""
    rng = np.random.default_rng(2)
    plain_cluster, des_cluster = await start_cluster(2), await start_cluster(2)
    try:
        async with PSClient(_addresses(plain_cluster)) as plain, \
                PSClient(_addresses(des_cluster)) as des:
            for _ in range(3):
                ids, lengths = _jagged(rng, 32, 300)
                grad_out = rng.standard_normal((32, 8)).astype(np.float32)
                expected = await _plain_step(plain, "user", ids, lengths, grad_out, mode)
                got = await des.pooled_lookup("user", ids, lengths, mode=mode)
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
                assert not got[3].any()
                ack = await des.pooled_push("user", ids, lengths, grad_out, mode=mode)
                assert ack.applied == np.unique(ids).size
            universe = np.arange(300, dtype=np.uint64)
            np.testing.assert_allclose(await des.lookup("user", universe),
                                       await plain.lookup("user", universe),
                                       rtol=1e-5, atol=1e-6)
    finally:
        for s in plain_cluster + des_cluster:
            await s.close()


async def test_des_partials_cost_less_than_rows_for_multi_hot_features(cluster):
    rng = np.random.default_rng(3)
    lengths = np.full(64, 20)
    ids = rng.integers(0, 100_000, size=int(lengths.sum())).astype(np.uint64)
    async with PSClient(_addresses(cluster)) as ps:
        await ps.pooled_lookup("user", ids, lengths)
        des_in = ps.wire_bytes()["lookup_in"]
        await ps.lookup("user", ids)
        plain_in = ps.wire_bytes()["lookup_in"] - des_in
    assert des_in * 5 < plain_in


@pytest.mark.parametrize("case", ["short_lengths", "negative_lengths", "float_lengths",
                                  "grads_rows", "grads_dim"])
async def test_bad_pooled_requests_get_clear_errors_and_change_nothing(cluster, case):
    ids = np.arange(40, dtype=np.uint64)
    mine = ids[shard_of(ids, 2) == 0]
    n = mine.size
    ok_lengths = np.array([n - 2, 2])
    bodies = {
        "short_lengths": ("PooledLookup", {"lengths": raw_array(np.array([n - 1]))}, "add up"),
        "negative_lengths": ("PooledLookup", {"lengths": raw_array(np.array([n + 1, -1]))},
                             ">= 0"),
        "float_lengths": ("PooledPush", {"lengths": raw_array(np.array([n * 1.0])),
                                          "grads": raw_array(np.ones((1, 8), np.float32))},
                          "integer"),
        "grads_rows": ("PooledPush", {"lengths": raw_array(ok_lengths),
                                       "grads": raw_array(np.ones((3, 8), np.float32))},
                       "samples, dim"),
        "grads_dim": ("PooledPush", {"lengths": raw_array(ok_lengths),
                                      "grads": raw_array(np.ones((2, 5), np.float32))}, "dim"),
    }
    method, extra, message = bodies[case]
    request, reply = {"PooledLookup": (PooledLookupRequest, PooledLookupReply),
                      "PooledPush": (PooledPushRequest, PooledPushReply)}[method]
    async with PSClient(_addresses(cluster)) as ps:
        await ps.lookup("user", ids)
        state = digest(cluster)
        async with shard_stream(cluster[0].address, method) as stream:
            with pytest.raises(InvalidArgument, match=message):
                await stream.request(request(
                    table="user", ids=raw_array(mine), **extra,
                    **({"client": 1, "seq": 1} if method == "PooledPush" else {})), reply)
        assert digest(cluster) == state
        with pytest.raises(InvalidArgument, match="add up"):  # checked before sending, too
            await ps.pooled_lookup("user", ids, [39])
        pooled = await ps.pooled_lookup("user", ids, [20, 20])  # the stream goes on
        assert pooled.shape == (2, 8)


async def test_payload_bytes_counted_per_stream_and_codec(cluster):
    ids = np.arange(300, dtype=np.uint64)
    grads = np.random.default_rng(4).standard_normal((300, 8)).astype(np.float32)
    async with PSClient(_addresses(cluster), rows_codec="int8", grads_codec="dct") as ps:
        await ps.lookup_unique("user", ids)
        await ps.push_unique("user", ids, grads)
        await ps.pooled_lookup("user", ids, [300])
        stats = ps.codec_stats
    rows = stats.get("rows_down", "int8", "received")
    assert rows.arrays == 2 and rows.raw_bytes == 300 * 8 * 4
    assert rows.wire_bytes == 300 * 8 + 300 * 4  # one int8 per element, one scale per row
    up = stats.get("grads_up", "dct", "sent")
    assert up.raw_bytes == grads.nbytes and up.ratio > 10
    assert stats.get("pooled_down", "int8", "received").arrays == 2
