"""The loader's data path: source blocks → rows → batches → dispatcher, and acks → commits.

:meth:`Pipeline.produce` reads the source (waiting while paused), sends malformed records
to the dead-letter sinks, cuts batches and encodes them once in a worker thread, and hands
them to the :class:`~services.loader.dispatch.Dispatcher` (which applies back-pressure).
:meth:`Pipeline.acked` settles the rows of acknowledged batches; :meth:`Pipeline.commit_loop`
passes what became committable to the source, off the Ack call's path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from services.common.checkpoints.positions import cut_positions
from services.common.errors import FailedPrecondition, Internal, PersimmonError
from services.common.messages import BatchBody, BatchItem, encode
from services.loader.batching import Batcher, ChunkTracker, Rows
from services.loader.config import LoaderConfig
from services.loader.deadletter import DeadLetters
from services.loader.dispatch import Dispatcher, Outgoing
from services.loader.metrics import LoaderMetrics, RateMeter
from services.loader.sources.base import Rewindable, Source, SourceBlock

__all__ = ["Pipeline"]

log = logging.getLogger("persimmon.loader")


class Pipeline:
    def __init__(self, source: Source, config: LoaderConfig, dispatcher: Dispatcher,
                 dead_letters: DeadLetters) -> None:
        self.source = source
        self.config = config
        self.dispatcher = dispatcher
        self.dead_letters = dead_letters
        self.tracker = ChunkTracker()
        self.batcher = Batcher(config.batch_size, shuffle_buffer=config.shuffle_buffer,
                               seed=config.seed, drop_last=config.drop_last)
        self.metrics = LoaderMetrics(self.state)
        self.rate = RateMeter()
        self.next_batch_id = 0
        self.records = 0
        self.exhausted = False
        self._resume = asyncio.Event()
        self._resume.set()
        self._commit_wanted = asyncio.Event()

    # ---- control ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def pause(self) -> None:
        """Stop reading the source; batches already made are still delivered."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    # ---- producing --------------------------------------------------------------------------

    async def produce(self) -> None:
        """Run until the source is exhausted; a failure ends every worker stream with it."""
        try:
            await self._produce()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc if isinstance(exc, PersimmonError) else Internal(
                f"the loader stopped producing: {type(exc).__name__}: {exc}")
            await self.dispatcher.fail(error)
            raise

    async def _produce(self) -> None:
        async for block in self.source.blocks():
            await self._ingest(block)
            await self._resume.wait()
        batches, dropped = self.batcher.flush()
        if dropped is not None:
            self.tracker.settle(*dropped.chunk_counts())
        for rows in batches:
            await self.dispatcher.put(self._outgoing(rows))
        self.exhausted = True
        await self.dispatcher.finish()
        self._commit_wanted.set()
        log.info("source exhausted: %d records in %d batches", self.records, self.next_batch_id)

    async def _ingest(self, block: SourceBlock) -> None:
        chunk = self.tracker.open(block.partition, block.first, block.last, block.size,
                                  block.meta)
        if block.bad:
            for record in block.bad:
                self.metrics.malformed.labels(record.reason).inc()
            await self.dead_letters.write(block.partition, block.bad)
            await self.source.dead_letter(block)
        self.records += block.size
        self.rate.add(block.size)
        self.metrics.records.inc(block.size)
        if block.size:
            rows = Rows(labels=block.labels, dense=block.dense, sparse=block.sparse,
                        positions=block.positions,
                        chunks=np.full(block.size, chunk.chunk_id, dtype=np.int64))
            for item in await asyncio.to_thread(self._cut, rows):
                await self.dispatcher.put(item)
        else:
            self._commit_wanted.set()

    def _cut(self, rows: Rows) -> list[Outgoing]:
        return [self._outgoing(b) for b in self.batcher.push(rows)]

    def _outgoing(self, rows: Rows) -> Outgoing:
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        batch = rows.to_batch(batch_id, self.tracker.partition_of)
        payload = encode(BatchItem(batch=BatchBody.of(batch)))
        ids, counts = rows.chunk_counts()
        self.metrics.batches.inc()
        return Outgoing(batch_id, payload, batch.size, ids, counts)

    # ---- acknowledgements and commits -------------------------------------------------------

    def acked(self, items: list[Outgoing]) -> None:
        for item in items:
            self.tracker.settle(item.chunk_ids, item.counts)
        if items:
            self.metrics.acked.inc(len(items))
            self._commit_wanted.set()

    async def commit_once(self) -> None:
        """Commit acknowledged positions to the source (under job cuts, only complete cuts
        commit: :meth:`commit_cut`)."""
        settled = self.tracker.take_settled()
        if settled and not self.config.checkpoint_dir:
            await self.source.commit(settled)

    async def commit_cut(self, checkpoint_id: str) -> dict[str, int]:
        """Commit the positions of the complete job cut ``checkpoint_id``; returns them."""
        if not self.config.checkpoint_dir or not isinstance(self.source, Rewindable):
            raise FailedPrecondition("this loader has no --checkpoint-dir (job cuts)")
        positions = await asyncio.to_thread(cut_positions, self.config.checkpoint_dir,
                                            checkpoint_id)
        return await self.source.commit_positions(positions)

    async def commit_loop(self) -> None:
        """Commit whenever acks made something committable; a commit in progress when the
        loop is cancelled is finished first (shutdown then commits the rest)."""
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            commit = asyncio.ensure_future(self.commit_once())
            try:
                await asyncio.shield(commit)
            except asyncio.CancelledError:
                await asyncio.gather(commit, return_exceptions=True)
                raise
            except Exception:  # a failed commit is retried with the next one
                log.exception("commit failed")

    # ---- reporting --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"records_per_second": self.rate.rate(), "in_flight": self.dispatcher.in_flight(),
                "offsets": self.source.offsets(), "buffered_rows": self.batcher.held}

    def stats(self) -> dict[str, Any]:
        return {"records": self.records, "records_per_second": round(self.rate.rate(), 1),
                "batches": self.next_batch_id, "malformed": dict(self.dead_letters.counts),
                "malformed_total": self.dead_letters.total,
                "malformed_not_kept": self.dead_letters.dropped, "paused": self.paused,
                "exhausted": self.exhausted, "open_chunks": self.tracker.open_chunks,
                "buffered_rows": self.batcher.held, "dispatch": self.dispatcher.stats()}
