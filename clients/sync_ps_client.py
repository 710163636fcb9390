"""``SyncPSClient``: the embedding PS's client for code without an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from clients.ps_client import PSClient, PushAck
from services.common.messages import StatsReply, TableInfo

__all__ = ["SyncPSClient"]

T = TypeVar("T")


class SyncPSClient:
    """Blocking wrapper: a private event loop in a daemon thread runs a :class:`PSClient`."""

    def __init__(self, addresses: Sequence[str], **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="persimmon-ps-client")
        self._thread.start()
        self._client = PSClient(addresses, **kwargs)
        self._run(self._client.connect())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(self, table: str, ids: Any, *, read_only: bool = False) -> np.ndarray:
        return self._run(self._client.lookup(table, ids, read_only=read_only))

    def push(self, table: str, ids: Any, grads: Any) -> PushAck:
        return self._run(self._client.push(table, ids, grads))

    def tables(self) -> list[TableInfo]:
        return self._run(self._client.tables())

    def stats(self, table: str | None = None) -> list[StatsReply]:
        return self._run(self._client.stats(table))

    def resync(self) -> list[int]:
        return self._run(self._client.resync())

    def close(self) -> None:
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncPSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
