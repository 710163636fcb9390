"""Bearer-token authentication on real servers: every gRPC call and every admin route of the
PS and the loader but /healthz, /readyz and /metrics (admin_open_reads opens the GETs); a
rejected call changes nothing."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest

from clients.admin_client import AdminClient
from clients.loader_client import LoaderClient
from clients.ps_client import PSClient
from services.common.codecs import raw_array
from services.common.errors import PermissionDenied, Unauthenticated
from services.common.wire import decode_message, encode_message
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from tests.integration.ps.conftest import digest
from tests.integration.security.conftest import TOKEN, stream_once

PUSH = encode_message({"client": 1, "seq": 1, "tables": ["item"], "counts": [4],
                       "ids": raw_array(np.arange(4, dtype=np.uint64)),
                       "grads": [raw_array(np.ones((4, 4), np.float32))]}, rid=1)


async def _push(address: str, metadata=None) -> dict:
    return await stream_once(address, "Push", PUSH, metadata)


async def _tables(address: str, metadata=None) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        raw = await channel.unary_unary("/persimmon.PS/Tables")(encode_message({}), timeout=10,
                                                                 metadata=metadata)
        return decode_message(raw)


@pytest.mark.parametrize("metadata, code, words", [
    (None, grpc.StatusCode.UNAUTHENTICATED, "requires a bearer token"),
    ((("authorization", "Basic " + TOKEN),), grpc.StatusCode.UNAUTHENTICATED, "bearer token"),
    ((("authorization", "Bearer wrong"),), grpc.StatusCode.PERMISSION_DENIED, "not valid"),
    ((("authorization", "Bearer " + TOKEN + "x"),), grpc.StatusCode.PERMISSION_DENIED, "not valid"),
])
async def test_grpc_calls_without_the_right_token_are_refused_and_change_nothing(
        start_ps, metadata, code, words):
    ps = await start_ps(env={"PERSIMMON_TOKEN": TOKEN})
    before = digest([ps])
    for call in (_push, _tables):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(ps.address, metadata)
        assert err.value.code() == code and words in err.value.details()
    assert digest([ps]) == before
    assert ps.shard.table("item").stats().pushes == 0


async def test_grpc_calls_with_the_token_work(start_ps, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ps = await start_ps(env={"PERSIMMON_TOKEN_FILE": str(token_file)})
    before = digest([ps])
    good = (("authorization", "bearer " + TOKEN),)
    assert (await _push(ps.address, good))["applied"] == 4
    assert (await _tables(ps.address, good))["shard_id"] == 0
    assert digest([ps]) != before


READS = ("/v1/config", "/v1/tables", "/v1/tables/user", "/v1/tables/user/stats",
         "/v1/tables/user/rows/3", "/v1/checkpoints", "/openapi.json", "/docs")


async def test_admin_gets_need_the_token_but_health_stays_open(start_ps):
    ps = await start_ps(env={"PERSIMMON_TOKEN": TOKEN})
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await http.get(path)).status_code == 200, path
        for path in READS:
            refused = await http.get(path)
            assert refused.status_code == 401, path
            assert refused.json()["error"] == "Unauthenticated", path
            wrong = await http.get(path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 403, path
            ok = await http.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200, path
    assert ps.shard.table("user").num_rows == 0  # the refused peek touched nothing


@pytest.mark.parametrize("how", ["config", "env"])
async def test_admin_open_reads_opens_the_gets_only(start_ps, how):
    if how == "config":
        ps = await start_ps(env={"PERSIMMON_TOKEN": TOKEN}, admin_open_reads=True)
    else:
        ps = await start_ps(env={"PERSIMMON_TOKEN": TOKEN, "PERSIMMON_ADMIN_OPEN_READS": "1"})
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        for path in READS:
            assert (await http.get(path)).status_code == 200, path
        assert (await http.delete("/v1/tables/user")).status_code == 401
    assert sorted(ps.shard.tables) == ["item", "user"]


async def test_admin_writes_need_the_token(start_ps):
    ps = await start_ps(env={"PERSIMMON_TOKEN": TOKEN})
    table = {"name": "extra", "dim": 4}
    async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
        missing = await http.post("/v1/tables", json=table)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"] == "Unauthenticated"
        wrong = await http.delete("/v1/tables/user", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403 and wrong.json()["error"] == "PermissionDenied"
        # the token is checked before the body is even parsed
        assert (await http.post("/v1/tables", content=b"{not json")).status_code == 401
    assert sorted(ps.shard.tables) == ["item", "user"]

    async with AdminClient(ps.admin_url) as anonymous:
        with pytest.raises(Unauthenticated, match="bearer token"):
            await anonymous.create_table(table)
    async with AdminClient(ps.admin_url, token="wrong") as intruder:
        with pytest.raises(PermissionDenied):
            await intruder.set_optimizer("user", lr=1.0)
    assert ps.shard.table("user").config.optimizer.lr == pytest.approx(0.1)
    async with AdminClient(ps.admin_url, token=TOKEN) as admin:
        assert (await admin.create_table(table)).name == "extra"
        await admin.delete_table("extra")
    assert sorted(ps.shard.tables) == ["item", "user"]


async def test_the_loader_admin_and_grpc_are_guarded_too(monkeypatch):
    monkeypatch.setenv("PERSIMMON_TOKEN", TOKEN)
    loader = LoaderService(LoaderConfig(source="synthetic:1000", grpc_port=0, admin_port=0,
                                        batch_size=100))
    await loader.start()
    monkeypatch.delenv("PERSIMMON_TOKEN")
    try:
        async with httpx.AsyncClient(base_url=loader.admin_url, timeout=10) as http:
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/v1/stats")).status_code == 401
            assert (await http.get("/v1/stats", headers={
                "Authorization": f"Bearer {TOKEN}"})).status_code == 200
            assert (await http.post("/v1/pause")).status_code == 401
            assert not loader.pipeline.paused
            ok = await http.post("/v1/pause", headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and loader.pipeline.paused
        async with grpc.aio.insecure_channel(loader.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/persimmon.Loader/Describe")(encode_message({}),
                                                                        timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with LoaderClient(loader.address, token=TOKEN) as client:
            assert (await client.describe()).batch_size == 100
        async with LoaderClient(loader.address, token="wrong") as client:
            with pytest.raises(PermissionDenied):
                await client.describe()
    finally:
        await loader.close()


async def test_ps_client_sends_the_token_from_its_argument_or_the_environment(start_ps,
                                                                             monkeypatch):
    ps = await start_ps(env={"PERSIMMON_TOKEN": TOKEN})
    ids = np.arange(10, dtype=np.uint64)
    with pytest.raises(Unauthenticated):
        async with PSClient([ps.address]):
            pass
    with pytest.raises(PermissionDenied):
        async with PSClient([ps.address], token="wrong"):
            pass
    async with PSClient([ps.address], token=TOKEN) as client:
        ack = await client.push("item", ids, np.ones((10, 4), np.float32))
        assert ack.applied == 10
    monkeypatch.setenv("PERSIMMON_TOKEN", TOKEN)
    async with PSClient([ps.address]) as client:
        rows = await client.lookup("item", ids)
    np.testing.assert_allclose(rows, ps.shard.table("item").peek(ids)[0])


async def test_the_workers_calls_to_the_loader_admin_carry_the_token(monkeypatch):
    from services.worker.job_checkpoints import _loader_admin

    monkeypatch.setenv("PERSIMMON_TOKEN", TOKEN)
    loader = LoaderService(LoaderConfig(source="synthetic:1000", grpc_port=0, admin_port=0,
                                        batch_size=100))
    await loader.start()
    try:
        await _loader_admin(loader.admin_url, "POST", "/v1/pause")  # as a cut's commit is
        assert loader.pipeline.paused
        monkeypatch.setenv("PERSIMMON_TOKEN", "wrong")
        with pytest.raises(PermissionDenied):
            await _loader_admin(loader.admin_url, "POST", "/v1/resume")
        assert loader.pipeline.paused
    finally:
        await loader.close()
