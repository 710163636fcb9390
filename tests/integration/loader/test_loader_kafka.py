"""Kafka source against a real Kafka-protocol broker (librdkafka's mock cluster): explicit
partition assignment, commits after acks, restart with no record lost,
JSON messages, and a dead-letter topic."""

from __future__ import annotations

import json

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from services.loader.sources.kafka import produce_file
from tests.conftest import eventually
from tests.integration.loader.loader_support import MOCK_PARTITIONS, consume_until

pytestmark = pytest.mark.service

SPEC = "dense=2&sparse=2"


def write_rows(path, n: int) -> None:
    path.write_text("".join(f"{i % 2}\t{i}\t{2 * i}\tc{i % 5}\tx{i}\n" for i in range(n)))


def first_positions(batches) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in batches:
        for key, (first, _) in b.positions.items():
            out[key] = min(first, out.get(key, first))
    return out


async def test_commit_after_ack_and_restart_without_loss(kafka, tmp_path, start_loader):
    topic = kafka.create_topic()
    write_rows(tmp_path / "rows.txt", 1000)
    assert await produce_file(kafka.bootstrap, topic, str(tmp_path / "rows.txt")) == 1000
    source = f"kafka://{kafka.bootstrap}/{topic}?group=g1&{SPEC}"
    first = await start_loader(source=source, batch_size=40, poll_records=60,
                               dense_log1p=False)
    acked_batches, _ = await consume_until(first.address, set(range(1000)), ack_first=6)
    acked_rows = {int(v) for b in acked_batches[:6] for v in b.dense[:, 0]}
    await eventually(lambda: any(o["committed"] for o in first.source.offsets().values()))
    await first.close()

    second = await start_loader(source=source, batch_size=40, poll_records=60,
                                dense_log1p=False)
    # the group's committed offsets as the broker has them, read by the new loader at start
    committed = {k: o["committed"] or 0 for k, o in second.source.offsets().items()}
    assert 0 < sum(committed.values()) <= len(acked_rows) < 1000
    batches, seen = await consume_until(second.address, set(range(1000)) - acked_rows)
    assert acked_rows | seen == set(range(1000))  # no record lost
    starts = first_positions(batches)
    for key, offset in committed.items():
        assert starts.get(key, offset) == offset  # each partition resumes at its commit
    await eventually(lambda: all(o["lag"] == 0 for o in second.source.offsets().values()))
    assert second.source.describe()["partitions"] == [0, 1, 2, 3]


async def test_replicas_split_the_partitions(kafka, start_loader):
    topic = kafka.create_topic()
    source = f"kafka://{kafka.bootstrap}/{topic}?group=g2"
    a = await start_loader(source=source, replica=0, replicas=2)
    b = await start_loader(source=source, replica=1, replicas=2)
    assert a.source.describe()["partitions"] == [0, 2]
    assert b.source.describe()["partitions"] == [1, 3]


async def test_json_messages_and_dead_letter_topic(kafka, tmp_path, start_loader):
    topic, dlq = kafka.create_topic(), kafka.create_topic()
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: clicked\ndense: [price]\nsparse: [user, tags]\n")
    good = [{"clicked": i % 2, "price": float(i), "user": f"u{i}", "tags": ["a", "b"][: i % 3]}
            for i in range(20)]
    payloads = [json.dumps(m).encode() for m in good]
    payloads[5] = b'{"clicked": 1, "price": '           # not JSON
    payloads[9] = b'{"clicked": "yes", "price": 3}'    # label not a number
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    for p in payloads:
        producer.produce(topic, p, partition=0)
    assert producer.flush(10) == 0
    loader = await start_loader(
        source=f"kafka://{kafka.bootstrap}/{topic}?group=g3&format=json&schema={schema}"
               f"&dead_letter={dlq}", batch_size=6, dense_log1p=False)
    want = set(range(20)) - {5, 9}
    batches, seen = await consume_until(loader.address, want)
    assert seen == want
    rows = {int(v): b for b in batches for v in b.dense[:, 0]}
    assert rows[4].sparse["user"].values.size > 0
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "dlq-reader"})
    consumer.assign([TopicPartition(dlq, p, 0) for p in range(MOCK_PARTITIONS)])
    try:
        dead = []
        while len(dead) < 2:
            dead += [m for m in consumer.consume(10, 2.0) if m.error() is None]
    finally:
        consumer.close()
    reasons = sorted((dict(m.headers())["offset"], dict(m.headers())["reason"]) for m in dead)
    assert reasons == [(b"5", b"invalid_json"), (b"9", b"label_not_numeric")]
    assert dead[0].value() in (payloads[5], payloads[9])
    assert loader.pipeline.stats()["malformed"] == {"invalid_json": 1, "label_not_numeric": 1}
