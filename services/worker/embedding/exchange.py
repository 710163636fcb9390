"""How a batch's embeddings cross between a worker and the PS: the *embedding path*.

The :class:`~services.worker.embedding.pipeline.EmbeddingPipeline` decides *when* a batch's
embeddings are looked up and its gradients pushed (staleness slots, riders, hot tables); an
embedding path decides *what* travels, per group of tables of one dim:

- :class:`RowsPath` (``rows``, the default): the batch's unique rows come down, the worker
  pools them per sample (:func:`~services.worker.pooling.pool_batch`), and each unique row's
  gradient goes up.
- :class:`PooledPath` (``des``, Distributed Equivalent Substitution): every shard pools the
  rows it owns per sample and returns these partial sums; the worker adds them (the pooled
  embedding, ``sum`` or ``mean``) and pushes back the gradient of each sample's pooled
  embedding, which each shard spreads over that sample's ids it owns
  (:meth:`clients.ps_client.PSClient.pooled_lookup` / ``pooled_push``). Forward and backward
  equal the rows path's up to float rounding; the bytes differ: a feature sends at most
  ``samples x shards`` partials and every id (twice) instead of its unique rows and ids
  (docs/training.md).

Every feature of the models here is pooled (``sum`` or ``mean``), so DES serves all of them.
A path's "rows" of a group are what :meth:`lookup` returns: unique rows ``(U, dim)`` for
``rows``, the pooled embeddings (the shards' partial sums added) of the group's features end
to end ``(features x B, dim)`` for ``des``; :meth:`pool` turns them into the model's inputs,
whose leaf gradients are what :meth:`push` sends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from services.common.codecs.masked import REFRESH as DCT_MP_REFRESH
from services.common.codecs.masked import PooledMasks
from services.common.errors import ConfigError, InvalidArgument
from services.worker.embedding.rows import PooledRows, RowsClient
from services.worker.pooling import POOLING_MODES, BatchPlan, PooledBatch, pool_batch

__all__ = ["EMBEDDING_PATHS", "EmbeddingPath", "PooledPath", "RowsPath", "StepTimers",
           "embedding_path", "lookup_groups"]

Rows = list[np.ndarray]  # per group of tables, aligned with its layout's ids
MAX_HELD = 256  # DES with DCT-MP: batches whose kept positions wait for their push


class _Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class StepTimers(Protocol):
    """Where lookups and pushes report their seconds (Prometheus histograms of
    :class:`services.worker.admin.WorkerProgress`)."""

    @property
    def lookup_seconds(self) -> _Histogram: ...

    @property
    def push_seconds(self) -> _Histogram: ...


EMBEDDING_PATHS = {
    "rows": "unique rows down, pooled on the worker, row gradients up",
    "des": "per-sample partial sums pooled on each shard down, pooled gradients up (DES)",
}


@runtime_checkable
class EmbeddingPath(Protocol):
    """What one group's lookup and push send (see the module doc). ``unique_rows``: the rows
    are the batch's unique rows, one per id (what hot tables, head ids and replicas hold)."""

    name: str
    unique_rows: bool

    def check(self, rows: RowsClient) -> None:
        """A ConfigError where ``rows`` cannot serve this path."""
        ...

    async def lookup(self, rows: RowsClient, plan: BatchPlan, group: int) -> np.ndarray: ...

    async def push(self, rows: RowsClient, plan: BatchPlan, group: int,
                   grads: np.ndarray) -> None: ...

    async def push_then_lookup(self, rows: RowsClient, plan: BatchPlan, group: int,
                               grads: np.ndarray, then: BatchPlan) -> np.ndarray:
        """Push ``plan``'s gradients, then look ``then`` up: the rows include the push."""
        ...

    def pool(self, plan: BatchPlan, rows: Sequence[np.ndarray], *,
             device: torch.device | str = "cpu") -> PooledBatch:
        """The model's pooled inputs; their leaves' gradients are what :meth:`push` sends."""
        ...

    def for_evaluation(self) -> EmbeddingPath:
        """The path evaluation looks up with: what serving computes (no training-only
        compression of the activations)."""
        ...


class RowsPath:
    """Unique rows down, row gradients up: one message per shard and group."""

    name = "rows"
    unique_rows = True

    def __init__(self, mode: str = "sum") -> None:
        self.mode = _checked_mode(mode)

    def check(self, rows: RowsClient) -> None:
        """Every rows client serves rows."""

    def for_evaluation(self) -> RowsPath:
        return self

    async def lookup(self, rows: RowsClient, plan: BatchPlan, group: int) -> np.ndarray:
        return await rows.lookup_sharded(plan.groups[group].layout)

    async def push(self, rows: RowsClient, plan: BatchPlan, group: int,
                   grads: np.ndarray) -> None:
        await rows.push_sharded(plan.groups[group].layout, grads)

    async def push_then_lookup(self, rows: RowsClient, plan: BatchPlan, group: int,
                               grads: np.ndarray, then: BatchPlan) -> np.ndarray:
        """One message per shard carries both (the shard pushes first)."""
        _, got = await rows.push_then_lookup(plan.groups[group].layout, grads,
                                             then.groups[group].layout)
        return got

    def pool(self, plan: BatchPlan, rows: Sequence[np.ndarray], *,
             device: torch.device | str = "cpu") -> PooledBatch:
        return pool_batch(plan, rows, mode=self.mode, device=device)


class PooledPath:
    """DES: per-sample partial sums down, per-sample pooled gradients up, one message per
    shard and feature (each shard gets the ids it owns with their samples' counts).

    ``keep < 1`` is DCT-MP on this wire: the shards send only their partial sums' entries at
    least τ (codec ``dct_mp``, τ per table reused for ``refresh`` lookups), and the push sends
    each shard the gradient at the positions its partial sums kept. The kept positions of a
    batch wait here, by plan, from its lookup to its push (at most :data:`MAX_HELD` batches;
    a push whose lookup is no longer held sends every position). :meth:`for_evaluation` is
    the same path without thresholding: evaluation sees what serving sees."""

    name = "des"
    unique_rows = False

    def __init__(self, mode: str = "sum", *, keep: float = 1.0,
                 refresh: int = DCT_MP_REFRESH) -> None:
        self.mode = _checked_mode(mode)
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise ConfigError(f"activation keep must be a fraction in (0, 1], got {keep!r}")
        if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
            raise ConfigError(f"activation refresh must be an int >= 1, got {refresh!r}")
        self.keep, self.refresh = float(keep), refresh
        # (id(plan), group) -> (plan, per feature the shards' kept positions)
        self._held: dict[tuple[int, int], tuple[BatchPlan, list[PooledMasks]]] = {}

    def for_evaluation(self) -> PooledPath:
        """This path without DCT-MP (itself when it has none)."""
        return self if self.keep >= 1 else PooledPath(self.mode)

    def check(self, rows: RowsClient) -> None:
        if not isinstance(rows, PooledRows):
            raise ConfigError(f"embedding_path 'des' needs a rows client with pooled lookups "
                              f"and pushes (the gRPC PSClient or its child process), not "
                              f"{type(rows).__name__}: run the PS as gRPC shards")

    @staticmethod
    def _bags(plan: BatchPlan, group: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """Per feature of the group, in its order: (table, its ids sample by sample, lengths)."""
        ids = plan.groups[group].layout.ids
        out = []
        for name in plan.groups[group].features:
            feature = plan.features[name]
            out.append((feature.table, ids[feature.inverse], feature.lengths))
        return out

    async def lookup(self, rows: RowsClient, plan: BatchPlan, group: int) -> np.ndarray:
        client, bags = _pooled(rows), self._bags(plan, group)
        if self.keep >= 1:
            parts = await asyncio.gather(*(client.pooled_lookup(table, ids, lengths,
                                                                mode=self.mode)
                                           for table, ids, lengths in bags))
        else:
            got = await asyncio.gather(*(client.pooled_lookup_masked(
                table, ids, lengths, mode=self.mode, keep=self.keep, refresh=self.refresh)
                for table, ids, lengths in bags))
            parts = [pooled for pooled, _ in got]
            while len(self._held) >= MAX_HELD:  # lookups never pushed: the oldest go
                del self._held[next(iter(self._held))]
            self._held[(id(plan), group)] = (plan, [masks for _, masks in got])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def push(self, rows: RowsClient, plan: BatchPlan, group: int,
                   grads: np.ndarray) -> None:
        client, size = _pooled(rows), plan.batch_size
        bags = self._bags(plan, group)
        if grads.shape[0] != len(bags) * size:
            raise InvalidArgument(f"pooled grads of group {group} must be "
                                  f"({len(bags) * size}, dim), got {grads.shape}")
        held = self._held.pop((id(plan), group), None)
        masks = held[1] if held is not None and held[0] is plan else [None] * len(bags)
        await asyncio.gather(*(client.pooled_push(table, ids, lengths,
                                                  grads[k * size:(k + 1) * size], mode=self.mode,
                                                  masks=masks[k])
                               for k, (table, ids, lengths) in enumerate(bags)))

    async def push_then_lookup(self, rows: RowsClient, plan: BatchPlan, group: int,
                               grads: np.ndarray, then: BatchPlan) -> np.ndarray:
        """Two round trips: the push is acknowledged before the lookup leaves."""
        await self.push(rows, plan, group, grads)
        return await self.lookup(rows, then, group)

    def pool(self, plan: BatchPlan, rows: Sequence[np.ndarray], *,
             device: torch.device | str = "cpu") -> PooledBatch:
        """The pooled partial sums are the leaves: one ``(features x B, dim)`` tensor per group,
        each feature's ``(B, dim)`` a view of it."""
        if len(rows) != len(plan.groups):
            raise InvalidArgument(f"pooled rows are needed for {len(plan.groups)} groups, "
                                  f"got {len(rows)}")
        size = plan.batch_size
        leaves: list[torch.Tensor] = []
        pooled: dict[str, torch.Tensor] = {}
        for group, part in zip(plan.groups, rows, strict=True):
            if part.ndim != 2 or part.shape[0] != len(group.features) * size:
                raise InvalidArgument(f"pooled rows of {group.features} must be "
                                      f"({len(group.features) * size}, dim), got {part.shape}")
            leaf = torch.tensor(part, dtype=torch.float32, device=device).requires_grad_(True)
            leaves.append(leaf)
            pooled.update((name, leaf[k * size:(k + 1) * size])
                          for k, name in enumerate(group.features))
        return PooledBatch(plan=plan, rows=leaves, pooled=pooled)


def _checked_mode(mode: str) -> str:
    if mode not in POOLING_MODES:
        raise ConfigError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
    return mode


def _pooled(rows: RowsClient) -> PooledRows:
    if not isinstance(rows, PooledRows):  # replaced since the check (e.g. a child process)
        raise ConfigError(f"{type(rows).__name__} has no pooled lookups and pushes")
    return rows


def embedding_path(name: str, pooling: str = "sum", *, keep: float = 1.0) -> EmbeddingPath:
    """The path called ``name`` (:data:`EMBEDDING_PATHS`) pooling with ``pooling``; ``keep``:
    DCT-MP's kept share on DES's wire (``des`` only)."""
    if name == "rows":
        return RowsPath(pooling)
    if name == "des":
        return PooledPath(pooling, keep=keep)
    raise ConfigError(f"embedding_path must be one of {sorted(EMBEDDING_PATHS)}, got {name!r}")


async def lookup_groups(path: EmbeddingPath, rows: RowsClient, plan: BatchPlan,
                        groups: Sequence[int] | None = None,
                        timers: StepTimers | None = None) -> Rows:
    """The rows of every group of ``plan``, or of ``groups`` (indices) only, as ``path`` looks
    them up through ``rows`` (one message per shard and group); ``timers`` get the seconds."""
    started = time.perf_counter()
    chosen = range(len(plan.groups)) if groups is None else groups
    try:
        return list(await asyncio.gather(*(path.lookup(rows, plan, i) for i in chosen)))
    finally:
        if timers is not None:
            timers.lookup_seconds.observe(time.perf_counter() - started)
