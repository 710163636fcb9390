"""The loader's admin REST API over HTTP: health, config, sources, offsets, workers, stats,
metrics, pause and resume."""

from __future__ import annotations

import asyncio

import httpx

from clients.loader_client import LoaderClient
from tests.conftest import eventually
from tests.integration.loader.loader_support import drain


async def test_health_config_sources_offsets_and_metrics(start_loader):
    loader = await start_loader(source="synthetic:1000", batch_size=250)
    async with httpx.AsyncClient(base_url=loader.admin_url, timeout=10) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        assert (await http.get("/readyz")).status_code == 200
        assert (await http.get("/v1/config")).json()["batch_size"] == 250
        await drain(loader.address, world_size=1)
        (source,) = (await http.get("/v1/sources")).json()
        assert source["kind"] == "synthetic" and source["records"] == 1000
        assert source["state"] == "exhausted" and source["sparse_features"][0] == "C1"
        await eventually(lambda: loader.source.offsets()["synthetic:e0:train"]["done"])
        offsets = (await http.get("/v1/offsets")).json()
        assert offsets["synthetic:e0:train"]["committed"] == 1000
        workers = (await http.get("/v1/workers")).json()
        assert workers["ranks"]["0"]["acked"] == 4 and workers["world_size"] == 1
        stats = (await http.get("/v1/stats")).json()
        assert stats["records"] == 1000 and stats["batches"] == 4
        metrics = (await http.get("/metrics")).text
        for name in ("persimmon_loader_records_total 1000.0", "persimmon_loader_batches_in_flight",
                     "persimmon_loader_records_per_second", "persimmon_loader_batches_acked_total",
                     "persimmon_loader_sent_bytes_total"):
            assert name in metrics
        assert (await http.get("/v1/nothing")).status_code == 404


async def test_pause_stops_reading_and_resume_continues(start_loader):
    loader = await start_loader(source="synthetic:40000", batch_size=1000, prefetch_batches=1)
    async with httpx.AsyncClient(base_url=loader.admin_url, timeout=10) as http, \
            LoaderClient(loader.address, credits=1) as client:
        assert (await http.post("/v1/pause")).json() == {"paused": True}
        stream = client.batches()
        got = []
        # the source is not read while paused: the batches of the block already read still
        # come, then the stream waits
        pipeline = loader.pipeline
        while pipeline.records == 0 or len(got) * 1000 + pipeline.batcher.held < pipeline.records:
            batch = await asyncio.wait_for(anext(stream), 10)
            got.append(batch)
            await client.ack(batch)
        read_while_paused = loader.pipeline.records
        assert read_while_paused < 40000
        waiting = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait({waiting}, timeout=0.3)
        assert not done and loader.pipeline.records == read_while_paused
        sources = (await http.get("/v1/sources")).json()
        assert sources[0]["state"] == "paused"
        assert (await http.post("/v1/resume")).json() == {"paused": False}
        got.append(await asyncio.wait_for(waiting, 10))
        await client.ack(got[-1])
        async for batch in stream:
            got.append(batch)
            await client.ack(batch)
    assert sum(b.size for b in got) == 40000
