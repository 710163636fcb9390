"""``python -m bench loader --source kafka``: the loader's Kafka source, records/s, against
the aiokafka consumer it replaced, in one run.

A librdkafka mock cluster (one broker on loopback, in this process) holds one topic of
generated Criteo lines over its 4 partitions (at most 60,000 lines: the mock drops a
partition's oldest records past about 5 MB). Each repeat reads the whole topic from the start
under a fresh consumer group, into parsed blocks, and stops at the last record:

- persimmon: :class:`~services.loader.sources.kafka.KafkaSource` (confluent-kafka: one
  thread consumes a batch and parses it per partition; the event loop only receives blocks).
- aiokafka (the baseline, the loader's client until issue 50): ``getmany`` on the event loop,
  one Python record object per message, then the same parser in a worker thread, the loop
  the source ran before (``_AiokafkaReader``). aiokafka is imported here only (the ``bench``
  extra installs it).

Both use the same ``poll_records``, ``poll_timeout_ms``, bytes per partition fetch
(``FETCH_PARTITION_BYTES``) and parser; the sides
alternate, ``--repeat`` times each, and the medians count.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import ConfigError
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.sources.base import parsed_block
from services.loader.sources.kafka import FETCH_PARTITION_BYTES, KafkaSource, produce_file
from services.loader.sources.messages import MessageParser

__all__ = ["run"]

SPEC = "dense=13&sparse=26"
MOCK_ROWS = 60_000  # fits 4 partitions (about 255 bytes a generated Criteo line)


class _AiokafkaReader:
    """The loader's former read loop over aiokafka: every partition from the start."""

    def __init__(self, spec: SourceSpec, config: LoaderConfig, partitions: int) -> None:
        self.spec, self.config, self.partitions = spec, config, partitions
        self.parser = MessageParser(spec, config.dense_transform())

    async def read(self, records: int) -> float:
        """Seconds from the first fetch to the last of ``records`` parsed (start excluded)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(bootstrap_servers=self.spec.target,
                                    group_id=self.spec.params["group"],
                                    enable_auto_commit=False, auto_offset_reset="earliest",
                                    max_partition_fetch_bytes=FETCH_PARTITION_BYTES)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(self.spec.topic, p)
                             for p in range(self.partitions)])
            start, seen = time.perf_counter(), 0
            while seen < records:
                fetched = await consumer.getmany(timeout_ms=self.config.poll_timeout_ms,
                                                 max_records=self.config.poll_records)
                for tp, messages in sorted(fetched.items(), key=lambda kv: kv[0].partition):
                    offsets = np.fromiter((m.offset for m in messages), dtype=np.int64,
                                          count=len(messages))
                    parsed = await asyncio.to_thread(self.parser.parse,
                                                     [m.value for m in messages])
                    block = parsed_block(f"kafka:{tp.partition}", parsed, offsets,
                                         int(offsets[0]), int(offsets[-1]))
                    seen += block.size + len(block.bad)
            return time.perf_counter() - start
        finally:
            await consumer.stop()


async def _persimmon(spec: SourceSpec, config: LoaderConfig, records: int,
                     _partitions: int) -> float:
    source = KafkaSource(spec, config)
    await source.start()
    try:
        start, seen = time.perf_counter(), 0
        async for block in source.blocks():
            seen += block.size + len(block.bad)
            if seen >= records:
                break
        return time.perf_counter() - start
    finally:
        await source.close()


async def _aiokafka(spec: SourceSpec, config: LoaderConfig, records: int,
                    partitions: int) -> float:
    return await _AiokafkaReader(spec, config, partitions).read(records)


async def _repeats(bootstrap: str, topic: str, partitions: int, records: int,
                   repeat: int) -> dict[str, list[float]]:
    sides = {"persimmon": _persimmon, "aiokafka": _aiokafka}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(repeat + 1):  # the first round warms both up and is not counted
        for name, side in (sides.items() if i % 2 else reversed(sides.items())):
            text = f"kafka://{bootstrap}/{topic}?group=b-{uuid.uuid4().hex[:8]}&{SPEC}"
            config = LoaderConfig(source=text)
            took = await side(SourceSpec.parse(text), config, records, partitions)
            if i:
                times[name].append(took)
    return times


def run(*, records: int = MOCK_ROWS, repeat: int = 3) -> dict[str, Any]:
    """Produce ``records`` Criteo lines to a mock cluster, time both readers over them."""
    if records > MOCK_ROWS:
        raise ConfigError(f"--rows {records:,}: the mock broker keeps about 5 MB of each of "
                          f"its 4 partitions; give at most {MOCK_ROWS:,} rows")
    from confluent_kafka.admin import AdminClient

    from bench.loader import write_criteo_file

    admin = AdminClient({"test.mock.num.brokers": 1, "log_level": 3})
    broker = next(iter(admin.list_topics(timeout=10).brokers.values()))
    bootstrap, topic = f"{broker.host}:{broker.port}", "bench-loader"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "criteo.txt"
        size = write_criteo_file(path, records)
        partitions = len(admin.list_topics(topic=topic, timeout=10).topics[topic].partitions)
        asyncio.run(produce_file(bootstrap, topic, str(path)))
    times = asyncio.run(_repeats(bootstrap, topic, partitions, records, repeat))
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"records": records, "partitions": partitions, "record_bytes": size / records,
            "repeat": repeat, "baseline": "aiokafka getmany + the same parser",
            **{f"{name}_records_per_s": records / t for name, t in median.items()},
            "vs_aiokafka": median["aiokafka"] / median["persimmon"], "goal": 1.5}


def show(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="persimmon bench loader --source kafka: records read and parsed "
                        f"({r['records']:,} Criteo lines, {r['partitions']} partitions, "
                        f"librdkafka mock broker; medians of {r['repeat']})")
    for col in ("client", "records/s", "persimmon is", "goal"):
        table.add_column(col, justify="left" if col == "client" else "right")
    table.add_row("persimmon (confluent-kafka, consume + parse in one thread)",
                  f"{r['persimmon_records_per_s']:,.0f}", "", "")
    table.add_row("aiokafka getmany + parse in a thread (the former client)",
                  f"{r['aiokafka_records_per_s']:,.0f}", f"vs_aiokafka = {r['vs_aiokafka']:.2f}x",
                  f">= {r['goal']}")
    Console().print(table)


def main(args: argparse.Namespace) -> dict[str, Any]:
    return run(records=args.rows or MOCK_ROWS, repeat=args.repeat)
