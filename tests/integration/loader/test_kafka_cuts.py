"""Exactly once across a crash: a Kafka job cut by its workers, stopped after pushes the cut
does not hold, then resumed from the cut (PS restored, loader at the cut's positions), counts
every record once. Real PS shards and loader on port 0, librdkafka's mock cluster; the
workers are two ranks of ``bench.chaos_worker.counting_worker`` in this event loop."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition

from bench.chaos import expected_counts, produce_records, source_records
from bench.chaos_worker import counting_worker
from clients.ps_client import PSClient
from services.common.checkpoints import latest_complete
from services.common.checkpoints.positions import POSITIONS_PART, cut_positions, encode_positions
from services.common.errors import (
    ConfigError,
    InvalidArgument,
    NotFound,
)
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from services.ps.config import PSConfig
from services.ps.service import PSService
from services.worker.job_checkpoints import JobCheckpointer
from tests.integration.loader.loader_support import MOCK_PARTITIONS
from tests.unit.ps.counting import counting_table

STEPS, CUT_EVERY, BATCH = 12, 4, 50  # per rank; 2 ranks: 1,200 records


async def _committed(bootstrap: str, topic: str) -> dict[str, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "g",
                         "enable.auto.commit": False})
    try:
        parts = [TopicPartition(topic, p) for p in range(MOCK_PARTITIONS)]
        done = await asyncio.to_thread(consumer.committed, parts, timeout=10)
        return {f"kafka:{topic}:{tp.partition}": tp.offset for tp in done if tp.offset >= 0}
    finally:
        consumer.close()


@pytest.fixture
async def shards(tmp_path):
    started = []
    for k in range(2):
        service = PSService(PSConfig(shard_id=k, num_shards=2, grpc_port=0, admin_port=0,
                                     tables=[counting_table(dim=1)],
                                     checkpoint_dir=str(tmp_path / "ckpt")))
        await service.start()
        started.append(service)
    yield started
    for service in started:
        await service.close()


async def test_a_resume_from_the_cut_replays_exactly_the_records_after_it(
        kafka, start_loader, shards, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    topic = kafka.create_topic()
    spec = f"kafka://{kafka.bootstrap}/{topic}?group=g&dense=1&sparse=3"
    records = source_records(2 * STEPS * BATCH, seed=3)
    produce_records(kafka.bootstrap, topic, records, MOCK_PARTITIONS)
    record_ids, expected = expected_counts(spec, records)
    ps, admin = [s.address for s in shards], [s.admin_url for s in shards]
    await JobCheckpointer(root, admin_urls=admin).checkpoint(
        0, "cut-start", parts={POSITIONS_PART: encode_positions({})})

    async def job(run: str, leave_after: int | None, commit: bool) -> list[int]:
        loader = await start_loader(source=spec, batch_size=BATCH, world_size=2,
                                    checkpoint_dir=root, poll_timeout_ms=20)
        async with asyncio.timeout(60):
            reached = await asyncio.gather(*(counting_worker(
                root=root, run=run, rank=r, ps=ps, ps_admin=admin, loader=loader.address,
                loader_admin=loader.admin_url if commit else None, steps=STEPS, cut_every=CUT_EVERY, window=3,
                leave_after=leave_after) for r in range(2)))
        await loader.close()  # what a crash leaves: the source's commits are the cuts' only
        return list(reached)

    # steps 5 and 6 pushed, in no cut; the cut's commit to Kafka lost (as in a crash after
    # the manifest): the resume must start at the cut, not at the group's offsets
    assert await job("0", leave_after=6, commit=False) == [6, 6]
    cut = latest_complete(root)
    assert cut is not None and cut["step"] == CUT_EVERY
    assert sum(cut_positions(root).values()) == 2 * CUT_EVERY * BATCH
    assert await _committed(kafka.bootstrap, topic) == {}  # acks commit nothing

    for service in shards:  # the job's restart: every shard back to the cut
        await service.shard.restore(cut["checkpoint_id"])
    assert await job("1", leave_after=None, commit=True) == [STEPS, STEPS]

    ids = np.array(sorted(expected), dtype=np.uint64)
    async with PSClient(ps) as client:
        rows = (await client.lookup("count", ids))[:, 0]
        per_record = (await client.lookup("count", record_ids))[:, 0]
    assert np.array_equal(per_record, np.ones(record_ids.size))  # none lost, none twice
    assert np.array_equal(rows, np.array([expected[i] for i in ids.tolist()], np.float32))
    assert latest_complete(root)["step"] == STEPS
    # Kafka holds the offsets of the last complete cut: the end of every partition
    assert await _committed(kafka.bootstrap, topic) == cut_positions(root)
    assert sum(cut_positions(root).values()) == len(records)


async def test_bad_cut_settings_get_a_clear_error_and_commit_nothing(kafka, start_loader,
                                                              tmp_path) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="shuffle_buffer 0"):
        LoaderConfig(source="synthetic:100", checkpoint_dir=str(root), shuffle_buffer=64)
    with pytest.raises(ConfigError, match="needs a Kafka source"):
        await LoaderService(LoaderConfig(source="synthetic:100", grpc_port=0, admin_port=0,
                                         checkpoint_dir=str(root))).start()
    topic = kafka.create_topic()
    loader = await start_loader(source=f"kafka://{kafka.bootstrap}/{topic}?group=g",
                                checkpoint_dir=str(root))
    with pytest.raises(NotFound, match="absent or incomplete"):
        await loader.pipeline.commit_cut("cut-r-0000000004")
    with pytest.raises(InvalidArgument, match="checkpoint id"):
        await loader.pipeline.commit_cut("../etc")
    assert await _committed(kafka.bootstrap, topic) == {}
