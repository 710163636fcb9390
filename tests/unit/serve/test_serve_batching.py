"""Micro-batching and version swaps against real Predictors (no sockets)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from serve_versions import MakeVersion, ps_initial_rows

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.serve.batching import MicroBatcher
from services.serve.predictor import Predictor
from services.serve.versions import LOADER_NICE, VersionManager

RECORD = {"I1": 1, "I2": 2.5, "C1": "a", "C2": 7, "C3": "x|y"}


def body(n: int, **change: object) -> dict:
    return {"records": [{**RECORD, "C1": f"a{i}", **change} for i in range(n)]}


def _batcher(tmp_path: Path, make_version: MakeVersion, *, max_records: int,
             max_queued_records: int) -> tuple[str, Predictor, MicroBatcher, list[int]]:
    """A new version, its Predictor, and a (not started) batcher over it that notes each
    batch's size in the returned list."""
    version_id = make_version()["version_id"]
    predictor = Predictor.load(tmp_path / "models" / version_id, initial_rows=ps_initial_rows)
    batches: list[int] = []
    batcher = MicroBatcher(lambda: predictor, max_records=max_records, max_wait_s=0.5,
                           max_queued_records=max_queued_records,
                           on_batch=lambda n, _: batches.append(n))
    return version_id, predictor, batcher, batches


async def test_requests_that_wait_together_share_one_forward_pass(
        tmp_path: Path, make_version: MakeVersion) -> None:
    version_id, predictor, batcher, batches = _batcher(
        tmp_path, make_version, max_records=100, max_queued_records=1000)
    batcher.start()
    try:
        sizes = [1, 3, 2, 4]
        results = await asyncio.gather(*(batcher.submit(body(n), n) for n in sizes),
                                       batcher.submit(body(1, C9=1), 1), return_exceptions=True)
    finally:
        await batcher.close()
    assert batches == [10]  # the bad request fails alone, the others in one pass
    assert isinstance(results[-1], InvalidArgument)
    for n, answer in zip(sizes, results[:4], strict=True):
        alone = predictor.predict(predictor.featurize(body(n)))
        np.testing.assert_allclose(answer.probabilities, alone, atol=1e-6)
        assert answer.version_id == version_id


async def test_batches_close_at_max_records_and_queue_is_bounded(
        tmp_path: Path, make_version: MakeVersion) -> None:
    _, _, batcher, batches = _batcher(tmp_path, make_version, max_records=4,
                                      max_queued_records=10)
    with pytest.raises(Unavailable):  # not started
        await batcher.submit(body(1), 1)
    batcher.start()
    try:
        tasks = [asyncio.ensure_future(batcher.submit(body(2), 2)) for _ in range(5)]
        await asyncio.sleep(0)  # they queue (a yield to the loop, not a wait for time)
        with pytest.raises(Unavailable, match="waiting"):
            await batcher.submit(body(2), 2)  # 10 records wait already
        await asyncio.gather(*tasks)
    finally:
        await batcher.close()
    assert batches == [4, 4, 2]


async def test_version_manager_follows_the_newest_loadable(
        tmp_path: Path, make_version: MakeVersion) -> None:
    manager = VersionManager(tmp_path / "models", initial_rows=ps_initial_rows)
    assert not await manager.refresh() and manager.current() is None
    first = make_version(step=1, seed=1)["version_id"]
    assert await manager.refresh() and manager.current().version_id == first
    assert not await manager.refresh()
    second = make_version(step=2, seed=2)
    (tmp_path / "models" / second["version_id"] / "dense.safetensors").write_bytes(b"corrupt")
    assert not await manager.refresh()  # refused: the first keeps serving
    assert manager.current().version_id == first and second["version_id"] in manager.refused
    third = make_version(step=3, seed=3)["version_id"]
    assert await manager.refresh() and manager.current().version_id == third
    assert manager.swaps == 2
    with pytest.raises(NotFound):
        await manager.activate("v-missing")


async def test_versions_load_in_a_thread_below_the_answering_threads_priority(
        tmp_path: Path, make_version: MakeVersion, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = VersionManager(tmp_path / "models", initial_rows=ps_initial_rows)
    make_version(step=1, seed=1)
    threads: list[tuple[int, int]] = []
    load = Predictor.load

    def watched(*args: object, **kwargs: object) -> Predictor:
        tid = threading.get_native_id()
        threads.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
        return load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Predictor, "load", watched)
    try:
        assert await manager.refresh()
    finally:
        manager.close()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    (tid, priority), = threads
    assert tid != threading.get_native_id() and priority == min(mine + LOADER_NICE, 19)
