"""MultiplexedStream against real gRPC channels: a request never outlives its call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clients._stream import MultiplexedStream
from services.common import messages as msg
from services.common.errors import Unavailable


async def test_a_request_fails_when_its_channel_closes_before_the_connection_is_up():
    """The peer takes the TCP connection and never speaks HTTP/2, so the request's write
    waits for the connection; a reconnect then closes the channel. grpc.aio leaves that write
    pending for ever: a stream that awaited it held its write lock for good and every later
    request hung (a PS client froze after a shard was killed and restarted)."""
    held: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    stream = MultiplexedStream(channel, "/persimmon.PS/Lookup")
    try:
        first = asyncio.ensure_future(stream.request(msg.TablesRequest(), msg.TablesReply))
        second = asyncio.ensure_future(stream.request(msg.TablesRequest(), msg.TablesReply))
        await asyncio.sleep(0.3)
        assert not first.done() and not second.done()  # both wait for the connection
        await channel.close()
        for request in (first, second):
            with pytest.raises(Unavailable):
                await asyncio.wait_for(request, 5)
    finally:
        await stream.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
