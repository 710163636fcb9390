"""Limits on a real PS: message size, ids per request, tables, streams per client, deadlines,
admin body size. Going over one gets a clear error and leaves every table as it was."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from clients.ps_client import PSClient
from services.common.admin import make_admin_app
from services.common.auth import ServerSecurity
from services.common.codecs import raw_array
from services.common.config import config_to_dict
from services.common.errors import DeadlineExceeded
from services.common.rpc import channel_options, generic_service, make_server, unary_handler
from services.common.wire import decode_message, encode_message
from services.ps.tables import TableConfig
from tests.conftest import eventually
from tests.integration.security.conftest import stream_once, table_state

_SEQS = itertools.count(1)


def push_body(n: int, dim: int = 4, table: str = "item") -> bytes:
    return encode_message({"client": 1, "seq": next(_SEQS), "tables": [table], "counts": [n],
                           "ids": raw_array(np.arange(n, dtype=np.uint64)),
                           "grads": [raw_array(np.ones((n, dim), np.float32))]}, rid=7)


def lookup_body(n: int, table: str = "user") -> bytes:
    return encode_message({"tables": [table], "counts": [n], "codec": "none",
                           "ids": raw_array(np.arange(n, dtype=np.uint64))}, rid=8)


async def test_oversized_messages_are_refused(start_ps):
    ps = await start_ps(max_message_bytes=4096)
    before = table_state(ps)
    body = push_body(200)  # 200 ids × 4 floats: about 4 KiB + 1.6 KiB of ids
    assert 4096 < len(body) < 2 * 4096
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream_once(ps.address, "Push", body)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit of 4096 bytes (max_message_bytes)" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # past the transport's own cap
        await stream_once(ps.address, "Push", push_body(1000))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert table_state(ps) == before
    assert (await stream_once(ps.address, "Push", push_body(10)))["applied"] == 10


@pytest.mark.parametrize("method, body", [("Lookup", lookup_body(101)),
                                          ("Push", push_body(101))])
async def test_too_many_ids_per_request(start_ps, method, body):
    ps = await start_ps(max_ids_per_request=100)
    before = table_state(ps)
    reply = await stream_once(ps.address, method, body)
    assert reply["rid"] in (7, 8) and reply["error"]["error"] == "InvalidArgument"
    assert "101 ids exceed the limit of 100 per request" in reply["error"]["message"]
    assert table_state(ps) == before


async def test_max_tables(start_ps):
    ps = await start_ps(max_tables=3)
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        assert (await http.post("/v1/tables", json={"name": "third", "dim": 2})).status_code == 201
        before = table_state(ps)
        over = await http.post("/v1/tables", json={"name": "fourth", "dim": 2})
    assert over.status_code == 413 and over.json() == {
        "error": "ResourceExhausted", "message": "shard holds the maximum of 3 tables"}
    assert table_state(ps) == before


async def test_streams_per_client(start_ps):
    ps = await start_ps(max_streams_per_client=2)
    async with grpc.aio.insecure_channel(ps.address, options=channel_options()) as channel:
        open_calls = []
        for method in ("Lookup", "Push"):
            call = channel.stream_stream(f"/persimmon.PS/{method}")()
            await call.write(lookup_body(3) if method == "Lookup" else push_body(3))
            await call.read()  # the stream is being served
            open_calls.append(call)
        before = table_state(ps)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream_once(ps.address, "Push", push_body(5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit (max_streams_per_client) is 2" in err.value.details()
        assert table_state(ps) == before
        open_calls[0].cancel()
        # the slot is freed once the server sees the cancelled stream end
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                assert (await stream_once(ps.address, "Push", push_body(5)))["applied"] == 5
                break
            except grpc.aio.AioRpcError as exc:
                if (exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
                        or asyncio.get_running_loop().time() > deadline):
                    raise
                await asyncio.sleep(0.05)


async def test_a_stream_past_its_deadline_applies_nothing_more(start_ps):
    ps = await start_ps()
    async with grpc.aio.insecure_channel(ps.address, options=channel_options()) as channel:
        call = channel.stream_stream("/persimmon.PS/Push")(timeout=2.0)
        await call.write(push_body(4))
        assert decode_message(await call.read())["applied"] == 4
        after_first = table_state(ps)
        await eventually(lambda: call.done(), timeout=5)
        assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises((grpc.aio.AioRpcError, asyncio.InvalidStateError)):
            await call.write(push_body(8))
    assert table_state(ps) == after_first


async def test_a_unary_call_past_the_server_limit_is_cancelled():
    started = asyncio.Event()

    async def slow(raw: bytes, context) -> bytes:
        started.set()
        await asyncio.sleep(30)
        return raw

    handlers = generic_service("test.Slow", {"Echo": unary_handler(slow)})
    server, port = make_server([handlers], "127.0.0.1", 0, security=ServerSecurity(),
                               max_unary_s=0.2)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/test.Slow/Echo")(b"x", timeout=10)
        assert started.is_set() and err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "limit of 0.2 s (max_unary_s)" in err.value.details()
    finally:
        await server.stop(None)


async def test_admin_body_size_is_capped():
    app = make_admin_app(title="t", registry=CollectorRegistry(), config=dict, ready=lambda: True,
                         security=ServerSecurity(), max_body_bytes=1000)
    seen = []

    @app.post("/v1/echo")
    async def echo(body: dict) -> dict:
        seen.append(body)
        return body

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.post("/v1/echo", json={"a": "x" * 10})).status_code == 200
        big = await http.post("/v1/echo", json={"a": "x" * 2000})
    assert big.status_code == 413 and "exceeds the limit of 1000 bytes" in big.json()["message"]
    assert len(seen) == 1


async def test_the_client_turns_a_missed_deadline_into_deadline_exceeded():
    """A server that accepts streams but never answers: PSClient raises DeadlineExceeded."""
    async def tables(raw: bytes, context) -> bytes:
        return encode_message({"shard_id": 0, "num_shards": 1,
                               "tables": [config_to_dict(TableConfig(name="user", dim=8))]})

    async def silent(requests, context):
        async for _ in requests:
            pass
        yield b""  # never reached while the client keeps the stream open

    handlers = generic_service("persimmon.PS", {
        "Tables": unary_handler(tables),
        "Lookup": grpc.stream_stream_rpc_method_handler(silent),
        "Push": grpc.stream_stream_rpc_method_handler(silent)})
    server, port = make_server([handlers], "127.0.0.1", 0, security=ServerSecurity())
    await server.start()
    try:
        async with PSClient([f"127.0.0.1:{port}"], timeout=0.3) as client:
            with pytest.raises(DeadlineExceeded, match="within 0.3 s"):
                await client.lookup("user", np.arange(3, dtype=np.uint64))
            with pytest.raises(DeadlineExceeded):
                await client.push("user", np.arange(3, dtype=np.uint64),
                                  np.ones((3, 8), np.float32))
    finally:
        await server.stop(None)
