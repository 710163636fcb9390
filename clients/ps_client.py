"""The wire-level client of the embedding PS: ``PSClient`` (blocking: :mod:`clients.sync_ps_client`).

``PSClient`` deduplicates ids, routes each unique id to ``shard_of(id)``, talks to every
shard concurrently over long-lived Lookup/Push streams and returns rows in request order.
Address ``i`` must be shard ``i``: :meth:`PSClient.connect` checks it.

Fault tolerance: with ``retry_s > 0`` a request to a shard that is down is retried with
backoff on a fresh channel for up to ``retry_s`` seconds, the address re-resolved through
``resolver`` (e.g. :meth:`PSClient.from_registry`) first, so a restarted shard on another
address is found. Every push message carries the client's random id and a per-shard sequence
number (:class:`~clients._ps_shards.PushNumbers`); a retry resends the same message, which the
shard applies once and answers with the first ack, also after it recovered from its
write-ahead log (the window of applied pushes is in it and in checkpoints).

Epochs: the client learns each shard's epoch at :meth:`PSClient.connect` and every push
carries it. A shard restored from a checkpoint since (a REST restore, a restart with
``--restore``) is in a newer epoch and refuses the push, retries included, with
:class:`~services.common.errors.StaleEpoch`: the client does not retry it but raises it, as
the rows it was computed from were rolled back. The trainer fails on it (restart the job from
its checkpoint; the new workers learn the new epoch); a caller that can redo its work from the
restored state calls :meth:`PSClient.resync` and goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clients._ps_pooled import PooledCalls
from clients._ps_shards import (
    PushNumbers,
    Resolver,
    ShardAddresses,
    ShardSet,
    ShardSettings,
    check_grads,
    received,
    registry_resolver,
    replies_rows,
)
from services.common import messages as msg
from services.common.auth import ClientSecurity
from services.common.codecs import Codec, WireStats, get_codec
from services.common.codecs.masked import REFRESH as DCT_MP_REFRESH
from services.common.codecs.masked import DCTMPCodec, PooledMasks
from services.common.errors import InvalidArgument
from services.common.sharding import ShardedIds, rows_at, split_by_shard
from services.common.tls import ClientTLS
from services.common.wire import MAX_MESSAGE_BYTES

__all__ = ["PSClient", "PushAck"]


@dataclass(slots=True)
class PushAck:
    """Counts summed over shards: unique ids applied, dropped for NaN/Inf, not admitted."""

    applied: int = 0
    dropped_nonfinite: int = 0
    not_admitted: int = 0


def as_ids(ids: Any) -> np.ndarray:
    """``ids`` as a uint64 array; anything but non-negative integers is an InvalidArgument."""
    ids = np.asarray(ids)
    if ids.dtype != np.uint64:
        if ids.dtype.kind not in "iu" or (ids.size and ids.min() < 0):
            raise InvalidArgument(f"ids must be non-negative integers, got dtype {ids.dtype}")
        ids = ids.astype(np.uint64)
    return ids


def unique_ids(ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique uint64 ids and the inverse index that rebuilds the request order."""
    uniq, inverse = np.unique(as_ids(ids).ravel(), return_inverse=True)
    return uniq, inverse


def sum_duplicates(inverse: np.ndarray, num_unique: int, grads: np.ndarray) -> np.ndarray:
    """Per-unique-id sums of ``grads`` rows (sort-based, no Python loop)."""
    if num_unique == len(inverse):
        out = np.empty_like(grads)
        out[inverse] = grads
        return out
    order = np.argsort(inverse, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(inverse[order]) != 0])
    return np.add.reduceat(grads[order], starts, axis=0)


def _sum_acks(replies: Sequence[msg.PushReply | PushAck]) -> PushAck:
    ack = PushAck()
    for reply in replies:
        ack.applied += reply.applied
        ack.dropped_nonfinite += reply.dropped_nonfinite
        ack.not_admitted += reply.not_admitted
    return ack


class PSClient:
    """Async client of a sharded PS; use ``async with PSClient([...]) as ps``.

    ``token``/``tls`` default to ``PERSIMMON_TOKEN``(``_FILE``) and ``PERSIMMON_TLS_CA``….
    """

    def __init__(self, addresses: Sequence[str], *, rows_codec: str = "none",
                 grads_codec: str = "none", max_message_bytes: int = MAX_MESSAGE_BYTES,
                 timeout: float = 30.0, retry_s: float = 0.0,
                 resolver: Resolver | None = None, token: str | None = None,
                 tls: ClientTLS | None = None) -> None:
        if not addresses and resolver is None:
            raise InvalidArgument("PSClient needs at least one PS address or a resolver")
        if retry_s < 0:
            raise InvalidArgument(f"retry_s must be >= 0, got {retry_s}")
        get_codec(rows_codec)  # fail early on a bad name
        get_codec(grads_codec)
        self.rows_codec = rows_codec
        self.grads_codec = grads_codec
        self.timeout = timeout
        self.retry_s = retry_s
        self.max_message_bytes = max_message_bytes
        self.security = ClientSecurity.resolve(token=token, tls=tls)
        self.push_numbers = PushNumbers()  # this client's id and per-shard push numbers
        # array payloads per stream (rows_down, grads_up, pooled_down, pooled_grads_up) and codec
        self.codec_stats = WireStats()
        self._shards = ShardSet(ShardAddresses(addresses, resolver), ShardSettings(
            rows_codec, grads_codec, retry_s, max_message_bytes, self.security,
            self.push_numbers, self.codec_stats), timeout)
        self._pooled = PooledCalls(self._shards)

    @classmethod
    def from_registry(cls, url: str, *, discover_timeout_s: float = 60.0,
                      **kwargs: Any) -> PSClient:
        """A client whose shard addresses come from the registry at ``url``."""
        return cls([], resolver=registry_resolver(url, discover_timeout_s), **kwargs)

    # ---- the connections -----------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def addresses(self) -> list[str]:
        """The shards' addresses, in shard order (as last resolved)."""
        return self._shards.book.addresses

    @property
    def dims(self) -> dict[str, int]:
        """Each known table's dim (learned at :meth:`connect` and by :meth:`tables`)."""
        return self._shards.dims

    async def resolve(self) -> None:
        """Refresh ``addresses`` from the resolver (the shard count must not change)."""
        await self._shards.book.resolve()

    async def connect(self) -> PSClient:
        """Open channels and check that address ``i`` serves shard ``i`` of ``len(addresses)``."""
        await self._shards.open()
        return self

    @property
    def epochs(self) -> list[int]:
        """Each shard's epoch as this client last learned it (0: a shard without epochs)."""
        return self._shards.epochs

    async def resync(self) -> list[int]:
        """Learn every shard's epoch anew (after a :class:`StaleEpoch`): later pushes go to
        the restored state. Returns the epochs."""
        return await self._shards.resync()

    async def close(self) -> None:
        await self._shards.close()

    async def __aenter__(self) -> PSClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- one table's ids ---------------------------------------------------------------

    async def lookup(self, table: str, ids: Any, *, read_only: bool = False) -> np.ndarray:
        """Rows (float32, ``len(ids) × dim``) in request order; duplicates fetched once.
        ``read_only``: the shards create no row and mark none used (ids without a row read
        their initial rows), for readers beside training such as a prediction server."""
        uniq, inverse = unique_ids(ids)
        rows = await self.lookup_unique(table, uniq, read_only=read_only)
        return rows[inverse].reshape(*np.shape(ids), -1)

    async def lookup_unique(self, table: str, uniq: np.ndarray, *,
                            read_only: bool = False) -> np.ndarray:
        """Rows of already-unique uint64 ids, in the order given."""
        return (await self.lookup_tables({table: uniq}, read_only=read_only))[table]

    async def push(self, table: str, ids: Any, grads: Any) -> PushAck:
        """Send gradients; duplicate ids are summed here first. Returns the shards' counts."""
        grads = np.asarray(grads, dtype=np.float32)
        uniq, inverse = unique_ids(ids)
        if grads.ndim != 2 or grads.shape[0] != inverse.size:
            raise InvalidArgument(f"grads must be (len(ids), dim) = ({inverse.size}, dim), "
                                  f"got {grads.shape}")
        return await self.push_unique(table, uniq, sum_duplicates(inverse, uniq.size, grads))

    async def push_unique(self, table: str, uniq: np.ndarray, grads: np.ndarray) -> PushAck:
        """Gradients of already-unique uint64 ids.

        With an error-feedback grads codec (``dct``, ``topk``, ``onebit``) what an id's
        gradient loses to compression is kept per id and added the next time it is pushed.
        """
        return await self.push_tables({table: uniq}, {table: grads})

    # ---- several tables per message: one request per shard and dim -----------------------

    async def lookup_tables(self, uniq: Mapping[str, np.ndarray], *,
                            read_only: bool = False) -> dict[str, np.ndarray]:
        """Rows of already-unique ids of several tables (``{table: ids}``), with one Lookup
        message per shard and dim carrying every table's ids."""
        out: dict[str, np.ndarray] = {}
        for tables in await self._by_dim(uniq):
            layout, where = ShardedIds.of_tables({t: uniq[t] for t in tables}, self.num_shards,
                                                 dedup=False)
            rows = await self.lookup_sharded(layout, read_only=read_only)
            out.update((t, rows_at(rows, where[t])) for t in tables)
        return out

    async def push_tables(self, uniq: Mapping[str, np.ndarray],
                          grads: Mapping[str, np.ndarray]) -> PushAck:
        """Gradients of already-unique ids of several tables, one Push message per shard and
        dim (error feedback per id as in :meth:`push_unique`)."""
        acks: list[PushAck] = []
        for tables in await self._by_dim(uniq):
            layout, where = ShardedIds.of_tables({t: uniq[t] for t in tables}, self.num_shards)
            if layout.ids.size != sum(np.size(uniq[t]) for t in tables):
                raise InvalidArgument("push_tables needs unique ids per table; use push()")
            fused = np.zeros((layout.ids.size, self._shards.dims[tables[0]]), dtype=np.float32)
            for t in tables:
                g = np.asarray(grads[t], dtype=np.float32)
                if g.shape != (np.size(uniq[t]), fused.shape[1]):
                    raise InvalidArgument(f"grads of table {t!r} must be "
                                          f"({np.size(uniq[t])}, {fused.shape[1]}), "
                                          f"got {g.shape}")
                fused[where[t]] = g
            acks.append(await self.push_sharded(layout, fused))
        return _sum_acks(acks)

    async def _by_dim(self, uniq: Mapping[str, Any]) -> list[list[str]]:
        """The tables of ``uniq`` grouped by their dim (unknown tables: NotFound)."""
        groups: dict[int, list[str]] = {}
        dims = self._shards.dims
        for table in uniq:
            dim = dims.get(table)
            groups.setdefault(dim if dim is not None else await self._shards.dim(table),
                              []).append(table)
        return list(groups.values())

    # ---- a laid-out step: one message per shard with ids -----------------------------------

    async def lookup_sharded(self, layout: ShardedIds, *, read_only: bool = False
                             ) -> np.ndarray:
        """Rows ``(len(layout.ids), dim)`` of a layout whose tables share one dim, aligned with
        ``layout.ids``: one Lookup message per shard with ids."""
        return await self._rows_of(await self._lookups(layout, read_only=read_only), layout)

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """:meth:`lookup_sharded` with exact rows (no rows codec) and each row's optimizer
        state by name, as the shards hold them: what a worker's replica starts from."""
        replies = await self._lookups(layout, with_state=True)
        state: dict[str, list[np.ndarray]] = {}
        for reply in replies:
            for name, arr in (reply.state or {}).items():
                state.setdefault(name, []).append(received(self.codec_stats, "rows_down", arr))
        return await self._rows_of(replies, layout), {k: np.concatenate(v)
                                                      for k, v in state.items()}

    async def _lookups(self, layout: ShardedIds, *, read_only: bool = False,
                       with_state: bool = False) -> list[msg.LookupReply]:
        """One Lookup message per shard with ids of ``layout``: the replies in shard order."""
        bounds, shards = layout.bounds, self._shards.connections
        return list(await self._shards.within(asyncio.gather(*(
            shards[k].request(shards[k].lookup, shards[k].lookup_request(
                layout, read_only, with_state=with_state), msg.LookupReply)
            for k in range(layout.num_shards) if bounds[k + 1] > bounds[k]))))

    async def push_sharded(self, layout: ShardedIds, grads: np.ndarray) -> PushAck:
        """Gradients ``(len(layout.ids), dim)`` of a layout's ids: one Push message per shard
        (error feedback per id as in :meth:`push_unique`)."""
        check_grads(layout, grads)
        bounds, shards = layout.bounds, self._shards.connections
        return _sum_acks(await self._shards.within(asyncio.gather(*(
            shards[k].request(shards[k].push, shards[k].push_request(layout, grads),
                              msg.PushReply)
            for k in range(layout.num_shards) if bounds[k + 1] > bounds[k]))))

    async def push_then_lookup(self, layout: ShardedIds, grads: np.ndarray,
                               then: ShardedIds) -> tuple[PushAck, np.ndarray]:
        """:meth:`push_sharded` of ``layout``, then :meth:`lookup_sharded` of ``then``, in one
        message per shard that has ids of both: each shard applies the push before it looks
        up, so the rows include it (half the messages of a training step)."""
        check_grads(layout, grads)
        pushed, asked = layout.bounds, then.bounds
        requests: list[Awaitable[msg.PushThenLookupReply | msg.PushReply | msg.LookupReply]] = []
        for k, shard in enumerate(self._shards.connections):
            lookup = shard.lookup_request(then) if asked[k + 1] > asked[k] else None
            if pushed[k + 1] > pushed[k]:
                push = shard.push_request(layout, grads)
                requests.append(
                    shard.request(shard.push, push, msg.PushReply) if lookup is None else
                    shard.request(shard.push_then_lookup, msg.PushThenLookupRequest(
                        push=push, lookup=lookup), msg.PushThenLookupReply))
            elif lookup is not None:
                requests.append(shard.request(shard.lookup, lookup, msg.LookupReply))
        acks: list[msg.PushReply] = []
        rows: list[msg.LookupReply] = []  # in shard order
        for reply in await self._shards.within(asyncio.gather(*requests)):
            if isinstance(reply, msg.PushThenLookupReply):
                acks.append(reply.push)
                rows.append(reply.lookup)
            elif isinstance(reply, msg.PushReply):
                acks.append(reply)
            else:
                rows.append(reply)
        return _sum_acks(acks), await self._rows_of(rows, then)

    async def _rows_of(self, replies: Sequence[msg.LookupReply], layout: ShardedIds
                       ) -> np.ndarray:
        """The rows of the replies (in shard order) as one writable float32 array."""
        if replies:
            return replies_rows(self.codec_stats, replies)
        return np.empty((0, await self._shards.dim(layout.tables[0])), dtype=np.float32)

    # ---- DES-style partial pooling: each shard pools the rows it owns ---------------------

    async def pooled_lookup(self, table: str, ids: Any, lengths: Any,
                            mode: str = "sum") -> np.ndarray:
        """Per-sample pooled rows ``(len(lengths), dim)`` of a jagged feature (sample ``b``
        holds the next ``lengths[b]`` ids), ``mode`` ``sum`` or ``mean``; empty samples give
        zeros. Each shard returns the partial sums of the rows it owns, only for the samples
        that have any; equal to pooling :meth:`lookup`'s rows up to float rounding."""
        return (await self._pooled.lookup(table, as_ids(ids), lengths, mode,
                                          self.rows_codec))[0]

    async def pooled_lookup_masked(self, table: str, ids: Any, lengths: Any, mode: str = "sum",
                                   *, keep: float, refresh: int = DCT_MP_REFRESH
                                   ) -> tuple[np.ndarray, PooledMasks]:
        """:meth:`pooled_lookup` with DCT-MP on the wire: each shard sends the entries of its
        partial sums at least its τ (``dct_mp``: the ``1 − keep`` quantile, per table, reused
        for ``refresh`` lookups); also returns each shard's kept positions, for
        :meth:`pooled_push` to send the gradient at exactly those."""
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise InvalidArgument(f"keep must be a fraction in (0, 1], got {keep!r}")
        return await self._pooled.lookup(table, as_ids(ids), lengths, mode,
                                         f"{DCTMPCodec.name}:keep={keep},refresh={refresh}")

    async def pooled_push(self, table: str, ids: Any, lengths: Any, grads: Any,
                          mode: str = "sum", *, masks: PooledMasks | None = None) -> PushAck:
        """Send the gradient of :meth:`pooled_lookup`'s output, ``(len(lengths), dim)``; each
        shard spreads a sample's gradient over that sample's ids it owns (``mean``: divided
        by the sample's id count here first). ``masks``: those :meth:`pooled_lookup_masked`
        returned for the same ids and lengths; each shard then gets the gradient at the
        positions its partial sums kept only (``dct_mp``), whatever the grads codec. Returns
        the shards' counts."""
        return _sum_acks(await self._pooled.push(table, as_ids(ids), lengths, grads, mode,
                                                 masks))

    # ---- codecs, tables, statistics ---------------------------------------------------------

    def grads_codecs(self) -> list[Codec]:
        """Every codec the gradients go through, shard by shard (whole messages, per table,
        pooled), with its state: thresholds, levels, arrays sent."""
        return self._shards.grads_codecs()

    async def report_loss(self, loss: float) -> int | None:
        """Feed the training loss (the workers' mean) to every shard's adaptive grads codec
        (``adaquant``); returns the s its next pushes use (None when the codec does not adapt).
        A bad loss is an InvalidArgument and changes no codec."""
        levels = None
        for codec in self.grads_codecs():
            report = getattr(codec, "report_loss", None)
            if callable(report):
                levels = report(loss)
        return levels

    def grads_residual(self, table: str, ids: Any) -> np.ndarray:
        """What per-id error feedback still owes the PS for ``ids`` (zeros when it owes none)."""
        ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
        out = np.zeros((ids.size, self.dims[table]), dtype=np.float32)
        for k, pos in enumerate(split_by_shard(ids, self.num_shards)):
            encoder = self._shards.connections[k].grads_encoders.get(table)
            if encoder is not None and pos.size:
                out[pos] = encoder.residual(ids[pos], out.shape[1])
        return out

    async def tables(self) -> list[msg.TableInfo]:
        """Table configs as the first shard reports them (tables exist on every shard);
        refreshes ``dims``."""
        return await self._shards.tables()

    async def stats(self, table: str | None = None) -> list[msg.StatsReply]:
        """Each shard's statistics (its id, epoch, and counters of ``table`` or of every
        table), in shard order."""
        return await self._shards.stats(table)

    def wire_bytes(self) -> dict[str, int]:
        """Bytes this client sent and received per stream."""
        return self._shards.wire_bytes()
