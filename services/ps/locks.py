"""Holding several tables' locks at once, the one way every caller takes them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

__all__ = ["hold"]


@contextlib.contextmanager
def hold(locks: Sequence[threading.RLock]) -> Iterator[None]:
    """Hold ``locks``, taken in the given order (callers order them by table name: two
    callers then never each hold a lock the other waits for), released in reverse order,
    also when the body raises. Plain acquires: an :class:`contextlib.ExitStack` of the
    locks costs ~1 µs a lock, which a multi-table request of 26 tables pays four times a
    step."""
    held = 0
    try:
        for lock in locks:
            lock.acquire()
            held += 1
        yield
    finally:
        for lock in reversed(locks[:held]):
            lock.release()
