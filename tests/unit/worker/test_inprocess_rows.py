"""The PS's own shards as an in-process rows client: routing by ``shard_of`` as on the gRPC
path, pushes before lookups in one call, zero wire bytes, and clear errors that change
nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.common.sharding import ShardedIds, place_ids, shard_of
from services.ps.inprocess import InProcessShards, PushGate

DIM = 4


def tables() -> list[dict[str, object]]:
    return [{"name": name, "dim": DIM, "seed": 3, "optimizer": {"kind": "sgd", "lr": 1.0}}
            for name in ("a", "b")]


def layout(ids: dict[str, list[int]], num_shards: int) -> ShardedIds:
    names = list(ids)
    placed, _ = place_ids([np.array(ids[n], np.uint64) for n in names], list(range(len(names))),
                          names, num_shards)
    return placed


async def test_rows_come_from_the_shard_that_owns_each_id() -> None:
    client = InProcessShards(tables(), num_shards=3)
    ids = {"a": list(range(1, 40)), "b": [5, 6, 7]}
    lay = layout(ids, 3)
    rows = await client.lookup_sharded(lay)
    assert rows.shape == (lay.ids.size, DIM)
    start = 0
    for k in range(3):
        for j, table in enumerate(lay.tables):
            part = lay.ids[start:start + lay.counts[k, j]]
            assert (shard_of(part, 3) == k).all()  # laid out as shard_of places them
            expected = client.shards[k].lookup_sync(table, part)
            np.testing.assert_array_equal(rows[start:start + part.size], expected)
            start += part.size
    assert client.wire_bytes() == {"lookup_out": 0, "lookup_in": 0, "push_out": 0,
                                   "push_in": 0}
    assert client.codec_stats.rows() == []


async def test_a_push_then_lookup_returns_rows_that_include_the_push() -> None:
    client = InProcessShards(tables(), num_shards=2)
    lay = layout({"a": [1, 2, 3, 4]}, 2)
    before = await client.lookup_sharded(lay)
    grads = np.ones((lay.ids.size, DIM), np.float32)
    ack, rows = await client.push_then_lookup(lay, grads, lay)
    assert ack.applied == 4
    np.testing.assert_allclose(rows, before - 1.0)  # SGD, lr 1


async def test_bad_requests_are_clear_errors_and_change_nothing() -> None:
    client = InProcessShards(tables(), num_shards=2)
    lay = layout({"a": [1, 2, 3]}, 2)
    before = await client.lookup_sharded(lay)
    with pytest.raises(InvalidArgument, match="for 3 shards, there are 2"):
        await client.lookup_sharded(layout({"a": [1]}, 3))
    with pytest.raises(InvalidArgument, match="grads must be"):
        await client.push_sharded(lay, np.ones((lay.ids.size, DIM + 1), np.float32))
    nan = np.full((lay.ids.size, DIM), np.nan, np.float32)
    ack = await client.push_sharded(lay, nan)  # the PS drops non-finite gradients
    assert ack.applied == 0 and ack.dropped_nonfinite == 3
    with pytest.raises(NotFound, match="nope"):
        await client.lookup_sharded(layout({"nope": [1]}, 2))
    np.testing.assert_array_equal(await client.lookup_sharded(lay), before)
    with pytest.raises(InvalidArgument, match="at least one table"):
        InProcessShards([])
    with pytest.raises(InvalidArgument, match="num_shards"):
        InProcessShards(tables(), num_shards=0)
    with pytest.raises(InvalidArgument, match="shard_config"):
        InProcessShards(tables(), shard_config={"num_shards": 2})


async def test_the_gate_holds_pushes_until_released_oldest_first() -> None:
    gate = PushGate()
    client = InProcessShards(tables(), gate=gate)
    lay = layout({"a": [9]}, 1)
    before = await client.lookup_sharded(lay)
    pushes = [asyncio.create_task(client.push_sharded(lay, np.full((1, DIM), g, np.float32)))
              for g in (1.0, 2.0)]
    await gate.until(lambda held, came: held == 2)
    np.testing.assert_array_equal(await client.lookup_sharded(lay), before)  # none applied
    gate.release(1)
    await pushes[0]
    assert not pushes[1].done()
    np.testing.assert_allclose(await client.lookup_sharded(lay), before - 1.0)
    with pytest.raises(InvalidArgument, match="cannot release 2"):
        gate.release(2)
    gate.release(1)
    await pushes[1]
    np.testing.assert_allclose(await client.lookup_sharded(lay), before - 3.0)
    assert (await client.tables())[0].name == "a" and client.dims == {"a": DIM, "b": DIM}
