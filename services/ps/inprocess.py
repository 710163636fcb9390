"""The PS's own shards in this process, as a rows client: no sockets, no serialization.

:class:`InProcessShards` holds ``num_shards`` :class:`Shard` objects built from table configs
and serves a worker's step calls (``lookup_sharded``, ``push_sharded``, ``push_then_lookup``,
``lookup_state_sharded``, ``tables``) on them directly: a layout's share for shard ``k`` (the ids
:func:`services.common.sharding.shard_of` gives ``k``, as on the gRPC path) goes to shard
``k``'s multi-table calls, which validate before they apply, as the gRPC servicer does (with
the layouts' step tags, :mod:`services.ps.staleness`). It is a worker's ``RowsClient``
(``services.worker.embedding.rows``) by its shape (the PS does not import the worker), and a
``DirectRows`` (``lookup_now``/``push_now`` serve from the calling thread: a worker's compute
thread updates its hot tables so); nothing crosses a wire, so ``wire_bytes()`` is all zeros and
``codec_stats`` stays empty. With a ``checkpoint_dir`` in ``shard_config`` it is a
``RowsSnapshots``: ``snapshot_rows``/``restore_rows`` are the shards' own checkpoints.

A :class:`PushGate` holds pushes until the caller releases them, in arrival order: a test of
the worker's embedding pipeline decides when each push is applied and acknowledged.

Usage::

    shards = InProcessShards([{"name": "C1", "dim": 16}], num_shards=2)
    trainer = Trainer(model="dlrm", rows_client=shards)
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from services.common.codecs import WireStats
from services.common.config import from_dict
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.messages import StatsReply, TableInfo
from services.common.sharding import ShardedIds
from services.ps.config import PSConfig
from services.ps.shard import Shard
from services.ps.staleness import step_tags
from services.ps.store import PushResult
from services.ps.tables import TableConfig, table_info

__all__ = ["InProcessShards", "PushGate"]

_WIRE_STREAMS = ("lookup_out", "lookup_in", "push_out", "push_in")


class PushGate:
    """Holds every push until :meth:`release` lets it through, oldest first.

    ``held`` pushes wait now; ``received`` pushes arrived in all. :meth:`until` waits (on the
    event loop, no polling) until a condition on ``(held, received)`` holds.
    """

    def __init__(self) -> None:
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._changed = asyncio.Event()
        self.received = 0

    @property
    def held(self) -> int:
        return len(self._waiting)

    async def wait(self) -> None:
        """Called by a push: returns once the push is released."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.received += 1
        self._changed.set()
        try:
            await future
        except asyncio.CancelledError:
            if future in self._waiting:
                self._waiting.remove(future)
            raise

    def release(self, count: int = 1) -> None:
        """Let the ``count`` oldest held pushes through."""
        if not 0 <= count <= self.held:
            raise InvalidArgument(f"cannot release {count} pushes, {self.held} are held")
        for _ in range(count):
            self._waiting.popleft().set_result(None)

    async def until(self, condition: Callable[[int, int], bool]) -> None:
        """Wait until ``condition(held, received)`` is true."""
        while not condition(self.held, self.received):
            self._changed.clear()
            await self._changed.wait()


class InProcessShards:
    """``num_shards`` PS shards in this process, serving a worker's row lookups and pushes.

    ``tables`` are table configs (:class:`TableConfig` or dicts, as in a PS YAML file); every
    shard holds each of them, as every PS process does. ``gate``: hold pushes until released
    (tests). ``shard_config`` sets the shards' other limits (their ids and tables are set
    here).
    """

    def __init__(self, tables: Sequence[TableConfig | Mapping[str, Any]], *,
                 num_shards: int = 1, gate: PushGate | None = None,
                 shard_config: Mapping[str, Any] | None = None) -> None:
        if not tables:
            raise InvalidArgument("InProcessShards needs at least one table")
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise InvalidArgument(f"num_shards must be an int >= 1, got {num_shards!r}")
        extra = dict(shard_config or {})
        clash = sorted({"shard_id", "num_shards", "tables"} & set(extra))
        if clash:
            raise InvalidArgument(f"shard_config must not set {clash}: InProcessShards does")
        configs = [t if isinstance(t, TableConfig) else _table_config(t) for t in tables]
        self.shards = [Shard(PSConfig(shard_id=k, num_shards=num_shards, tables=configs,
                                      **extra))
                       for k in range(num_shards)]
        self.gate = gate
        self.codec_stats = WireStats()  # nothing is encoded: stays empty
        self.dims: dict[str, int] = {t.name: t.dim for t in configs}
        self._warmed: set[tuple[str, ...]] = set()  # groups of tables warm_up ran

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def warm_up(self, groups: Sequence[Sequence[str]] | None = None) -> InProcessShards:
        """Compile now (numba) the kernels of every table's kind and of requests of each of
        ``groups`` of tables (default: each dim's tables, as a worker sends them), as a PS
        process does before it serves, so that the first training steps are not charged for
        it. The kernels are the process's: one shard runs them for all; a group warmed
        before is skipped (the Trainer warms its own groups, often these)."""
        todo = [tuple(g) for g in (self.shards[0].dim_groups() if groups is None else groups)]
        todo = [g for g in dict.fromkeys(todo) if g not in self._warmed]
        if todo:
            self.shards[0].warm_up(todo)
            self._warmed.update(todo)
        return self

    async def connect(self) -> InProcessShards:
        """Nothing to connect: here for symmetry with the network clients."""
        return self

    async def close(self) -> None:
        """Nothing to close; the shards' tables stay readable."""

    async def __aenter__(self) -> InProcessShards:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def tables(self) -> list[TableInfo]:
        """Every table's config, as shard 0 holds it (every shard holds every table), as
        :meth:`clients.ps_client.PSClient.tables` gives them."""
        found = [table_info(t.config)
                 for t in self.shards[0].tables.values()]
        self.dims = {t.name: t.dim for t in found}
        return found

    async def stats(self, table: str | None = None) -> list[StatsReply]:
        """Per-shard statistics, as :meth:`clients.ps_client.PSClient.stats` gives them."""
        return [shard.stats(table) for shard in self.shards]

    @property
    def direct(self) -> bool:
        """Whether ``lookup_now``/``push_now`` may serve (not while a gate holds pushes)."""
        return self.gate is None

    def lookup_now(self, layout: ShardedIds) -> np.ndarray:
        """:meth:`lookup_sharded` in the calling thread (the tables' locks keep it safe)."""
        dim = self._check_layout(layout)
        return _rows([self.shards[k].lookup_many_sync(layout.tables, layout.counts[k].tolist(),
                                                      ids)
                      for k, ids in self._shares(layout)], dim)

    def push_now(self, layout: ShardedIds, grads: np.ndarray) -> PushResult:
        """:meth:`push_sharded` in the calling thread, applied when it returns (a gate holds
        only :meth:`push_sharded`'s pushes)."""
        dim = self._check_layout(layout)
        _check_grads(layout, grads, dim)
        return PushResult.total([self.shards[k].push_many_sync(
            layout.tables, layout.counts[k].tolist(), ids,
            grads[layout.bounds[k]:layout.bounds[k + 1]]) for k, ids in self._shares(layout)])

    def wire_bytes(self) -> dict[str, int]:
        """Bytes on the wire per stream: none crossed one."""
        return dict.fromkeys(_WIRE_STREAMS, 0)

    # ---- snapshots (services.worker.embedding.rows.RowsSnapshots) -----------------------------

    async def snapshot_rows(self, name: str) -> None:
        """Every shard writes its part of checkpoint ``name`` into its ``checkpoint_dir``
        (set through ``shard_config``): rows, optimizer state and bookkeeping."""
        self._check_checkpoint_dir()
        await asyncio.gather(*(shard.checkpoint(name) for shard in self.shards))

    async def restore_rows(self, name: str) -> None:
        """Every shard replaces its tables by its part of checkpoint ``name``."""
        self._check_checkpoint_dir()
        await asyncio.gather(*(shard.restore(name) for shard in self.shards))

    def _check_checkpoint_dir(self) -> None:
        if not self.shards[0].config.checkpoint_dir:
            raise FailedPrecondition("snapshots of the rows are checkpoints of the shards: "
                                     "give InProcessShards(shard_config={'checkpoint_dir': "
                                     "DIR})")

    # ---- the step calls ----------------------------------------------------------------

    async def lookup_sharded(self, layout: ShardedIds) -> np.ndarray:
        """Rows ``(len(layout.ids), dim)`` aligned with ``layout.ids``."""
        return await self._lookups(layout, None)

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """:meth:`lookup_sharded` with each row's optimizer state by name (a replica's seed)."""
        states: list[dict[str, np.ndarray]] = []
        rows = await self._lookups(layout, states)
        return rows, ({k: np.concatenate([s[k] for s in states]) for k in states[0]}
                      if states else {})

    async def _lookups(self, layout: ShardedIds, states: list[dict[str, np.ndarray]] | None
                       ) -> np.ndarray:
        """Each shard's share of ``layout`` looked up on it; with ``states``, each share's
        optimizer state is appended there, in shard order."""
        dim = self._check_layout(layout)
        shares = self._shares(layout)
        if states is not None:
            states.extend({} for _ in shares)
        with step_tags(lookup=layout.tag):
            parts = await asyncio.gather(*(
                self.shards[k].lookup_many(layout.tables, layout.counts[k].tolist(), ids,
                                           state=None if states is None else states[n])
                for n, (k, ids) in enumerate(shares)))
        return _rows(parts, dim)

    async def push_sharded(self, layout: ShardedIds, grads: np.ndarray) -> PushResult:
        """Apply ``grads`` (``(len(layout.ids), dim)``) on every shard (after the gate)."""
        dim = self._check_layout(layout)
        _check_grads(layout, grads, dim)
        if self.gate is not None:
            await self.gate.wait()
        with step_tags(push=layout.tag):
            return PushResult.total(await asyncio.gather(*(
                self.shards[k].push_many(layout.tables, layout.counts[k].tolist(), ids,
                                         grads[layout.bounds[k]:layout.bounds[k + 1]])
                for k, ids in self._shares(layout))))

    async def push_then_lookup(self, layout: ShardedIds, grads: np.ndarray,
                               then: ShardedIds) -> tuple[PushResult, np.ndarray]:
        """Push ``layout``'s gradients, then look ``then`` up: each shard applies its part of
        the push before it serves its part of the lookup, as in one message per shard."""
        dim = self._check_layout(layout)
        then_dim = self._check_layout(then)
        _check_grads(layout, grads, dim)
        if self.gate is not None:
            await self.gate.wait()
        pushed = dict(self._shares(layout))
        asked = dict(self._shares(then))
        jobs = []
        for k in sorted(pushed.keys() | asked.keys()):
            push = ((layout.tables, layout.counts[k].tolist(), pushed[k],
                     grads[layout.bounds[k]:layout.bounds[k + 1]]) if k in pushed else None)
            lookup = (then.tables, then.counts[k].tolist(), asked[k]) if k in asked else None
            jobs.append(self._push_then_lookup_one(self.shards[k], push, lookup))
        with step_tags(push=layout.tag, lookup=then.tag):
            done = await asyncio.gather(*jobs)
        return (PushResult.total([r for r, _ in done if r is not None]),
                _rows([rows for _, rows in done if rows is not None], then_dim))

    @staticmethod
    async def _push_then_lookup_one(shard: Shard, push: Any, lookup: Any
                                    ) -> tuple[PushResult | None, np.ndarray | None]:
        if push is not None and lookup is not None:
            return await shard.push_then_lookup(push, lookup)
        if push is not None:
            return await shard.push_many(*push), None
        return None, await shard.lookup_many(*lookup)

    def _shares(self, layout: ShardedIds) -> list[tuple[int, np.ndarray]]:
        """Each shard with ids in ``layout`` and its share of them, in shard order."""
        bounds = layout.bounds
        return [(k, layout.ids[bounds[k]:bounds[k + 1]]) for k in range(layout.num_shards)
                if bounds[k + 1] > bounds[k]]

    def _check_layout(self, layout: ShardedIds) -> int:
        """The layout's common dim, after checking its shard count and tables."""
        if layout.num_shards != self.num_shards:
            raise InvalidArgument(f"the layout is for {layout.num_shards} shards, there are "
                                  f"{self.num_shards}")
        if not layout.tables:
            raise InvalidArgument("a layout needs at least one table")
        dims = {name: self.shards[0].table(name).dim for name in layout.tables}
        if len(set(dims.values())) != 1:
            raise InvalidArgument(f"the tables of one layout must have one dim, got {dims}")
        return dims[layout.tables[0]]


def _table_config(data: Mapping[str, Any]) -> TableConfig:
    return from_dict(TableConfig, dict(data), where="table")


def _check_grads(layout: ShardedIds, grads: Any, dim: int) -> None:
    shape = (layout.ids.size, dim)
    if not isinstance(grads, np.ndarray) or grads.shape != shape:
        raise InvalidArgument(f"grads must be an array of shape {shape}, got "
                              f"{getattr(grads, 'shape', type(grads).__name__)}")


def _rows(parts: Sequence[np.ndarray], dim: int) -> np.ndarray:
    if not parts:
        return np.empty((0, dim), dtype=np.float32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
