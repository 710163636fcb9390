"""The PS admin REST API against a live shard: tables, rows, optimizer, checkpoints, errors."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from clients.admin_client import AdminClient
from clients.ps_client import PSClient
from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    MalformedMessage,
    NotFound,
)
from tests.integration.ps.conftest import digest, start_cluster


@pytest.fixture
async def shard(tmp_path):
    services = await start_cluster(1, tmp_path)
    yield services[0]
    await services[0].close()


async def test_health_ready_metrics_config(shard):
    async with AdminClient(shard.admin_url) as admin:
        assert await admin.healthy() and await admin.ready()
        config = await admin.config()
        assert config["num_shards"] == 1 and config["grpc_port"] == 0
        async with PSClient([shard.address]) as ps:
            await ps.lookup("user", np.arange(10, dtype=np.uint64))
        text = await admin.metrics()
    assert 'persimmon_ps_table_rows{table="user"} 10.0' in text
    assert 'persimmon_ps_request_seconds_count{method="Lookup"} 1.0' in text
    assert "persimmon_ps_table_miss_ratio" in text


async def test_create_list_describe_delete_table(shard):
    async with AdminClient(shard.admin_url) as admin:
        created = await admin.create_table({"name": "ads", "dim": 6,
                                            "optimizer": {"kind": "adam", "lr": 0.01}})
        assert (created.name, created.dim, created.rows, created.optimizer.kind) == (
            "ads", 6, 0, "adam")
        assert {t.name for t in await admin.tables()} == {"user", "item", "ads"}
        described = await admin.table("ads")
        assert described.config.optimizer.kind == "adam" and described.config.dim == 6
        assert described.stats.rows == 0 and described.epoch == 1
        with pytest.raises(AlreadyExists):
            await admin.create_table({"name": "ads", "dim": 6})
        async with PSClient([shard.address]) as ps:
            rows = await ps.lookup("ads", np.arange(3, dtype=np.uint64))
        assert rows.shape == (3, 6)
        await admin.delete_table("ads")
        with pytest.raises(NotFound):
            await admin.table("ads")


@pytest.mark.parametrize("body", [
    {"name": "t", "dim": 0},
    {"name": "t", "dim": 4, "colour": "red"},
    {"name": "t", "dim": "wide"},
    {"name": "bad name!", "dim": 4},
    {"name": "t", "dim": 4, "optimizer": {"kind": "rmsprop"}},
    {"name": "t", "dim": 4, "initializer": "magic"},
    {"dim": 4},
])
async def test_bad_table_bodies_are_400_and_change_nothing(shard, body):
    state = digest([shard])
    async with httpx.AsyncClient(base_url=shard.admin_url) as http:
        response = await http.post("/v1/tables", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] in ("ConfigError", "InvalidArgument")
    assert response.json()["message"]
    assert set(shard.shard.tables) == {"user", "item"}
    assert digest([shard]) == state


async def test_rows_and_optimizer_patch(shard):
    async with AdminClient(shard.admin_url) as admin, PSClient([shard.address]) as ps:
        absent = await admin.row("item", 42)
        assert absent.id == 42 and absent.present is False
        looked = await ps.lookup("item", np.array([42], np.uint64))
        np.testing.assert_allclose(absent.row, looked[0], rtol=1e-7)
        assert (await admin.row("item", 42)).present is True
        patched = await admin.set_optimizer("item", lr=2.0)
        assert (patched.kind, patched.lr) == ("sgd", 2.0)
        assert (await admin.table_stats("item")).lookups == 1
        await ps.push("item", np.array([42], np.uint64), np.ones((1, 4), np.float32))
        after = await ps.lookup("item", np.array([42], np.uint64))
        np.testing.assert_allclose(after[0], looked[0] - 2.0, rtol=1e-6)
        state = digest([shard])
        for bad in ({"lr": -1}, {"lr": "fast"}, {"momentum_of_doom": 1}, {}):
            with pytest.raises(InvalidArgument):
                await admin.set_optimizer("item", **bad)
        assert shard.shard.table("item").config.optimizer.lr == 2.0
        assert digest([shard]) == state


async def test_bad_paths_and_params(shard):
    async with httpx.AsyncClient(base_url=shard.admin_url) as http:
        assert (await http.get("/v1/tables/nope")).status_code == 404
        assert (await http.get("/v1/tables/user/rows/-1")).status_code == 422
        assert (await http.get(f"/v1/tables/user/rows/{2**64}")).status_code == 422
        assert (await http.get("/v1/tables/user/rows/abc")).status_code == 422
        assert (await http.post("/v1/checkpoints", json={"id": "../x"})).status_code == 400
        assert (await http.post("/v1/checkpoints", json={"when": 1})).status_code == 400
        assert (await http.post("/v1/checkpoints/none-such/restore")).status_code == 404
        r = await http.patch("/v1/tables/user/optimizer", content=b"{not json",
                             headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "InvalidArgument"


async def test_checkpoint_and_restore_over_rest(shard):
    ids = np.arange(200, dtype=np.uint64)
    async with AdminClient(shard.admin_url) as admin, PSClient([shard.address]) as ps:
        await ps.push("user", ids, np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32))
        saved = await ps.lookup("user", ids)
        manifest = await admin.checkpoint("ck-1")
        assert (manifest.checkpoint_id, manifest.shard_id, manifest.epoch) == ("ck-1", 0, 1)
        assert manifest.tables["user"].rows == 200 and manifest.tables["user"].config.dim == 8
        await ps.push("user", ids, np.ones((200, 8), np.float32))
        assert not np.array_equal(await ps.lookup("user", ids), saved)
        listed = await admin.checkpoints()
        assert [m.checkpoint_id for m in listed] == ["ck-1"]
        assert listed[0].complete and listed[0].tables["user"] == 200
        assert listed[0].parts == [manifest]
        restored = await admin.restore("ck-1")
        assert (restored.checkpoint_id, restored.rows["user"], restored.epoch) == ("ck-1", 200, 2)
        np.testing.assert_array_equal(await ps.lookup("user", ids), saved)


async def test_an_answer_of_another_shape_is_malformed_naming_the_field():
    """A broken or foreign peer's answer is refused whole, naming what does not fit."""
    tables = [{"name": "user", "dim": "wide", "dtype": "float32", "rows": 0,
               "optimizer": {"kind": "sgd"}}]
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=tables))
    async with AdminClient("http://ps", transport=transport) as admin:
        with pytest.raises(MalformedMessage, match=r"GET /v1/tables .*\$\[0\]\.dim"):
            await admin.tables()


async def test_checkpoint_without_directory_is_412():
    services = await start_cluster(1)
    try:
        async with AdminClient(services[0].admin_url) as admin:
            with pytest.raises(FailedPrecondition, match="checkpoint directory"):
                await admin.checkpoint()
    finally:
        await services[0].close()


async def test_openapi_lists_every_route(shard):
    async with httpx.AsyncClient(base_url=shard.admin_url) as http:
        spec = (await http.get("/openapi.json")).json()
    paths = set(spec["paths"])
    for path in ("/healthz", "/readyz", "/metrics", "/v1/config", "/v1/tables",
                 "/v1/tables/{name}", "/v1/tables/{name}/stats", "/v1/tables/{name}/rows/{row_id}",
                 "/v1/tables/{name}/optimizer", "/v1/checkpoints",
                 "/v1/checkpoints/{checkpoint_id}/restore"):
        assert path in paths
