"""The compute thread of a worker: training steps taken straight from a thread-safe feed.

The event loop keeps serving lookups and pushes while a step runs; each step's result goes
back to the loop as it comes. The thread knows nothing of the Trainer: it calls the ``step``
callable it was given on each prepared batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from services.worker.distributed import every_rank_has_a_batch, several_ranks

__all__ = ["CPU_SWITCH_INTERVAL", "DONE", "ComputeThread", "StepPhases", "compute_threads",
           "gil_switch_interval", "torch_threads"]

Item = TypeVar("Item")
DONE = object()  # the end of the results
# the GIL's switch interval while a CPU fit runs (Python's default: 5 ms): a thread
# that waits for the GIL takes it from the one holding it after this long
CPU_SWITCH_INTERVAL = 0.0005


class _Lowered:
    """A process-wide setting held at most a value while bodies run: bodies may overlap (one
    per running fit), the lowest value asked for holds until the last one ends,
    and then the value before the first comes back."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self._get, self._put = get, put
        self._lock = threading.Lock()
        self._users = 0
        self._before: Any = None

    @contextlib.contextmanager
    def __call__(self, value: Any) -> Iterator[None]:
        if value is None:
            yield
            return
        with self._lock:
            if self._users == 0:
                self._before = self._get()
            self._users += 1
            self._put(min(self._get(), value))
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._put(self._before)


_switch_interval = _Lowered(sys.getswitchinterval, sys.setswitchinterval)
_torch_threads = _Lowered(torch.get_num_threads, torch.set_num_threads)


def gil_switch_interval(seconds: float | None) -> contextlib.AbstractContextManager[None]:
    """Python's GIL switch interval at most ``seconds`` while the body runs (None: unchanged).
    A compute thread gets the GIL back sooner after each kernel that released it, instead of
    waiting up to 5 ms for the event loop's or the shards' threads."""
    return _switch_interval(seconds)


def torch_threads(threads: int | None) -> contextlib.AbstractContextManager[None]:
    """torch's intra-op threads at most ``threads`` while the body runs (None: unchanged),
    set from the thread that enters it: that thread's count, and that of every thread whose
    first torch op comes later (a thread keeps the count it had at its first torch op, so
    enter it before any torch work the body's threads do)."""
    return _torch_threads(threads)


def compute_threads(rows_in_process: bool, cores: int | None = None) -> int | None:
    """The intra-op threads of a CPU compute thread: one fewer than the cores where the rows
    are in this process (their lookups and updates run in the process's other threads, and
    an intra-op team whose second thread waits for a core they hold stalls every op of the
    step), else torch's own (None)."""
    if not rows_in_process:
        return None
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores - 1)


class StepPhases:
    """Where a thread's steps go: the wall and thread-CPU seconds of each named phase, summed
    over the steps. :meth:`start` begins a step; :meth:`mark` ends the phase that began at the
    last mark (or the start) and names it. ``clocks``: the wall and CPU clocks read (seconds).
    """

    def __init__(self, clocks: tuple[Callable[[], float], Callable[[], float]] = (
            time.perf_counter, time.thread_time)) -> None:
        self._sums: dict[str, list[float]] = {}
        self._wall = self._cpu = 0.0
        self._clocks = clocks

    def reset(self) -> None:
        self._sums.clear()

    def start(self) -> None:
        self._wall, self._cpu = self._clocks[0](), self._clocks[1]()

    def mark(self, phase: str) -> None:
        wall, cpu = self._clocks[0](), self._clocks[1]()
        sums = self._sums.setdefault(phase, [0.0, 0.0])
        sums[0] += wall - self._wall
        sums[1] += cpu - self._cpu
        self._wall, self._cpu = wall, cpu

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Mean ``wall_ms`` and ``cpu_ms`` per step of each phase, in the order first marked."""
        n = max(steps, 1)
        return {phase: {"wall_ms": 1e3 * wall / n, "cpu_ms": 1e3 * cpu / n}
                for phase, (wall, cpu) in self._sums.items()}


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class ComputeThread(Generic[Item]):
    """Runs ``step(item)`` in one thread for every item :meth:`put` gives it (``None`` ends
    the feed), so that the event loop never paces compute. ``results`` gets ``(item, step's
    result)`` per step, then :data:`DONE`, or the exception that ended the thread.

    With ``eval_every``, the thread waits after every ``eval_every``-th step until the loop
    has evaluated (``resume``); with ``pause_each_step`` (an ``on_step`` callback is set) it
    waits after every step, so that the callback sees the model at that step. With ``room``
    (async mode), at most that many items wait in the feed. With more than one rank, every
    rank stops at the step where the first one runs out of items (one tiny all-reduce per
    step). (The fit sets the GIL switch interval and torch's threads for every thread:
    :func:`gil_switch_interval`, :func:`torch_threads`.)
    """

    def __init__(self, step: Callable[[Item], Any], *, room: int | None, eval_every: int,
                 pause_each_step: bool) -> None:
        self._step = step
        self.loop = asyncio.get_running_loop()
        self.feed: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.results: asyncio.Queue[Any] = asyncio.Queue()
        self.resume = threading.Event()
        # the run's clocks at its start (:meth:`mark_started`): wall, the worker's CPU seconds
        # and the event loop's thread's
        self.started = self.started_cpu = self.started_loop_cpu = 0.0
        self.first_step_at: float | None = None  # perf_counter() as the first step began
        self._room = asyncio.Semaphore(room) if room is not None else None
        self._eval_every = eval_every
        self._pause_each_step = pause_each_step
        self._stopping = False
        self._wall = self._cpu = self._wait = 0.0  # seconds, over the steps done
        self._steps_done = 0
        self._distributed = several_ranks()

    async def put(self, item: Item | None) -> None:
        """Give the thread an item (None: no more)."""
        if self._room is not None and item is not None:
            await self._room.acquire()
        self.feed.put(DONE if item is None else item)

    def mark_started(self, worker_cpu: float) -> None:
        """Start the run's clocks now (from the event loop's thread): wall, the worker's CPU
        seconds (``worker_cpu``) and the loop's thread's."""
        self.started, self.started_cpu = time.perf_counter(), worker_cpu
        self.started_loop_cpu = time.thread_time()

    def fail(self, exc: BaseException) -> None:
        """End the results with ``exc`` (the consumer raises it)."""
        self.results.put_nowait(exc)

    def stop(self) -> None:
        self._stopping = True
        self.feed.put(DONE)
        self.resume.set()

    def pauses_after(self, step: int) -> bool:
        """Whether the thread waits for ``resume`` after ``step``."""
        return self._pause_each_step or bool(self._eval_every) and step % self._eval_every == 0

    def _report(self, result: Any) -> None:
        self.loop.call_soon_threadsafe(self.results.put_nowait, result)

    def start(self, step: int) -> asyncio.Future[None]:
        """Run the steps (``step``: the number done before) on a thread of its own, started
        now with the caller's context; the future is done once the thread ended. Never on a
        thread of the loop's executor: the idle one it would take ran earlier torch work (the
        fit's warm-up pass, an evaluation), and steps there ran several times slower
        (docs/performance.md, "The dense compute")."""
        done: asyncio.Future[None] = self.loop.create_future()

        def body() -> None:
            try:
                self._run(step)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self.loop.call_soon_threadsafe(_finish, done)

        context = contextvars.copy_context()  # as asyncio.to_thread passes it
        threading.Thread(target=context.run, args=(body,), name="persimmon-compute",
                         daemon=True).start()
        return done

    def _run(self, step: int) -> None:
        try:
            self._steps(step)
        except BaseException as exc:  # raised by the loop, which awaits results only
            self._report(exc)

    def compute_so_far(self) -> tuple[int, float]:
        """The training steps this thread has taken and their wall seconds."""
        return self._steps_done, self._wall

    def timing(self) -> dict[str, float]:
        """Mean ms per step: ``step_wall_ms`` and ``step_cpu_ms`` of this thread's training
        steps (wall beyond CPU is time spent waiting for a core or for the GIL), and
        ``batch_wait_ms``, the wait for the next looked-up batch."""
        n = max(self._steps_done, 1)
        return {"step_wall_ms": 1e3 * self._wall / n, "step_cpu_ms": 1e3 * self._cpu / n,
                "batch_wait_ms": 1e3 * self._wait / n}

    def _steps(self, step: int) -> None:
        while not self._stopping:
            waited = time.perf_counter()
            item = self.feed.get()
            self._wait += time.perf_counter() - waited
            if self._stopping:
                return
            if self._distributed and not every_rank_has_a_batch(item is not DONE):
                item = DONE
            if item is DONE:
                self._report(DONE)
                return
            if self._room is not None:
                self.loop.call_soon_threadsafe(self._room.release)
            wall, cpu = time.perf_counter(), time.thread_time()
            if self.first_step_at is None:
                self.first_step_at = wall
            result = self._step(item)
            self._wall += time.perf_counter() - wall
            self._cpu += time.thread_time() - cpu
            self._steps_done += 1
            step += 1
            pause = self.pauses_after(step)
            if pause:
                self.resume.clear()
            self._report((item, result))
            if pause:
                self.resume.wait()
