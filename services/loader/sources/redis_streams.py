"""``redis://HOST:PORT/STREAM?group=G``: a Redis stream read through a consumer group.

Each entry carries one record in its ``field`` (``data`` by default). The loader reads as
consumer ``consumer`` (default ``loader-{replica}``): first the entries still pending for
that name (delivered before a restart, never acknowledged), then new ones (``>``). An
entry is ``XACK``-ed only when the batch holding it was acknowledged by a worker (bad
entries once they are dead-lettered), and entries left pending by a dead consumer for
``claim_idle_ms`` are taken over with ``XAUTOCLAIM``. Positions are entry ids packed as
``ms << 20 | seq``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from services.common.errors import InvalidArgument, Unavailable
from services.common.lifecycle import raise_if_cancelled
from services.common.retry import Retrying, RetryPolicy
from services.loader.batching import Settled
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.sources.base import SourceBlock, parsed_block
from services.loader.sources.messages import MessageParser

__all__ = ["RedisStreamSource", "entry_position"]

log = logging.getLogger("persimmon.loader.redis")

_SEQ_BITS = 20


def entry_position(entry_id: bytes | str) -> int:
    """A stream entry id ``ms-seq`` as one int (``ms << 20 | min(seq, 2**20 - 1)``)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return (int(ms) << _SEQ_BITS) | min(int(seq or 0), (1 << _SEQ_BITS) - 1)


class RedisStreamSource:
    def __init__(self, spec: SourceSpec, config: LoaderConfig) -> None:
        self.spec = spec
        self.config = config
        self.stream = spec.topic
        self.group = spec.params["group"]
        self.consumer = spec.params.get("consumer") or f"loader-{config.replica}"
        self.field = spec.params.get("field", "data").encode()
        self.url = f"redis://{spec.target}/{spec.int_param('db', 0)}"
        self.parser = MessageParser(spec, config.dense_transform())
        self.schema = self.parser.schema
        self.partition = f"redis:{self.stream}"
        self._redis: aioredis.Redis | None = None
        self._inflight: set[bytes] = set()
        self._info: dict[str, Any] = {}
        self._last_claim = 0.0
        poll_s = config.poll_timeout_ms / 1000
        self._retry = RetryPolicy(deadline_s=None, first_delay_s=poll_s,
                                  max_delay_s=max(poll_s, 1.0))
        self.records = 0
        self.malformed = 0
        self.acked = 0
        self.claimed = 0

    async def start(self) -> None:
        self._redis = aioredis.Redis.from_url(self.url)
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:  # the group exists (fine), or the key is no stream
            if "BUSYGROUP" not in str(exc):
                await self.close()
                raise InvalidArgument(f"cannot read {self.stream!r} at {self.spec.target} as "
                                      f"a stream: {exc}") from exc
        except RedisError as exc:  # refused, timed out, refused auth
            await self.close()
            raise Unavailable(f"cannot reach Redis at {self.spec.target}: {exc}") from exc
        await self._refresh_info()
        log.info("redis %s: reading stream %s as %s/%s", self.url, self.stream, self.group,
                 self.consumer)

    async def _read(self, start_id: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        assert self._redis is not None
        block = None if start_id != ">" else self.config.poll_timeout_ms
        resp: Any = await self._redis.xreadgroup(self.group, self.consumer,
                                                 {self.stream: start_id},
                                                 count=self.config.poll_records, block=block)
        return list(resp[0][1]) if resp else []

    async def _claim(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries idle for ``claim_idle_ms`` in any consumer, minus those we hold."""
        assert self._redis is not None
        now = time.monotonic()
        if now - self._last_claim < self.config.claim_idle_ms / 2000:
            return []
        self._last_claim = now
        cursor: bytes | str = "0-0"
        out: list[tuple[bytes, dict[bytes, bytes]]] = []
        while True:
            resp: Any = await self._redis.xautoclaim(self.stream, self.group, self.consumer,
                                                self.config.claim_idle_ms, start_id=cursor,
                                                count=self.config.poll_records)
            cursor, entries = resp[0], resp[1]
            out += [(i, f) for i, f in entries if f is not None and i not in self._inflight]
            if cursor in (b"0-0", "0-0") or len(out) >= self.config.poll_records:
                break
        self.claimed += len(out)
        return out

    async def blocks(self) -> AsyncIterator[SourceBlock]:
        start_id = "0"  # first our own pending entries, then new ones
        retrying: Retrying | None = None  # since the last read that worked
        while True:
            raise_if_cancelled()
            try:
                entries = await self._claim()
                if not entries:
                    entries = await self._read(start_id)
                    if start_id != ">":
                        if entries:
                            start_id = entries[-1][0].decode()
                        else:
                            start_id = ">"
                            continue
                if time.monotonic() - self._info.get("at", 0.0) > 1.0:
                    await self._refresh_info()
            except RedisError as exc:  # retried for as long as it lasts
                retrying = retrying or self._retry.begin(what=f"redis read of {self.stream}")
                await retrying.wait(exc)
                continue
            retrying = None
            raise_if_cancelled()  # redis-py can swallow a cancel landing as a reply arrives
            entries = [(i, f) for i, f in entries if i not in self._inflight]
            if not entries:
                continue
            ids = [i for i, _ in entries]
            self._inflight.update(ids)
            positions = np.fromiter((entry_position(i) for i in ids), dtype=np.int64,
                                    count=len(ids))
            parsed = await asyncio.to_thread(self.parser.parse,
                                             [f.get(self.field) for _, f in entries])
            block = parsed_block(self.partition, parsed, positions, int(positions.min()),
                                 int(positions.max()), {"ids": ids})
            self.records += block.size
            self.malformed += len(block.bad)
            yield block

    async def commit(self, settled: Settled) -> None:
        ids = [i for c in settled.done if c.partition == self.partition for i in c.meta["ids"]]
        if not ids or self._redis is None:
            return
        try:
            self.acked += int(await self._redis.xack(self.stream, self.group, *ids))
        except RedisError as exc:  # stays pending; XAUTOCLAIM or a restart re-delivers it
            log.warning("redis XACK failed: %s", exc)
            return
        self._inflight.difference_update(ids)

    async def dead_letter(self, block: SourceBlock) -> None:
        """Bad entries are acknowledged with their chunk; the dead-letter file keeps them."""

    async def _refresh_info(self) -> None:
        assert self._redis is not None
        for group in await self._redis.xinfo_groups(self.stream):
            name = group.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == self.group:
                last = group.get("last-delivered-id", b"0-0")
                self._info = {"at": time.monotonic(), "pending": group.get("pending"),
                              "lag": group.get("lag"),
                              "last_delivered": last.decode() if isinstance(last, bytes)
                              else last}

    def offsets(self) -> dict[str, dict[str, Any]]:
        return {self.partition: {"pending": self._info.get("pending"),
                                 "last_delivered": self._info.get("last_delivered"),
                                 "acked": self.acked, "in_flight": len(self._inflight),
                                 "lag": self._info.get("lag")}}

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec.text, "kind": "redis", "stream": self.stream,
                "group": self.group, "consumer": self.consumer, "format": self.parser.format,
                "records": self.records, "malformed": self.malformed, "claimed": self.claimed,
                **self.schema.describe()}

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
