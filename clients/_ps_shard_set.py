"""Every shard of one PS as :class:`~clients.ps_client.PSClient` holds them: opened and
checked together (address ``i`` must serve shard ``i``), their epochs and tables' dims as
last learned, their byte counters, closed together; and the call budget of a request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable
from typing import TypeVar

from clients._ps_shard import ShardAddresses, ShardConnection, ShardSettings
from services.common import messages as msg
from services.common.codecs import Codec
from services.common.errors import DeadlineExceeded, FailedPrecondition, NotFound

__all__ = ["ShardSet"]

T = TypeVar("T")


class ShardSet:
    """The connections to the shards at ``book`` (in shard order), opened with ``settings``.

    ``dims`` (each known table's dim) is filled at :meth:`open` and by :meth:`tables`; a
    request waits at most ``timeout + retry_s`` for every shard's reply (:meth:`within`).
    """

    def __init__(self, book: ShardAddresses, settings: ShardSettings, timeout: float) -> None:
        self.book, self.settings, self.timeout = book, settings, timeout
        self.budget_s = timeout + settings.retry_s
        self.connections: list[ShardConnection] = []
        self.dims: dict[str, int] = {}

    async def open(self) -> None:
        """Resolve the addresses, open a connection per shard and check that address ``i``
        serves shard ``i`` of ``len(addresses)``; learn the epochs and the tables' dims."""
        await self.book.resolve()
        addresses = self.book.addresses
        self.connections = [ShardConnection(self.settings, self.book, i)
                            for i in range(len(addresses))]
        for i, info in enumerate(await self._tables_of_every_shard()):
            if info.shard_id != i or info.num_shards != len(addresses):
                raise FailedPrecondition(
                    f"{addresses[i]} is shard {info.shard_id} of {info.num_shards}, but the "
                    f"client lists it as shard {i} of {len(addresses)}: give the addresses "
                    "in shard order")
            self._learn_dims(info)
            self.connections[i].epoch = info.epoch or 0

    async def _tables_of_every_shard(self) -> list[msg.TablesReply]:
        return await asyncio.gather(*(s.retried("PS Tables", functools.partial(
            s.unary, "Tables", msg.TablesRequest(), msg.TablesReply, self.timeout))
            for s in self.connections))

    def _learn_dims(self, info: msg.TablesReply) -> None:
        for table in info.tables:
            self.dims[table.name] = table.dim

    @property
    def epochs(self) -> list[int]:
        """Each shard's epoch as last learned (0: a shard without epochs)."""
        return [s.epoch for s in self.connections]

    async def resync(self) -> list[int]:
        """Learn every shard's epoch anew; returns the epochs."""
        infos = await self._tables_of_every_shard()
        for shard, info in zip(self.connections, infos, strict=True):
            shard.epoch = info.epoch or 0
        return self.epochs

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.connections))
        self.connections = []

    async def within(self, pending: Awaitable[T]) -> T:
        """``pending`` within the call budget, else :class:`DeadlineExceeded`."""
        try:
            return await asyncio.wait_for(pending, self.budget_s)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"no reply from the PS within {self.budget_s:g} s "
                                   "(timeout + retry_s)") from exc

    async def tables(self) -> list[msg.TableInfo]:
        """Table configs as the first shard reports them (tables exist on every shard)."""
        info = await self.connections[0].unary("Tables", msg.TablesRequest(), msg.TablesReply,
                                               self.timeout)
        self._learn_dims(info)
        return info.tables

    async def dim(self, table: str) -> int:
        """``table``'s dim, asked of the shards when not known yet (NotFound: no table)."""
        dim = self.dims.get(table)
        if dim is None:
            await self.tables()
            if table not in self.dims:
                raise NotFound(f"table {table!r} does not exist")
            dim = self.dims[table]
        return dim

    async def stats(self, table: str | None = None) -> list[msg.StatsReply]:
        """Every shard's Stats reply, in shard order."""
        return list(await asyncio.gather(*(
            s.unary("Stats", msg.StatsRequest(table=table), msg.StatsReply, self.timeout)
            for s in self.connections)))

    def grads_codecs(self) -> list[Codec]:
        """Every codec the gradients go through, shard by shard."""
        return [codec for s in self.connections for codec in s.grads_codecs()]

    def wire_bytes(self) -> dict[str, int]:
        """Bytes sent and received per stream (pooled lookups and pushes count as lookups
        and pushes, PushThenLookup as a push)."""
        shards = self.connections
        return {
            "lookup_out": sum(s.lookup.bytes_out + s.pooled_lookup.bytes_out for s in shards),
            "lookup_in": sum(s.lookup.bytes_in + s.pooled_lookup.bytes_in for s in shards),
            "push_out": sum(s.push.bytes_out + s.pooled_push.bytes_out
                            + s.push_then_lookup.bytes_out for s in shards),
            "push_in": sum(s.push.bytes_in + s.pooled_push.bytes_in
                           + s.push_then_lookup.bytes_in for s in shards),
        }
