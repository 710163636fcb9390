"""``kafka://HOST:PORT/TOPIC?group=G``: a topic of Criteo lines or JSON objects (aiokafka).

Partitions are assigned explicitly (``assign()``, no group rebalancing): replica r of n
reads the partitions p with ``p % n == r``, so placement is deterministic. Reading starts
at the group's committed offset (earliest when there is none). An offset is committed only
when every record before it was acknowledged by a worker (see
:class:`~services.loader.batching.ChunkTracker`), so a restarted loader loses nothing. Under
job cuts (:meth:`KafkaSource.rewind`, the loader's ``--checkpoint-dir``) reading starts at
the cut's offsets instead, and offsets are committed only for complete cuts
(:meth:`KafkaSource.commit_positions`).
Malformed records go to the ``dead_letter`` topic when one is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from services.common.errors import NotFound, Unavailable
from services.loader.batching import Settled
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.sources.base import SourceBlock, parsed_block
from services.loader.sources.messages import MessageParser

__all__ = ["KafkaSource", "produce_file"]

log = logging.getLogger("persimmon.loader.kafka")


class KafkaSource:
    def __init__(self, spec: SourceSpec, config: LoaderConfig) -> None:
        self.spec = spec
        self.config = config
        self.topic = spec.topic
        self.group = spec.params["group"]
        self.parser = MessageParser(spec, config.dense_transform())
        self.schema = self.parser.schema
        self.dead_letter_topic = spec.params.get("dead_letter") or None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._partitions: list[TopicPartition] = []
        self._committed: dict[int, int] = {}
        self._read: dict[int, int] = {}
        self._rewind: dict[str, int] = {}
        self.records = 0
        self.malformed = 0

    def _key(self, partition: int) -> str:
        return f"kafka:{self.topic}:{partition}"

    async def _partitions_of_topic(self) -> list[int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.spec.target)
        try:
            await admin.start()
            (info,) = await admin.describe_topics([self.topic])
        except KafkaError as exc:
            raise Unavailable(f"cannot reach Kafka at {self.spec.target}: {exc}") from exc
        finally:
            await admin.close()
        if info.get("error_code") or not info.get("partitions"):
            raise NotFound(f"Kafka topic {self.topic!r} does not exist at {self.spec.target} "
                           f"(error code {info.get('error_code')})")
        return sorted(p["partition"] for p in info["partitions"])

    async def start(self) -> None:
        parts = await self._partitions_of_topic()
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.spec.target, group_id=self.group, enable_auto_commit=False,
            auto_offset_reset="earliest", client_id=f"persimmon-loader-{self.config.replica}")
        try:
            await consumer.start()
        except KafkaError as exc:
            await consumer.stop()
            raise Unavailable(f"cannot reach Kafka at {self.spec.target}: {exc}") from exc
        mine = [p for p in parts if p % self.config.replicas == self.config.replica]
        self._partitions = [TopicPartition(self.topic, p) for p in mine]
        consumer.assign(self._partitions)
        for tp in self._partitions:
            committed = await consumer.committed(tp)
            if committed is not None:
                self._committed[tp.partition] = committed
            start = self._rewind.get(self._key(tp.partition), committed)
            if start is not None:
                consumer.seek(tp, start)
        self._consumer = consumer
        if self.dead_letter_topic:
            self._producer = AIOKafkaProducer(bootstrap_servers=self.spec.target)
            await self._producer.start()
        log.info("kafka %s: reading partitions %s of topic %s as group %s", self.spec.target,
                 mine, self.topic, self.group)

    async def blocks(self) -> AsyncIterator[SourceBlock]:
        if self._consumer is None:
            raise Unavailable("the Kafka source is not started")
        while True:
            try:
                fetched = await self._consumer.getmany(timeout_ms=self.config.poll_timeout_ms,
                                                       max_records=self.config.poll_records)
            except KafkaError as exc:
                log.warning("kafka fetch failed, retrying: %s", exc)
                await asyncio.sleep(self.config.poll_timeout_ms / 1000)
                continue
            for tp, messages in sorted(fetched.items(), key=lambda kv: kv[0].partition):
                if not messages:
                    continue
                offsets = np.fromiter((m.offset for m in messages), dtype=np.int64,
                                      count=len(messages))
                parsed = await asyncio.to_thread(self.parser.parse,
                                                 [m.value for m in messages])
                block = parsed_block(self._key(tp.partition), parsed, offsets,
                                     int(offsets[0]), int(offsets[-1]),
                                     {"partition": tp.partition})
                self.records += block.size
                self.malformed += len(block.bad)
                self._read[tp.partition] = int(offsets[-1]) + 1
                yield block

    async def commit(self, settled: Settled) -> None:
        if self._consumer is None or not settled.advanced:
            return
        offsets = {TopicPartition(self.topic, c.meta["partition"]): c.last + 1
                   for c in settled.advanced.values()}
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:  # the next commit carries a later offset of the partition
            log.warning("kafka commit failed (will retry with the next one): %s", exc)
            return
        for tp, offset in offsets.items():
            self._committed[tp.partition] = offset

    def rewind(self, positions: dict[str, int]) -> None:
        """Read, from :meth:`start` on, each partition named in ``positions`` (a cut's) from
        its position there; the others from the group's committed offset."""
        self._rewind = dict(positions)

    async def commit_positions(self, positions: dict[str, int]) -> dict[str, int]:
        """Commit a complete cut's offsets of this source's partitions; returns them."""
        if self._consumer is None:
            raise Unavailable("the Kafka source is not started")
        offsets = {tp: positions[self._key(tp.partition)] for tp in self._partitions
                   if self._key(tp.partition) in positions}
        if offsets:
            try:
                await self._consumer.commit(offsets)
            except KafkaError as exc:
                raise Unavailable(f"kafka commit failed: {exc}") from exc
        for tp, offset in offsets.items():
            self._committed[tp.partition] = offset
        return {self._key(tp.partition): offset for tp, offset in offsets.items()}

    async def dead_letter(self, block: SourceBlock) -> None:
        if self._producer is None or not block.bad:
            return
        for record in block.bad:
            headers = [("reason", record.reason.encode()), ("source", block.partition.encode()),
                       ("offset", str(record.position).encode())]
            await self._producer.send(self.dead_letter_topic, record.raw or b"", headers=headers)
        await self._producer.flush()

    def offsets(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for tp in self._partitions:
            high = self._consumer.highwater(tp) if self._consumer is not None else None
            committed = self._committed.get(tp.partition)
            base = committed if committed is not None else 0
            out[self._key(tp.partition)] = {
                "committed": committed, "read": self._read.get(tp.partition, base),
                "highwater": high, "lag": (high - base) if high is not None else None}
        return out

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec.text, "kind": "kafka", "topic": self.topic,
                "group": self.group, "partitions": [tp.partition for tp in self._partitions],
                "format": self.parser.format, "dead_letter": self.dead_letter_topic,
                "records": self.records, "malformed": self.malformed, **self.schema.describe()}

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


async def produce_file(bootstrap: str, topic: str, path: str, *, batch_lines: int = 10000,
                       partitions: int | None = None) -> int:
    """Send every line of a file (plain or gzip) as one record; returns the count.

    Records go round-robin over the topic's partitions (or the first ``partitions``).
    """
    from services.loader.sources.files import read_text_blocks

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        await producer.start()
        parts = sorted(await producer.partitions_for(topic))
    except KafkaError as exc:
        await producer.stop()
        raise Unavailable(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    if partitions:
        parts = parts[:partitions]
    sent = 0
    try:
        for kind, data, _ in read_text_blocks(path, 1 << 20):
            if kind != "lines":
                log.warning("%s: %s after %d lines; the rest is not sent", path, kind, sent)
                continue
            for line in data.splitlines():
                if line:
                    await producer.send(topic, line, partition=parts[sent % len(parts)])
                    sent += 1
                    if sent % batch_lines == 0:
                        await producer.flush()
        await producer.flush()
    finally:
        await producer.stop()
    return sent
