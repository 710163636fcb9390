"""A PS shard process does not grow without bound: a default max_rows on its tables, its
checkpoints pruned to --keep-checkpoints, the staging directories of a crash removed at
start. Real shards on port 0, real files."""

from __future__ import annotations

import json

import httpx
import numpy as np

from clients.ps_client import PSClient
from services.ps.config import PSConfig
from services.ps.service import PSService
from tests.integration.ps.conftest import table_configs


async def _started(tmp_path=None, **config) -> PSService:
    service = PSService(PSConfig(grpc_port=0, admin_port=0, tables=table_configs(),
                                 checkpoint_dir=str(tmp_path / "ckpt") if tmp_path else None,
                                 **config))
    await service.start()
    return service


async def test_default_max_rows_bounds_every_table():
    ps = await _started(default_max_rows=50)
    try:
        async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
            assert (await http.post("/v1/tables", json={"name": "fresh", "dim": 4})).status_code == 201
            assert (await http.post("/v1/tables", json={"name": "own", "dim": 4,
                                                        "max_rows": 10})).status_code == 201
            config = (await http.get("/v1/config")).json()
        assert {t["name"]: t["max_rows"] for t in config["tables"]} == {"user": 50, "item": 50}
        async with PSClient([ps.address]) as client:
            for start in range(0, 1000, 100):  # ever new ids
                ids = np.arange(start, start + 100, dtype=np.uint64)
                for name in ("user", "fresh", "own"):
                    await client.lookup(name, ids)
        assert ps.shard.table("user").num_rows == 50
        assert ps.shard.table("fresh").num_rows == 50
        assert ps.shard.table("own").num_rows == 10
        # each batch of 100 new ids: the 50 old rows evicted, 50 of the batch created
        assert ps.shard.table("user").stats().evictions == 9 * 50
    finally:
        await ps.close()


async def test_default_max_rows_zero_leaves_tables_unbounded():
    ps = await _started(default_max_rows=0)
    try:
        assert ps.shard.table("user").config.max_rows is None
    finally:
        await ps.close()


async def _checkpoint(http: httpx.AsyncClient, checkpoint_id: str, incremental: bool) -> None:
    answer = await http.post("/v1/checkpoints", json={"id": checkpoint_id,
                                                      "incremental": incremental})
    assert answer.status_code == 201, answer.text


async def test_checkpoints_are_pruned_to_keep_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    job = root / "job-1" / "shard-0-of-1"  # a job checkpoint's part: the job prunes those
    job.mkdir(parents=True)
    ps = await _started(tmp_path, keep_checkpoints=2)
    try:
        async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http, \
                PSClient([ps.address]) as client:
            await _checkpoint(http, "a", False)
            await client.lookup("user", np.arange(5, dtype=np.uint64))
            await _checkpoint(http, "b", True)   # chains to a
            await _checkpoint(http, "c", True)   # chains to b
            await _checkpoint(http, "d", False)
            # kept: c, d and what c chains to (b, a): nothing removed yet
            assert sorted(p.name for p in root.iterdir()) == ["a", "b", "c", "d", "job-1"]
            await _checkpoint(http, "e", False)  # kept: d, e
            listed = [c["checkpoint_id"] for c in (await http.get("/v1/checkpoints")).json()]
            assert listed == ["d", "e"]
            assert sorted(p.name for p in root.iterdir()) == ["d", "e", "job-1"]
            restored = await http.post("/v1/checkpoints/d/restore")
            assert restored.status_code == 200 and restored.json()["rows"]["user"] == 5
    finally:
        await ps.close()


async def test_keep_checkpoints_zero_keeps_every_one(tmp_path):
    ps = await _started(tmp_path)
    try:
        async with httpx.AsyncClient(base_url=ps.admin_url, timeout=10) as http:
            for checkpoint_id in "abcd":
                await _checkpoint(http, checkpoint_id, False)
        assert len(list((tmp_path / "ckpt").iterdir())) == 4
    finally:
        await ps.close()


async def test_a_crashs_staging_directories_are_removed_at_start(tmp_path):
    root = tmp_path / "ckpt"
    mine = root / "a" / ".tmp-shard-0-of-1-0123abcd"
    other = root / "a" / ".tmp-shard-1-of-2-0123abcd"  # another shard's: it may be writing
    for staging in (mine, other):
        staging.mkdir(parents=True)
        (staging / "t0-rows.npy").write_bytes(b"half")
    (root / "a" / "shard-0-of-1").mkdir()
    (root / "a" / "shard-0-of-1" / "manifest.json").write_text(json.dumps({"format": 0}))
    ps = await _started(tmp_path)
    try:
        assert not mine.exists() and other.exists()
        assert (root / "a" / "shard-0-of-1" / "manifest.json").exists()
    finally:
        await ps.close()
