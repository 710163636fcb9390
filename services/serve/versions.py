"""Which model version a server answers with: load, watch, hot-swap, roll back.

:class:`VersionManager` holds the active :class:`Predictor` as one reference. A swap loads
the new version completely (checksums, rows, weights) in a thread of its own at a lower CPU
priority than the threads answering requests (loading never slows answers down more than
the cores allow), then replaces the
reference in one assignment: a batch that read the reference before keeps its Predictor to
the end, every later batch gets the new one, so no answer mixes two versions and none is
dropped. A version that fails to load is refused (remembered, not retried) and the active
one keeps serving.

Following: by default the manager follows the newest complete version (:meth:`refresh`, run
by the watcher every ``watch_interval_s``). :meth:`activate` of a version id pins it (a
rollback or roll-forward that the watcher leaves alone); ``activate("latest")`` unpins and
goes back to following the newest.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.common.errors import FailedPrecondition, NotFound, PersimmonError
from services.serve.export import MANIFEST, list_versions
from services.serve.predictor import Predictor
from services.serve.rows import InitialRows, PSLookup

__all__ = ["LATEST", "LOADER_NICE", "VersionManager"]

log = logging.getLogger("persimmon.serve")

LATEST = "latest"
LOADER_NICE = 10  # how much lower the version loader's thread runs than the answering ones


def _lower_priority() -> None:
    """Lower this thread's CPU priority by LOADER_NICE below the process's (Linux schedules
    threads one by one; 19 is the lowest)."""
    if hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid,
                           min(os.getpriority(os.PRIO_PROCESS, tid) + LOADER_NICE, 19))
        except OSError:  # not permitted here: load at the same priority
            log.debug("could not lower the version loader's priority")


class VersionManager:
    """The active version of ``model_dir`` and the versions present (see module docstring).

    ``on_swap(predictor)`` is called after every swap (metrics); ``ps_lookup`` reads the
    tables a version keeps on the live PS.
    """

    def __init__(self, model_dir: Path | str, *, initial_rows: InitialRows, verify: bool = True,
                 on_swap: Callable[[Predictor], None] | None = None,
                 ps_lookup: PSLookup | None = None) -> None:
        self.model_dir = Path(model_dir)
        self._initial_rows = initial_rows
        self._ps_lookup = ps_lookup
        self._verify = verify
        self._on_swap = on_swap
        self.active: Predictor | None = None
        self.pinned: str | None = None
        self.refused: dict[str, str] = {}  # version id -> why it was refused
        self._refused_at: dict[str, int] = {}  # version id -> its manifest's mtime then
        self._verified: set[str] = set()  # checksums checked (a base is checked once)
        self._lock = asyncio.Lock()
        self.swaps = 0
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="version-loader",
                                          initializer=_lower_priority)

    def close(self) -> None:
        """Stop the loader thread (a load in progress finishes first)."""
        self._loader.shutdown(wait=False)

    def current(self) -> Predictor | None:
        """The Predictor answering now (None before the first version is loaded)."""
        return self.active

    async def refresh(self) -> bool:
        """Follow the newest loadable version (unless pinned); True when it swapped."""
        async with self._lock:
            if self.pinned is not None:
                return False
            versions = await asyncio.to_thread(list_versions, self.model_dir)
            active = self.active
            for manifest in reversed(versions):
                version_id = manifest["version_id"]
                if active is not None and version_id == active.version_id:
                    return False
                if active is not None and (manifest["step"], manifest["created"]) <= (
                        active.step, active.manifest["created"]):
                    return False  # nothing newer than the active one loads
                if self._known_bad(version_id):
                    continue
                try:
                    predictor = await self._load(version_id)
                except PersimmonError:
                    continue
                self._swap(predictor)
                return True
            return False

    async def activate(self, version_id: str) -> Predictor:
        """Serve ``version_id`` from now on and pin it (``latest``: follow the newest)."""
        if version_id == LATEST:
            self.pinned = None
            await self.refresh()
            if self.active is None:
                raise NotFound(f"no loadable model version in {self.model_dir}")
            return self.active
        async with self._lock:
            versions = {m["version_id"] for m in
                        await asyncio.to_thread(list_versions, self.model_dir)}
            if version_id not in versions:
                raise NotFound(f"model version {version_id!r} is not in {self.model_dir} "
                               "(or is incomplete)")
            active = self.active
            if active is None or active.version_id != version_id:
                self._swap(await self._load(version_id))
            self.pinned = version_id
            assert self.active is not None
            return self.active

    async def listing(self) -> list[dict[str, Any]]:
        """Every complete version, oldest first, with whether it is active or refused."""
        versions = await asyncio.to_thread(list_versions, self.model_dir)
        active = self.active.version_id if self.active is not None else None
        return [{"version_id": m["version_id"], "step": m["step"], "created": m["created"],
                 "model": m["model"].get("name"), "row_dtype": m["row_dtype"],
                 "active": m["version_id"] == active, "pinned": m["version_id"] == self.pinned,
                 "refused": self.refused.get(m["version_id"])} for m in versions]

    async def _load(self, version_id: str) -> Predictor:
        started = time.perf_counter()
        try:
            predictor = await asyncio.get_running_loop().run_in_executor(
                self._loader, functools.partial(
                    Predictor.load, self.model_dir / version_id,
                    initial_rows=self._initial_rows, verify=self._verify,
                    verified=self._verified, ps_lookup=self._ps_lookup))
        except PersimmonError as exc:
            self._refuse(version_id, exc)
            raise
        except Exception as exc:  # a version must never take the server down
            self._refuse(version_id, exc)
            raise FailedPrecondition(f"model version {version_id!r} cannot be loaded: "
                                     f"{exc}") from exc
        log.info("loaded model version %s (step %d) in %.2f s", version_id, predictor.step,
                 time.perf_counter() - started)
        return predictor

    def _swap(self, predictor: Predictor) -> None:
        previous = self.active
        self.active = predictor  # the one reference every new batch reads
        self.swaps += 1
        log.info("serving model version %s (was %s)", predictor.version_id,
                 previous.version_id if previous is not None else None)
        if self._on_swap is not None:
            self._on_swap(predictor)

    def _mtime(self, version_id: str) -> int:
        try:
            return (self.model_dir / version_id / MANIFEST).stat().st_mtime_ns
        except OSError:
            return -1

    def _refuse(self, version_id: str, exc: BaseException) -> None:
        log.error("refused model version %s: %s", version_id, exc)
        self.refused[version_id] = str(exc)
        self._refused_at[version_id] = self._mtime(version_id)

    def _known_bad(self, version_id: str) -> bool:
        """Refused before and its manifest unchanged since."""
        return version_id in self.refused and self._refused_at.get(version_id) == \
            self._mtime(version_id)
