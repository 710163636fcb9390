"""Coordination: who is where, and the job's state, behind one small interface.

Members (PS shards, loaders, workers) register an address under a TTL and keep it alive with
a :class:`Heartbeat`; a member that stops refreshing (a killed process) disappears when its
TTL runs out. Others discover them with :meth:`Registry.members` or wait for a full set of
PS shards with :func:`discover_shards`. The job state is a small dict (global ``step``, the
latest complete ``checkpoint`` manifest, the dense model ``dense_version``).

Two implementations:

- :class:`RedisRegistry` (``redis://host:port/db?job=NAME``): one key per member with a
  ``PX`` expiry, the job state in one hash; for clusters (compose, Kubernetes).
- :class:`InProcessRegistry` (``memory://NAME``): a dict in this process, for the embedded
  mode and unit tests; registries opened with the same name share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit, urlunsplit

from services.common.errors import ConfigError, InvalidArgument, Unavailable
from services.common.lifecycle import cancel_and_wait, raise_if_cancelled

__all__ = ["Heartbeat", "InProcessRegistry", "Member", "RedisRegistry", "Registry",
           "discover_shards", "open_registry"]

log = logging.getLogger(__name__)

KINDS = ("ps", "loader", "worker")


@dataclass(slots=True, frozen=True)
class Member:
    """One registered process: ``index`` is the shard id (PS) or rank (worker) of ``count``."""

    kind: str
    index: int
    address: str
    count: int = 1
    admin_url: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"member kind must be one of {KINDS}, got {self.kind!r}")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise InvalidArgument(f"member index must be in [0, {self.count}), got {self.index}")
        if not self.address:
            raise InvalidArgument("member address must not be empty")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Member:
        return cls(**json.loads(raw))


class Registry(Protocol):
    """Registration with a TTL, discovery, and the job's state."""

    job: str

    async def register(self, member: Member, ttl_s: float) -> None:
        """Add or refresh ``member``; it disappears ``ttl_s`` seconds after the last call."""

    async def deregister(self, kind: str, index: int) -> None:
        """Remove a member now (a clean exit)."""

    async def members(self, kind: str) -> list[Member]:
        """Live members of ``kind``, ordered by index."""

    async def state(self) -> dict[str, Any]:
        """The job state: ``step``, ``checkpoint``, ``dense_version`` and any other fields."""

    async def update_state(self, **fields: Any) -> None:
        """Set job state fields (JSON-serialisable values)."""

    async def close(self) -> None:
        """Release connections."""


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}")


class InProcessRegistry:
    """The embedded registry: members and state in dicts, TTLs against ``clock``."""

    def __init__(self, job: str = "default",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job = job
        self._clock = clock
        self._members: dict[tuple[str, int], tuple[Member, float]] = {}
        self._state: dict[str, Any] = {}

    async def register(self, member: Member, ttl_s: float) -> None:
        _check_ttl(ttl_s)
        self._members[(member.kind, member.index)] = (member, self._clock() + ttl_s)

    async def deregister(self, kind: str, index: int) -> None:
        self._members.pop((kind, index), None)

    async def members(self, kind: str) -> list[Member]:
        now = self._clock()
        for key in [k for k, (_, expiry) in self._members.items() if expiry <= now]:
            del self._members[key]
        return sorted((m for (k, _), (m, _) in self._members.items() if k == kind),
                      key=lambda m: m.index)

    async def state(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._state))  # a copy, as a remote store would give

    async def update_state(self, **fields: Any) -> None:
        self._state.update(json.loads(json.dumps(fields)))

    async def close(self) -> None:
        """Nothing to release: the dicts live as long as the process."""


class RedisRegistry:
    """Members as ``persimmon:<job>:member:<kind>:<index>`` keys with a PX expiry; the job
    state as the hash ``persimmon:<job>:state`` (one JSON value per field)."""

    def __init__(self, url: str, job: str = "default") -> None:
        import redis.asyncio as aioredis

        self.job = job
        self.url = url
        self._redis = aioredis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self._prefix = f"persimmon:{job}:"

    def _member_key(self, kind: str, index: int) -> str:
        return f"{self._prefix}member:{kind}:{index}"

    async def _call(self, what: str, coro: Any) -> Any:
        import redis.exceptions

        try:
            return await coro
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            raise Unavailable(f"registry {self.url}: {what} failed: {exc}") from exc

    async def register(self, member: Member, ttl_s: float) -> None:
        _check_ttl(ttl_s)
        key = self._member_key(member.kind, member.index)
        await self._call("register", self._redis.set(key, member.to_json(),
                                                      px=max(1, int(ttl_s * 1000))))

    async def deregister(self, kind: str, index: int) -> None:
        await self._call("deregister", self._redis.delete(self._member_key(kind, index)))

    async def members(self, kind: str) -> list[Member]:
        keys = await self._call("members", self._keys(f"{self._prefix}member:{kind}:*"))
        values = await self._call("members", self._redis.mget(keys)) if keys else []
        found = [Member.from_json(v) for v in values if v is not None]  # expired meanwhile
        return sorted(found, key=lambda m: m.index)

    async def _keys(self, pattern: str) -> list[bytes]:
        return [k async for k in self._redis.scan_iter(match=pattern)]

    async def state(self) -> dict[str, Any]:
        raw = await self._call("state", self._redis.hgetall(self._prefix + "state"))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def update_state(self, **fields: Any) -> None:
        if fields:
            mapping: dict[Any, Any] = {k: json.dumps(v) for k, v in fields.items()}
            await self._call("update_state", self._redis.hset(self._prefix + "state",
                                                              mapping=mapping))

    async def close(self) -> None:
        await self._redis.aclose()


_IN_PROCESS: dict[str, InProcessRegistry] = {}


def open_registry(url: str) -> Registry:
    """``redis://host:port/db?job=NAME`` (or ``rediss://``) or ``memory://NAME``."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    job = query.pop("job", ["default"])[0]
    if parts.scheme == "memory":
        name = parts.netloc or job
        return _IN_PROCESS.setdefault(name, InProcessRegistry(job=name))
    if parts.scheme in ("redis", "rediss"):
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        return RedisRegistry(urlunsplit(parts._replace(query=rest)), job=job)
    raise ConfigError(f"registry URL {url!r} must start with redis://, rediss:// or memory://")


class Heartbeat:
    """Keeps ``member`` registered: registers at :meth:`start`, refreshes every ``ttl_s/3``
    seconds, deregisters at :meth:`close`. A failed refresh is logged and retried."""

    def __init__(self, registry: Registry, member: Member, ttl_s: float = 5.0) -> None:
        _check_ttl(ttl_s)
        self.registry = registry
        self.member = member
        self.ttl_s = ttl_s
        self._task: asyncio.Task[None] | None = None
        self._owns_registry = False

    @classmethod
    async def join(cls, url: str, member: Member, ttl_s: float = 5.0) -> Heartbeat:
        """Open the registry at ``url`` and start; :meth:`close` also closes the registry."""
        beat = cls(open_registry(url), member, ttl_s)
        beat._owns_registry = True
        try:
            await beat.start()
        except BaseException:
            await beat.registry.close()
            raise
        return beat

    async def start(self) -> None:
        await self.registry.register(self.member, self.ttl_s)
        self._task = asyncio.create_task(self._beat(), name=f"heartbeat {self.member.kind}")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.registry.register(self.member, self.ttl_s)
            except Unavailable as exc:
                log.warning("heartbeat of %s %d failed: %s", self.member.kind,
                            self.member.index, exc.message)
            raise_if_cancelled()  # a cancel redis-py lost still stops the heartbeat

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
            with contextlib.suppress(Unavailable):
                await self.registry.deregister(self.member.kind, self.member.index)
        if self._owns_registry:
            await self.registry.close()


async def discover_shards(registry: Registry, *, timeout_s: float = 60.0,
                          poll_s: float = 0.1) -> list[Member]:
    """Wait until PS shards ``0..n-1`` of one ``n`` are all registered; return them in order."""
    deadline = time.monotonic() + timeout_s
    while True:
        shards = await registry.members("ps")
        raise_if_cancelled()
        if shards:
            count = shards[0].count
            if [m.index for m in shards if m.count == count] == list(range(count)):
                return [m for m in shards if m.count == count]
        if time.monotonic() > deadline:
            seen = [(m.index, m.count) for m in shards]
            raise Unavailable(f"registry job {registry.job!r}: PS shards not all registered "
                              f"within {timeout_s}s (seen (shard, of): {seen})")
        await asyncio.sleep(poll_s)
