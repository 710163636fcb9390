"""Loader fixtures: a real loader on port 0, a Kafka-protocol broker, a consuming worker.

The Kafka broker is librdkafka's mock cluster (created by a confluent-kafka AdminClient with
``test.mock.num.brokers``), a real Kafka-protocol server on a loopback port; the loader
talks to it like to any broker. A topic is created on first use (a metadata
request for it) with the mock's default of 4 partitions.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from tests.integration.loader.loader_support import MOCK_PARTITIONS


@dataclasses.dataclass
class MockKafka:
    admin: AdminClient
    bootstrap: str

    def create_topic(self, name: str | None = None) -> str:
        """A fresh topic with MOCK_PARTITIONS partitions; returns its name."""
        topic = name or f"t-{uuid.uuid4().hex[:8]}"
        meta = self.admin.list_topics(topic=topic, timeout=10)
        assert len(meta.topics[topic].partitions) == MOCK_PARTITIONS
        return topic


@pytest.fixture(scope="session")
def kafka() -> Iterator[MockKafka]:
    admin = AdminClient({"test.mock.num.brokers": 1, "log_level": 3})
    brokers = admin.list_topics(timeout=10).brokers
    broker = next(iter(brokers.values()))
    yield MockKafka(admin, f"{broker.host}:{broker.port}")
    del admin  # the mock cluster lives as long as its client


@pytest.fixture
async def start_loader() -> AsyncIterator[Callable[..., Any]]:
    """``await start_loader(source=..., **config)`` → a started LoaderService (closed after)."""
    started: list[LoaderService] = []

    async def start(**overrides: Any) -> LoaderService:
        fields = {"grpc_port": 0, "admin_port": 0, "batch_size": 100, **overrides}
        service = LoaderService(LoaderConfig(**fields))
        await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.close()

