"""Streams are capped per client id (the persimmon-client metadata) as well as per client
host: on a real PS, one client id cannot take every stream its host may open, and a refused
stream changes nothing."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from clients.ps_client import PSClient
from services.common.rpc import CLIENT_ID_KEY, channel_options
from tests.integration.security.conftest import stream_once, table_state
from tests.integration.security.test_security_limits import lookup_body, push_body


async def test_streams_per_client_id(start_ps):
    ps = await start_ps(max_streams_per_client_id=2)
    seven = ((CLIENT_ID_KEY, "7"),)
    async with grpc.aio.insecure_channel(ps.address, options=channel_options()) as channel:
        open_calls = []
        for method in ("Lookup", "Lookup"):
            call = channel.stream_stream(f"/persimmon.PS/{method}")(metadata=seven)
            await call.write(lookup_body(3))
            await call.read()  # the stream is being served
            open_calls.append(call)
        before = table_state(ps)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream_once(ps.address, "Push", push_body(5), metadata=seven)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "client id '7'" in err.value.details()
        assert "limit (max_streams_per_client_id) is 2" in err.value.details()
        assert table_state(ps) == before
        # the same host under another id, or under none, is within its own (host) limit
        assert (await stream_once(ps.address, "Push", push_body(5),
                                  metadata=((CLIENT_ID_KEY, "8"),)))["applied"] == 5
        assert (await stream_once(ps.address, "Push", push_body(5)))["applied"] == 5
        for call in open_calls:
            call.cancel()


async def test_the_ps_client_names_itself_and_fits_in_its_limit(start_ps):
    ps = await start_ps(max_streams_per_client_id=5)  # a PSClient opens 5 streams per shard
    async with PSClient([ps.address]) as client:
        await client.push("item", np.arange(3, dtype=np.uint64), np.ones((3, 4), np.float32))
        rows = await client.lookup("item", np.arange(3, dtype=np.uint64))
    assert rows.shape == (3, 4)
