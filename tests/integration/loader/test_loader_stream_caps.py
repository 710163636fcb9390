"""The loader client names itself (``persimmon-client`` metadata) on a real loader, so the
loader's per-client-id stream cap tells its streams from other clients' on the same host; a
refused stream takes no batch."""

from __future__ import annotations

import pytest

from clients.loader_client import LoaderClient
from services.common.errors import InvalidArgument, ResourceExhausted


async def test_the_loader_client_names_itself_and_is_capped_by_its_id(start_loader):
    loader = await start_loader(source="synthetic:20000", batch_size=100,
                                max_streams_per_client_id=1)
    async with LoaderClient(loader.address, rank=0, world_size=2, credits=2,
                            client_id="a") as a:
        stream = a.batches()
        assert (await anext(stream)).batch_id == 0  # a's stream is open and served
        async with LoaderClient(loader.address, rank=1, world_size=2, client_id="a") as twin:
            with pytest.raises(ResourceExhausted,
                               match=r"client id 'a' .*\(max_streams_per_client_id\) is 1"):
                await anext(twin.batches())
        async with LoaderClient(loader.address, rank=1, world_size=2) as b:
            assert b.client_id != a.client_id  # a random id of its own: within its limit
            assert (await anext(b.batches())).batch_id == 1  # the refused stream took none
        await stream.aclose()


@pytest.mark.parametrize("bad", ["", "x" * 65, "tab\there", 7])
def test_a_bad_client_id_is_refused_naming_it(bad):
    with pytest.raises(InvalidArgument, match="client_id"):
        LoaderClient("127.0.0.1:1", client_id=bad)
