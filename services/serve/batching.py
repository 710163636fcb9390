"""Dynamic micro-batching: requests that arrive together are answered by one forward pass.

:meth:`MicroBatcher.submit` queues a request and waits for its answer. One task takes the
first waiting request, then more until ``max_records`` records are gathered or ``max_wait_s``
has passed since the first, reads the active :class:`Predictor` once for the whole batch,
and runs featurization and the forward pass in a thread. A request whose input is bad gets
its own error; the others of its batch are answered. ``max_queued_records`` bounds the
records waiting or in a forward pass (beyond it a request is refused at once: Unavailable,
retry later).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.errors import Internal, InvalidArgument, PersimmonError, Unavailable
from services.common.lifecycle import cancel_and_wait
from services.loader import Features
from services.serve.predictor import Predictor

__all__ = ["Answer", "MicroBatcher"]

log = logging.getLogger("persimmon.serve")


@dataclass(slots=True, frozen=True)
class Answer:
    """The probabilities of one request and the version that computed them."""

    probabilities: np.ndarray
    version_id: str
    step: int


@dataclass(slots=True)
class _Pending:
    body: Mapping[str, Any]
    records: int
    future: asyncio.Future[Answer] = field(repr=False)


class MicroBatcher:
    """Batches requests for the Predictor ``current()`` returns (see module docstring).

    ``on_batch(records, seconds)`` is called after every forward pass (metrics).
    """

    def __init__(self, current: Callable[[], Predictor | None], *, max_records: int,
                 max_wait_s: float, max_queued_records: int,
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        self._current = current
        self.max_records = max_records
        self.max_wait_s = max_wait_s
        self.max_queued_records = max_queued_records
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._queued = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batch")

    async def close(self) -> None:
        """Stop batching; requests still waiting get Unavailable."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(Unavailable("the server is shutting down"))

    async def submit(self, body: Mapping[str, Any], records: int) -> Answer:
        """The answer to one request of ``records`` records."""
        if self._task is None:
            raise Unavailable("the server is not serving")
        if self._queued + records > self.max_queued_records:
            raise Unavailable(f"{self._queued} records are waiting; retry later")
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queued += records
        self._queue.put_nowait(_Pending(body, records, future))
        return await future

    async def _gather(self) -> list[_Pending]:
        first = await self._queue.get()
        batch, records = [first], first.records
        deadline = time.monotonic() + self.max_wait_s
        while records < self.max_records:
            if self._queue.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), left)
                except TimeoutError:
                    break
            else:
                item = self._queue.get_nowait()
            batch.append(item)
            records += item.records
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._gather()
            try:
                await self._serve(batch)
            finally:
                self._queued -= sum(p.records for p in batch)

    async def _serve(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if not p.future.done()]  # a client may have gone
        if not live:
            return
        predictor = self._current()  # one version for the whole batch
        if predictor is None:
            for p in live:
                p.future.set_exception(Unavailable("no model version is loaded yet"))
            return
        try:
            results = await asyncio.to_thread(self._answer, predictor, live)
        except asyncio.CancelledError:
            for p in live:
                if not p.future.done():
                    p.future.set_exception(Unavailable("the server is shutting down"))
            raise
        except Exception as exc:  # a bug must fail its batch, not stop the batching
            log.exception("micro-batch failed")
            results = [Internal(f"prediction failed: {exc}")] * len(live)
        for p, result in zip(live, results, strict=True):
            if p.future.done():
                continue
            if isinstance(result, BaseException):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)

    def _answer(self, predictor: Predictor, batch: list[_Pending]
                ) -> list[Answer | BaseException]:
        """Featurize each request, one forward pass for all good ones (in a thread)."""
        results: list[Answer | BaseException] = []
        good: list[tuple[int, Features]] = []
        for i, pending in enumerate(batch):
            try:
                features = predictor.featurize(pending.body)
                if features.size != pending.records:
                    raise InvalidArgument(f"the request holds {features.size} records, "
                                          f"not {pending.records}")
                good.append((i, features))
                results.append(InvalidArgument("unanswered"))
            except PersimmonError as exc:
                results.append(exc)
        if not good:
            return results
        started = time.perf_counter()
        try:
            probs = predictor.predict(Features.concat([f for _, f in good]))
        except PersimmonError as exc:
            for i, _ in good:
                results[i] = exc
            return results
        seconds = time.perf_counter() - started
        if self._on_batch is not None:
            self._on_batch(int(probs.shape[0]), seconds)
        start = 0
        for i, features in good:
            results[i] = Answer(probs[start:start + features.size], predictor.version_id,
                                predictor.step)
            start += features.size
        return results
