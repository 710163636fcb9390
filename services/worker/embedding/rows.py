"""The calls a training step makes to the embedding rows: the :class:`RowsClient` protocol.

A worker's embedding pipeline (:mod:`services.worker.embedding.pipeline`) reaches the PS through
this protocol only, so the transport is a plug-in point (the port lives here, beside the code
that uses it; the implementations only match its shape):

- :class:`clients.ps_client.PSClient`: gRPC to the PS shard processes;
- :class:`clients.ps_process.PSClientProcess`: a ``PSClient`` in a child process (PERSIA's
  embedding worker), so that the PS traffic never holds the GIL the dense compute needs;
- ``services.ps.inprocess.InProcessShards``: the PS's own shards in this process (no sockets,
  no serialization), injected by the code that builds the worker (the worker never imports
  the PS).

Every implementation routes a :class:`ShardedIds` layout the same way (shard ``k``'s share is
``layout.ids[bounds[k]:bounds[k + 1]]``, :func:`services.common.sharding.shard_of` decides
placement) and returns rows aligned with ``layout.ids``. The protocols are structural: an
implementation does not subclass them. What a given client can do beyond the protocol is read
once, into one typed record (:class:`RowsCapabilities`), that every decision reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from services.common.codecs import WireStats
from services.common.codecs.masked import PooledMasks
from services.common.messages import TableInfo
from services.common.sharding import ShardedIds

__all__ = ["DirectRows", "PooledRows", "ProcessCPU", "PushCounts", "RowsCapabilities",
           "RowsClient", "RowsReplica", "RowsSnapshots", "StatefulRows", "WarmRows"]


class PushCounts(Protocol):
    """What a push did, in unique ids (``PushAck`` of the gRPC clients, ``PushResult`` of an
    in-process shard)."""

    @property
    def applied(self) -> int: ...

    @property
    def dropped_nonfinite(self) -> int: ...

    @property
    def not_admitted(self) -> int: ...


@runtime_checkable
class RowsClient(Protocol):
    """Lookups and pushes of embedding rows, laid out by shard (see the module doc).

    ``dims`` maps each known table to its dim (filled by :meth:`tables`, and by connecting
    where an implementation connects); ``num_shards`` is the shard count layouts must have.
    ``codec_stats`` and ``wire_bytes()`` count the payloads and bytes that crossed a wire (all
    zero where nothing did).
    """

    @property
    def num_shards(self) -> int: ...

    @property
    def dims(self) -> dict[str, int]: ...

    @property
    def codec_stats(self) -> WireStats: ...

    async def tables(self) -> list[TableInfo]:
        """Every table's config; refreshes ``dims``."""
        ...

    async def lookup_sharded(self, layout: ShardedIds) -> np.ndarray:
        """Rows ``(len(layout.ids), dim)`` of a layout whose tables share one dim."""
        ...

    async def push_sharded(self, layout: ShardedIds, grads: np.ndarray) -> PushCounts:
        """Apply gradients ``(len(layout.ids), dim)`` to the layout's rows; returns once every
        shard acknowledged them."""
        ...

    async def push_then_lookup(self, layout: ShardedIds, grads: np.ndarray,
                               then: ShardedIds) -> tuple[PushCounts, np.ndarray]:
        """:meth:`push_sharded` of ``layout``, then :meth:`lookup_sharded` of ``then`` in the
        same message per shard: the rows include the push."""
        ...

    def wire_bytes(self) -> dict[str, int]:
        """Bytes sent and received per stream: ``lookup_out``, ``lookup_in``, ``push_out``,
        ``push_in``."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class PooledRows(Protocol):
    """A rows client whose shards also pool (DES): each returns the per-sample partial sums of
    the rows it owns and spreads a per-sample gradient over that sample's ids it owns
    (:meth:`clients.ps_client.PSClient.pooled_lookup` and ``pooled_push``)."""

    async def pooled_lookup(self, table: str, ids: Any, lengths: Any,
                            mode: str = "sum") -> np.ndarray:
        """Per-sample pooled rows ``(len(lengths), dim)`` of a jagged feature."""
        ...

    async def pooled_lookup_masked(self, table: str, ids: Any, lengths: Any, mode: str = "sum",
                                   *, keep: float, refresh: int) -> tuple[np.ndarray, PooledMasks]:
        """:meth:`pooled_lookup` with DCT-MP on the wire, and each shard's kept positions."""
        ...

    async def pooled_push(self, table: str, ids: Any, lengths: Any, grads: Any,
                          mode: str = "sum", *, masks: PooledMasks | None = None) -> PushCounts:
        """Apply the gradient of :meth:`pooled_lookup`'s output, ``(len(lengths), dim)``
        (``masks``: sent at the positions :meth:`pooled_lookup_masked` kept only)."""
        ...


@runtime_checkable
class ProcessCPU(Protocol):
    """A client whose work runs in a process of its own reports that process's CPU seconds
    (a worker's CPU per step counts them with its own)."""

    async def cpu_seconds(self) -> float: ...


@runtime_checkable
class DirectRows(Protocol):
    """A rows client whose rows live in this process can also serve a layout from any thread,
    without the event loop: the worker's compute thread reads and updates its hot tables
    this way, each step seeing every earlier step's update (no round trip to wait for).
    ``direct`` is False where calls must go through the event loop after all (e.g. a test's
    push gate)."""

    @property
    def direct(self) -> bool: ...

    def lookup_now(self, layout: ShardedIds) -> np.ndarray:
        """:meth:`RowsClient.lookup_sharded`, in the calling thread."""
        ...

    def push_now(self, layout: ShardedIds, grads: np.ndarray) -> PushCounts:
        """:meth:`RowsClient.push_sharded`, applied before it returns, in the calling thread."""
        ...


@runtime_checkable
class WarmRows(Protocol):
    """A rows client whose kernels run in this process (numba's, each compiled at the first
    call of a signature; a request's take one array per table) loads or compiles them ahead:
    the worker warms the requests of its groups of tables before its first step."""

    def warm_up(self, groups: Sequence[Sequence[str]]) -> object:
        """Load or compile the kernels that requests of each of ``groups`` of tables run."""
        ...


@runtime_checkable
class StatefulRows(Protocol):
    """A rows client that also reads the rows' optimizer state, exactly: what a worker's
    replica of its head rows starts from (:mod:`services.worker.replica`)."""

    async def lookup_state_sharded(self, layout: ShardedIds
                                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """:meth:`RowsClient.lookup_sharded` (rows created as it does, never compressed) and
        each row's optimizer state by name, aligned with ``layout.ids``."""
        ...


@runtime_checkable
class RowsReplica(DirectRows, Protocol):
    """A copy, in this process, of remote rows that one worker alone writes (its head ids and
    hot tables): served from any thread as :class:`DirectRows` once :meth:`seed` copied them
    (``services.ps.replica.HeadReplica``, injected by the code that builds the worker)."""

    @property
    def num_rows(self) -> int:
        """Rows held."""
        ...

    def holds(self, layout: ShardedIds) -> bool:
        """Whether the row of every id of ``layout`` is held."""
        ...

    async def seed(self, source: StatefulRows, layout: ShardedIds) -> int:
        """Copy the rows of ``layout``'s ids not held yet from ``source``; how many."""
        ...

    def clear(self) -> None:
        """Forget every row."""
        ...


@runtime_checkable
class RowsSnapshots(Protocol):
    """A rows client that can save every row with its optimizer state under a name and later
    put exactly that state back (a fit that keeps its best state, :mod:`services.worker.best`).
    """

    async def snapshot_rows(self, name: str) -> None:
        """Save every table's rows and optimizer state as snapshot ``name`` (a new name)."""
        ...

    async def restore_rows(self, name: str) -> None:
        """Replace every table by snapshot ``name``: rows created since read as initial rows."""
        ...


@dataclass(frozen=True, slots=True)
class RowsCapabilities:
    """What one rows client can do beyond :class:`RowsClient`, read once from its shape: each
    field is the client itself where it can, else None."""

    direct: DirectRows | None  # rows in this process, served from any thread (direct now)
    stateful: StatefulRows | None  # reads the optimizer state: a replica can start from it
    process_cpu: ProcessCPU | None  # works in a process of its own
    warm: WarmRows | None  # runs kernels in this process, loadable ahead
    snapshots: RowsSnapshots | None  # saves and restores every row

    @classmethod
    def of(cls, rows: RowsClient) -> RowsCapabilities:
        """The capabilities of ``rows`` now (``direct`` is a state: read it when deciding)."""
        return cls(direct=rows if isinstance(rows, DirectRows) and rows.direct else None,
                   stateful=rows if isinstance(rows, StatefulRows) else None,
                   process_cpu=rows if isinstance(rows, ProcessCPU) else None,
                   warm=rows if isinstance(rows, WarmRows) else None,
                   snapshots=rows if isinstance(rows, RowsSnapshots) else None)
