"""``kafka://HOST:PORT/TOPIC?group=G``: a topic of Criteo lines or JSON objects (confluent-kafka).

One C-backed client (librdkafka) consumes and produces. Its calls block, so none runs on the
event loop: the consumer is driven by one dedicated thread, which takes a batch with
``consume(poll_records, poll_timeout_ms)`` and parses it there, per partition, before handing
the blocks to the loop; librdkafka prefetches the next batch meanwhile in its own threads.

Partitions are assigned explicitly (``assign()``, no group rebalancing): replica r of n
reads the partitions p with ``p % n == r``, so placement is deterministic. Reading starts
at the group's committed offset (earliest when there is none). An offset is committed only
when every record before it was acknowledged by a worker (see
:class:`~services.loader.batching.ChunkTracker`), so a restarted loader loses nothing. Under
job cuts (:meth:`KafkaSource.rewind`, the loader's ``--checkpoint-dir``) reading starts at
the cut's offsets instead, and offsets are committed only for complete cuts
(:meth:`KafkaSource.commit_positions`).
Malformed records go to the ``dead_letter`` topic when one is given: a block's records are
queued at once and flushed together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from services.common.errors import NotFound, Unavailable
from services.common.retry import Retrying, RetryPolicy
from services.loader.batching import Settled
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.parsers import Parsed
from services.loader.sources.base import SourceBlock, parsed_block
from services.loader.sources.messages import MessageParser

__all__ = ["KafkaSource", "produce_file"]

log = logging.getLogger("persimmon.loader.kafka")

T = TypeVar("T")

#: seconds a metadata, committed-offsets or flush request may take before the broker counts
#: as unreachable
REQUEST_TIMEOUT_S = 10.0
#: bytes one fetch may bring of each partition (librdkafka's default is 1 MiB): larger
#: fetches keep the prefetched queue from running dry between two of them
FETCH_PARTITION_BYTES = 4 << 20


def partitions_of(client: Consumer | Producer, bootstrap: str, topic: str) -> list[int]:
    """The partition numbers of ``topic`` (blocking: call it in a thread)."""
    try:
        meta = client.list_topics(topic, timeout=REQUEST_TIMEOUT_S)
    except KafkaException as exc:
        raise Unavailable(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    info = meta.topics.get(topic)
    if info is None or info.error is not None or not info.partitions:
        error = info.error if info is not None else None
        raise NotFound(f"Kafka topic {topic!r} does not exist at {bootstrap} ({error})")
    return sorted(info.partitions)


def retryable(exc: BaseException) -> bool:
    """Whether a client error may pass on its own (librdkafka marks the fatal ones)."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return not (isinstance(error, KafkaError) and error.fatal())


def _group(messages: list[Message]) -> dict[int, tuple[list[int], list[bytes | None]]]:
    """Offsets and payloads of ``messages`` per partition, in order; errors are logged."""
    out: dict[int, tuple[list[int], list[bytes | None]]] = {}
    for m in messages:
        if m.error() is not None:
            log.warning("kafka fetch error, skipped: %s", m.error())
            continue
        # a message without an error has its partition and offset
        offsets, values = out.setdefault(m.partition(), ([], []))  # type: ignore[arg-type]
        offsets.append(m.offset())  # type: ignore[arg-type]
        values.append(m.value())
    return out


class KafkaSource:
    def __init__(self, spec: SourceSpec, config: LoaderConfig) -> None:
        self.spec = spec
        self.config = config
        self.topic = spec.topic
        self.group = spec.params["group"]
        self.parser = MessageParser(spec, config.dense_transform())
        self.schema = self.parser.schema
        self.dead_letter_topic = spec.params.get("dead_letter") or None
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._thread: ThreadPoolExecutor | None = None  # owns every consume and the close
        self._partitions: list[TopicPartition] = []
        self._committed: dict[int, int] = {}
        self._read: dict[int, int] = {}
        self._rewind: dict[str, int] = {}
        self.records = 0
        self.malformed = 0

    def _key(self, partition: int) -> str:
        return f"kafka:{self.topic}:{partition}"

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the consumer's thread (after any consume in progress)."""
        assert self._thread is not None
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _open(self) -> list[int]:
        """Create the consumer, assign this replica's partitions at their start offsets."""
        consumer = Consumer({
            "bootstrap.servers": self.spec.target, "group.id": self.group,
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "log_level": 3,
            "fetch.message.max.bytes": FETCH_PARTITION_BYTES,
            "client.id": f"persimmon-loader-{self.config.replica}"})
        try:
            parts = partitions_of(consumer, self.spec.target, self.topic)
            mine = [p for p in parts if p % self.config.replicas == self.config.replica]
            committed = consumer.committed([TopicPartition(self.topic, p) for p in mine],
                                           timeout=REQUEST_TIMEOUT_S) if mine else []
        except KafkaException as exc:
            consumer.close()
            raise Unavailable(f"cannot reach Kafka at {self.spec.target}: {exc}") from exc
        except BaseException:
            consumer.close()
            raise
        starts = []
        for tp in committed:
            if tp.offset >= 0:
                self._committed[tp.partition] = tp.offset
            start = self._rewind.get(self._key(tp.partition), self._committed.get(tp.partition))
            starts.append(TopicPartition(self.topic, tp.partition,
                                         OFFSET_BEGINNING if start is None else start))
        consumer.assign(starts)
        self._partitions = [TopicPartition(self.topic, p) for p in mine]
        self._consumer = consumer
        return mine

    async def start(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kafka-consume")
        try:
            mine = await self._in_thread(self._open)
        except BaseException:
            self._thread.shutdown(wait=False)
            self._thread = None
            raise
        if self.dead_letter_topic:
            self._producer = Producer({"bootstrap.servers": self.spec.target,
                                       "linger.ms": 5, "log_level": 3})
        log.info("kafka %s: reading partitions %s of topic %s as group %s", self.spec.target,
                 mine, self.topic, self.group)

    def _fetch(self) -> list[tuple[int, np.ndarray, Parsed]]:
        """One batch from the broker, parsed per partition (runs on the consumer's thread)."""
        assert self._consumer is not None
        # what is queued now, else wait up to poll_timeout_ms for the first record: a batch
        # never waits for a full poll_records while records are ready
        want = self.config.poll_records
        messages = self._consumer.consume(want, 0)
        if not messages:
            messages = self._consumer.consume(1, self.config.poll_timeout_ms / 1000)
            messages += self._consumer.consume(want - 1, 0) if messages and want > 1 else []
        out = []
        for partition, (offsets, values) in sorted(_group(messages).items()):
            out.append((partition, np.asarray(offsets, dtype=np.int64),
                        self.parser.parse(values)))
        return out

    async def blocks(self) -> AsyncIterator[SourceBlock]:
        if self._consumer is None:
            raise Unavailable("the Kafka source is not started")
        # a broker away for a while is waited for, without end (a fatal error ends the source)
        policy = RetryPolicy(deadline_s=None,
                             max_delay_s=max(0.05, self.config.poll_timeout_ms / 1000))
        retrying: Retrying | None = None
        while True:
            try:
                fetched = await self._in_thread(self._fetch)
            except KafkaException as exc:
                retrying = retrying or policy.begin(retryable=retryable, what="kafka fetch")
                await retrying.wait(exc)
                continue
            retrying = None
            for partition, offsets, parsed in fetched:
                block = parsed_block(self._key(partition), parsed, offsets, int(offsets[0]),
                                     int(offsets[-1]), {"partition": partition})
                self.records += block.size
                self.malformed += len(block.bad)
                self._read[partition] = int(offsets[-1]) + 1
                yield block

    async def _commit(self, offsets: list[TopicPartition]) -> None:
        """Commit synchronously in a worker thread; KafkaException on any failure."""
        assert self._consumer is not None
        done = await asyncio.to_thread(self._consumer.commit, offsets=offsets,
                                       asynchronous=False)
        failed = [tp for tp in done or [] if tp.error is not None]
        if failed:
            raise KafkaException(failed[0].error)
        for tp in offsets:
            self._committed[tp.partition] = tp.offset

    async def commit(self, settled: Settled) -> None:
        if self._consumer is None or not settled.advanced:
            return
        offsets = [TopicPartition(self.topic, c.meta["partition"], c.last + 1)
                   for c in settled.advanced.values()]
        try:
            await self._commit(offsets)
        except KafkaException as exc:  # the next commit carries a later offset of the partition
            log.warning("kafka commit failed (will retry with the next one): %s", exc)

    def rewind(self, positions: dict[str, int]) -> None:
        """Read, from :meth:`start` on, each partition named in ``positions`` (a cut's) from
        its position there; the others from the group's committed offset."""
        self._rewind = dict(positions)

    async def commit_positions(self, positions: dict[str, int]) -> dict[str, int]:
        """Commit a complete cut's offsets of this source's partitions; returns them."""
        if self._consumer is None:
            raise Unavailable("the Kafka source is not started")
        offsets = [TopicPartition(self.topic, tp.partition, positions[self._key(tp.partition)])
                   for tp in self._partitions if self._key(tp.partition) in positions]
        if offsets:
            try:
                await self._commit(offsets)
            except KafkaException as exc:
                raise Unavailable(f"kafka commit failed: {exc}") from exc
        return {self._key(tp.partition): tp.offset for tp in offsets}

    async def dead_letter(self, block: SourceBlock) -> None:
        """Queue every bad record of ``block``, then flush them together (in a thread)."""
        topic = self.dead_letter_topic
        if self._producer is None or topic is None or not block.bad:
            return
        errors: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                errors.append(err)

        for record in block.bad:
            headers = [("reason", record.reason.encode()), ("source", block.partition.encode()),
                       ("offset", str(record.position).encode())]
            await _produce(self._producer, topic, record.raw or b"",
                           headers=headers, on_delivery=delivered)
        left = await asyncio.to_thread(self._producer.flush, REQUEST_TIMEOUT_S)
        if left or errors:
            raise Unavailable(f"{left + len(errors)} dead letters of {block.partition} were not "
                              f"delivered to {self.dead_letter_topic!r}: "
                              f"{errors[0] if errors else 'timed out'}")

    def offsets(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for tp in self._partitions:
            high = None
            if self._consumer is not None:  # cached: the high mark of the last fetch, no request
                _, mark = self._consumer.get_watermark_offsets(tp, cached=True)
                high = mark if mark >= 0 else None
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
            consumer, self._consumer = self._consumer, None
            await self._in_thread(consumer.close)  # after a consume still in progress
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await asyncio.to_thread(producer.flush, REQUEST_TIMEOUT_S)


async def _produce(producer: Producer, topic: str, value: bytes, **kw: Any) -> None:
    """``producer.produce``; when its local queue is full, wait in a thread for room."""
    while True:
        try:
            producer.produce(topic, value, **kw)
            producer.poll(0)  # serve delivery callbacks
            return
        except BufferError:
            await asyncio.to_thread(producer.poll, 0.05)


def _produce_file(bootstrap: str, topic: str, path: str, partitions: int | None) -> int:
    from services.loader.sources.files import read_text_blocks

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log_level": 3})
    parts = partitions_of(producer, bootstrap, topic)
    if partitions:
        parts = parts[:partitions]
    errors: list[KafkaError] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(err)

    sent = 0
    for kind, data, _ in read_text_blocks(path, 1 << 20):
        if kind != "lines":
            log.warning("%s: %s after %d lines; the rest is not sent", path, kind, sent)
            continue
        for line in data.splitlines():
            if not line:
                continue
            while True:
                try:
                    producer.produce(topic, line, partition=parts[sent % len(parts)],
                                     on_delivery=delivered)
                    break
                except BufferError:
                    producer.poll(0.05)
            sent += 1
    left = producer.flush(REQUEST_TIMEOUT_S * 6)
    if left or errors:
        raise Unavailable(f"{left + len(errors)} of {sent} records were not delivered to "
                          f"{topic!r} at {bootstrap}: {errors[0] if errors else 'timed out'}")
    return sent


async def produce_file(bootstrap: str, topic: str, path: str, *,
                       partitions: int | None = None) -> int:
    """Send every line of a file (plain or gzip) as one record; returns the count.

    Records go round-robin over the topic's partitions (or the first ``partitions``); the
    producer runs in a thread and batches as librdkafka does (``linger.ms`` 5).
    """
    return await asyncio.to_thread(_produce_file, bootstrap, topic, path, partitions)
