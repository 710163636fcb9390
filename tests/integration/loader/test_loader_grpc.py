"""The Batches/Ack/Describe service over real gRPC: routing, credits, re-delivery, bad calls."""

from __future__ import annotations

import asyncio

import grpc
import msgpack
import numpy as np
import pytest

from clients.loader_client import LoaderClient, SyncLoaderClient
from services.common.errors import FailedPrecondition
from services.common.wire import decode_message, encode_message
from services.loader.planted import CHUNK_ROWS, SyntheticDataset
from tests.conftest import eventually
from tests.integration.loader.loader_support import drain, labels_of


async def test_two_ranks_get_every_batch_once_in_b_mod_w_order(start_loader):
    loader = await start_loader(source="synthetic:5000", batch_size=300)
    r0, r1 = await asyncio.gather(drain(loader.address, rank=0, world_size=2),
                                  drain(loader.address, rank=1, world_size=2, credits=1))
    assert [b.batch_id for b in r0] == list(range(0, 17, 2))
    assert [b.batch_id for b in r1] == list(range(1, 17, 2))
    assert sum(b.size for b in r0 + r1) == 5000
    assert {b.size for b in r0 + r1} == {300, 200}  # 16 full batches and the last partial one
    expected = SyntheticDataset().teacher_rows("train", 5000).labels
    ordered = sorted(r0 + r1, key=lambda b: b.batch_id)
    np.testing.assert_array_equal(labels_of(ordered), expected)
    assert ordered[-1].positions == {"synthetic:e0:train": (4800, 4999)}
    stats = loader.dispatcher.stats()["ranks"]
    assert stats["0"]["acked"] == 9 and stats["1"]["acked"] == 8


async def test_credits_bound_the_unacknowledged_batches(start_loader):
    loader = await start_loader(source="synthetic:30000", batch_size=100, prefetch_batches=8)
    async with LoaderClient(loader.address, credits=3) as client:
        stream = client.batches()
        got = [await anext(stream) for _ in range(3)]
        # the fourth cannot come until something is acknowledged
        fourth = asyncio.ensure_future(anext(stream))
        await eventually(lambda: loader.dispatcher.stats()["ranks"]["0"]["ready"] == 8)
        assert not fourth.done() and loader.dispatcher.in_flight() == {0: 3}
        # back-pressure: the producer waits with 8 batches ready and 3 out, and has not read
        # the source past the first block
        assert loader.pipeline.records == CHUNK_ROWS
        await client.ack(got[0])
        assert (await asyncio.wait_for(fourth, 10)).batch_id == 3
        await stream.aclose()


async def test_reconnect_redelivers_unacked_batches(start_loader):
    loader = await start_loader(source="synthetic:2000", batch_size=100)
    first = await drain(loader.address, credits=4, limit=4, ack=False)
    assert [b.batch_id for b in first] == [0, 1, 2, 3]
    async with LoaderClient(loader.address, credits=4) as client:
        answer = await client.ack([first[1], 2, 2])
        assert (answer.acked, answer.unknown) == ([1, 2], [2])  # 2 again: no longer held
        rest = []
        async for batch in client.batches():
            rest.append(batch)
            await client.ack(batch)
    ids = [b.batch_id for b in rest]
    assert ids[:2] == [0, 3] and ids[2:] == list(range(4, 20))
    np.testing.assert_array_equal(rest[0].labels, first[0].labels)
    assert loader.dispatcher.stats()["ranks"]["0"]["redelivered"] == 2


async def test_client_survives_a_broken_stream_without_duplicates(start_loader):
    loader = await start_loader(source="synthetic:1500", batch_size=100)
    async with LoaderClient(loader.address, credits=2) as client:
        seen = []
        async for batch in client.batches():
            seen.append(batch.batch_id)
            if batch.batch_id == 4:
                # a second stream of rank 0 replaces ours: the client sees its stream end
                # early, reconnects, and skips the batches it already handed out
                hijack = await drain(loader.address, credits=1, limit=1, ack=False)
                assert hijack[0].batch_id in (4, 5)
            await client.ack(batch)
    assert seen == list(range(15)) and client.reconnects >= 1


async def test_describe_and_sync_client(start_loader):
    loader = await start_loader(source="synthetic:250", batch_size=100)
    address = loader.address

    def blocking():
        with SyncLoaderClient(address, credits=2) as client:
            before = client.describe()
            batches = []
            for batch in client.batches():
                batches.append(batch)
                client.ack(batch)
            return before, client.describe(), batches

    before, info, batches = await asyncio.to_thread(blocking)
    assert before.world_size == 0  # not known until a worker connects
    assert info.sparse_features == [f"C{i}" for i in range(1, 9)]
    assert info.num_dense == 4 and info.batch_size == 100 and info.world_size == 1
    assert [b.size for b in batches] == [100, 100, 50]


async def test_bad_calls_get_clear_errors(start_loader):
    loader = await start_loader(source="synthetic:500", world_size=2)
    with pytest.raises(FailedPrecondition, match="world_size 2"):
        await drain(loader.address, rank=0, world_size=3)
    async with grpc.aio.insecure_channel(loader.address) as channel:
        batches = channel.unary_stream("/persimmon.Loader/Batches")
        for body, match in ((b"\xc1 not msgpack", "not valid msgpack"),
                            (encode_message({"rank": 2, "world_size": 2, "credits": 1}), "rank"),
                            (encode_message({"rank": 0, "world_size": 2, "credits": 0}),
                             "credits"),
                            (encode_message({"rank": 0, "world_size": 2}), "credits")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anext(batches(body).__aiter__())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert match in err.value.details()
        ack = channel.unary_unary("/persimmon.Loader/Ack")
        for body in ({"batch_ids": [-1]}, {"batch_ids": "3"}, {"batch_ids": [True]}):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ack(encode_message(body))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reply = decode_message(await ack(encode_message({"batch_ids": [12345]})))
        assert reply == {"acked": [], "unknown": [12345]}
        for call, body in ((ack, {"batch_ids": [1], "v": 1}),
                           (channel.unary_unary("/persimmon.Loader/Describe"), {"v": 1}),
                           (batches, {"rank": 0, "world_size": 2, "credits": 1, "v": 1})):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                reply_or_stream = call(msgpack.packb(body))
                if hasattr(reply_or_stream, "__aiter__"):
                    await anext(reply_or_stream.__aiter__())
                else:
                    await reply_or_stream
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "protocol version 1" in err.value.details()
    ranks = loader.dispatcher.stats()["ranks"].values()
    assert all(r["credits"] == 0 and r["delivered"] == 0 for r in ranks)  # bad calls changed nothing


async def test_synthetic_source_resumes_from_its_state_file(tmp_path, start_loader):
    common = dict(source="synthetic:20000", batch_size=1000, state_file=str(tmp_path / "s.json"))
    first = await start_loader(**common)
    acked = await drain(first.address, limit=9)  # 9000 rows: the first chunk (8192) is done
    await first.close()
    second = await start_loader(**common)
    rest = await drain(second.address)
    assert rest[0].positions == {"synthetic:e0:train": (CHUNK_ROWS, CHUNK_ROWS + 999)}
    expected = SyntheticDataset().teacher_rows("train", 20000).labels
    np.testing.assert_array_equal(labels_of(acked)[:CHUNK_ROWS], expected[:CHUNK_ROWS])
    np.testing.assert_array_equal(labels_of(rest), expected[CHUNK_ROWS:])
