"""A worker's step over many plain tables of one shard in one kernel call each way.

A step reads and updates a few ids of every table (26 for a Criteo-shaped model). Table by
table, that is some ten kernel and numpy calls a table each way, whatever the number of ids:
most of the 0.9 ms of a lookup and 1.6 ms of a push of 2,348 ids over 26 tables (timed alone),
which the compute thread pays every step for its head ids where the shard is embedded. Where
every table of a request is plain (:meth:`EmbeddingTable.plain_view`: float32 rows in RAM)
and holds every id, :func:`lookup_plain` probes and copies all the rows in one
call, and :func:`push_plain` probes the ids, sums each table's duplicates and drops the
non-finite sums in one call, then runs the tables' optimizer (one call for all where they
share an Adagrad config, else each table's in turn): the rows, state, counters and
results of the tables' own ``lookup`` and ``push``, which serve every other case (the callers
fall back to them on None, nothing changed). Tables with a row cap (``max_rows``) or a TTL
are plain too: one more call marks the rows used (tick, uses, time) as their own calls do.
A lookup with new ids creates their rows first, table by table, where the tables would create
one for every new id and evict none (:attr:`EmbeddingTable.creates_freely`), then goes on in
one call: in a first epoch most of a step's tables have new ids (1.7 -> 1.2 ms of CPU a step,
26 Criteo tables, batch 512, fresh Zipf ids). Elsewhere (admission, a row cap) a request
with a new id goes table by table, where the table admits, creates and evicts; so does a push
with an id that has no row.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import numpy as np
from numba import njit

from services.common.errors import InvalidArgument
from services.common.kernel_arrays import array_1d, array_2d
from services.common.sharding import shard_of
from services.ps.arena import (
    dedup_slots,
    gather_rows,
    nonfinite_rows,
    set_bits,
    sum_rows_by_inverse,
    touch_slots,
)
from services.ps.locks import hold
from services.ps.optimizers import apply_updates
from services.ps.slotindex import find_slots
from services.ps.store import EmbeddingTable
from services.ps.table_io import (
    ACCUM,
    BUCKETS,
    DIRTY,
    LAST_USED,
    ROWS,
    SEEN,
    SLOT_IDS,
    TICKS,
    USES,
    PlainTable,
    PushResult,
)
from services.ps.tables import TableConfig

__all__ = ["dim_groups", "lookup_plain", "push_plain", "warm_up", "warm_up_groups"]

_SET = np.ones(1, dtype=bool)  # the one flag value _mark sets


@njit(cache=True, nogil=True)
def _find_all(tables, ids, bounds, slots):  # pragma: no cover - numba
    """``slots[bounds[t]:bounds[t + 1]]``: the slots of table ``t``'s ids (``tables``: the
    tables' rows of :attr:`PlainTable.refs`); True if every id has one (False as soon as a
    table's ids have not: a request of new ids costs little)."""
    for t in range(tables.shape[0]):
        lo, hi = bounds[t], bounds[t + 1]
        find_slots(array_1d(tables, t, BUCKETS, np.int32),
                   array_1d(tables, t, SLOT_IDS, np.uint64), ids[lo:hi], slots[lo:hi])
        for j in range(lo, hi):
            if slots[j] < 0:
                return False
    return True


@njit(cache=True, nogil=True)
def _find_absent(tables, ids, bounds, slots, absent):  # pragma: no cover - numba
    """``slots`` as :func:`_find_all` fills them, for every table; ``absent[t]``: how many
    of table ``t``'s ids have no slot."""
    for t in range(tables.shape[0]):
        lo, hi = bounds[t], bounds[t + 1]
        find_slots(array_1d(tables, t, BUCKETS, np.int32),
                   array_1d(tables, t, SLOT_IDS, np.uint64), ids[lo:hi], slots[lo:hi])
        absent[t] = 0
        for j in range(lo, hi):
            absent[t] += slots[j] < 0


@njit(cache=True, nogil=True)
def _find_gather(tables, ids, bounds, slots, out):  # pragma: no cover - numba
    """``out[j]``: the row of id ``j`` (table ``t``'s ids at ``bounds[t]:bounds[t + 1]``),
    ``slots[j]`` its slot; False, ``out`` unwritten, if an id has none."""
    if not _find_all(tables, ids, bounds, slots):
        return False
    dim = out.shape[1]
    for t in range(tables.shape[0]):
        lo, hi = bounds[t], bounds[t + 1]
        gather_rows(array_2d(tables, t, ROWS, np.float32, dim), slots[lo:hi], out[lo:hi])
    return True


@njit(cache=True, nogil=True)
def _find_sum(tables, ids, grads, bounds, uslots, summed, kept, dropped
              ):  # pragma: no cover - numba
    """Per table ``t``: its distinct slots in first-appearance order and their summed
    gradients (as a table's push sums them), the non-finite sums left out, at
    ``uslots``/``summed[bounds[t]:]``: ``kept[t]`` of them, ``dropped[t]`` left out. False,
    nothing written, if an id has no slot."""
    slots = np.empty(ids.shape[0], dtype=np.int64)
    if not _find_all(tables, ids, bounds, slots):
        return False
    first = np.empty(ids.shape[0], dtype=np.int64)
    inv = np.empty(ids.shape[0], dtype=np.int64)
    bad = np.empty(ids.shape[0], dtype=np.bool_)
    for t in range(tables.shape[0]):
        lo, hi = bounds[t], bounds[t + 1]
        s, u, total = slots[lo:hi], uslots[lo:hi], summed[lo:hi]
        k, dups = dedup_slots(s, array_1d(tables, t, SEEN, np.uint8), u, first[lo:hi],
                              inv[lo:hi])
        if dups:
            total[:k] = 0.0
            sum_rows_by_inverse(inv[lo:hi], grads[lo:hi], total)
        else:
            total[:k] = grads[lo:hi]
        dropped[t] = nonfinite_rows(total[:k], bad[:k])
        n = 0
        for p in range(k):
            if not bad[p]:
                u[n] = u[p]
                total[n] = total[p]
                n += 1
        kept[t] = n
    return True


@njit(cache=True, nogil=True)
def _mark_dirty(tables, uslots, bounds, kept):  # pragma: no cover - numba
    """Set table ``t``'s dirty flag of its applied slots ``uslots[bounds[t]:][:kept[t]]``:
    the rows a push changed."""
    for t in range(tables.shape[0]):
        set_bits(array_1d(tables, t, DIRTY, np.uint8),
                 uslots[bounds[t]:bounds[t] + kept[t]], _SET)


@njit(cache=True, nogil=True)
def _touch(tables, slots, bounds, counts, tick, now):  # pragma: no cover - numba
    """Mark table ``t``'s slots ``slots[bounds[t]:][:counts[t]]`` used at ``tick[t]``,
    ``now[t]``, where it keeps use bookkeeping (its ticks not empty)."""
    for t in range(tables.shape[0]):
        ticks = array_1d(tables, t, TICKS, np.int64)
        if ticks.shape[0]:
            lo = bounds[t]
            touch_slots(slots[lo:lo + counts[t]], ticks, array_1d(tables, t, USES, np.int64),
                        array_1d(tables, t, LAST_USED, np.float64), tick[t], now[t])


def _mark_used(views: Sequence[PlainTable], tables: np.ndarray, slots: np.ndarray,
               bounds: np.ndarray, counts: np.ndarray) -> None:
    """One use of each table that keeps use bookkeeping (its next tick, its clock's time):
    its slots ``slots[bounds[t]:][:counts[t]]`` marked, as its own lookup or push does."""
    if all(v.next_use is None for v in views):
        return
    tick = np.zeros(len(views), dtype=np.int64)
    now = np.zeros(len(views), dtype=np.float64)
    for t, view in enumerate(views):
        if view.next_use is not None:
            tick[t], now[t] = view.next_use()
    _touch(tables, slots, bounds, counts, tick, now)


@contextlib.contextmanager
def _plain(tables: Sequence[EmbeddingTable]) -> Iterator[list[PlainTable] | None]:
    """The tables' :class:`PlainTable` views under their locks (taken in name order, as any
    two callers take them), or None if one is not plain."""
    with hold([t.lock for t in sorted(tables, key=lambda t: t.config.name)]):
        views = [view for t in tables if (view := t.plain_view()) is not None]
        yield views if len(views) == len(tables) else None


def _refs(views: Sequence[PlainTable]) -> np.ndarray:
    """The tables' kernel rows, one matrix (``tables`` of the kernels here)."""
    return np.array([view.refs for view in views])


def _bounds(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.array(list(itertools.accumulate((p.shape[0] for p in parts), initial=0)),
                    dtype=np.int64)


def lookup_plain(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray], dim: int
                 ) -> np.ndarray | None:
    """The rows of ``ids[t]`` of ``tables[t]`` (tables of dim ``dim``), one after the other,
    as the tables' lookups give them (absent ids' rows created, see the module doc); None,
    nothing changed, unless every table is plain and holds every id or creates freely."""
    if not all(part.dtype == np.uint64 and part.ndim == 1 for part in ids) \
            or any(t.dim != dim for t in tables):
        return None  # the tables' own lookups check them
    bounds = _bounds(ids)
    out = np.empty((int(bounds[-1]), dim), dtype=np.float32)
    slots = np.empty(int(bounds[-1]), dtype=np.int64)
    flat = np.concatenate(ids)
    with _plain(tables) as views:
        if views is None:
            return None
        refs = _refs(views)
        if not _find_gather(refs, flat, bounds, slots, out):
            if not _create_absent(tables, refs, ids, flat, bounds, slots):
                return None
            views = [view for t in tables if (view := t.plain_view()) is not None]
            if len(views) != len(tables):
                return None
            refs = _refs(views)  # the arrays of tables that grew
            if not _find_gather(refs, flat, bounds, slots, out):
                return None
        _mark_used(views, refs, slots, bounds, np.diff(bounds))
        for view, part in zip(views, ids, strict=True):
            view.counters["lookups"] += 1
            view.counters["ids_looked_up"] += part.shape[0]
    return out


def _create_absent(tables: Sequence[EmbeddingTable], refs: np.ndarray,
                   ids: Sequence[np.ndarray], flat: np.ndarray, bounds: np.ndarray,
                   slots: np.ndarray) -> bool:
    """Create the rows of the ids that have none, as the tables' lookups would, where every
    table with such ids admits every id and has no row cap (a row made there evicts none and
    counts no admission); False, nothing changed, where one has not."""
    absent = np.empty(len(tables), dtype=np.int64)
    _find_absent(refs, flat, bounds, slots, absent)
    short = np.flatnonzero(absent).tolist()
    if not all(tables[t].creates_freely for t in short):
        return False
    for t in short:
        tables[t].create_rows(np.unique(ids[t][slots[bounds[t]:bounds[t + 1]] < 0]))
    return True


def push_plain(tables: Sequence[EmbeddingTable], ids: Sequence[np.ndarray],
               grads: Sequence[np.ndarray]) -> list[PushResult] | None:
    """Apply ``grads[t]`` (validated float32) to ``ids[t]`` of ``tables[t]`` as the tables'
    pushes would: their results; None, nothing changed, unless every table is plain and
    holds every id."""
    if not tables or not all(
            i.dtype == np.uint64 and i.ndim == 1 and g.dtype == np.float32
            and g.shape == (i.shape[0], tables[0].dim) and t.dim == tables[0].dim
            for t, i, g in zip(tables, ids, grads, strict=True)):
        return None  # the tables' own pushes check them (tables of one dim here)
    bounds = _bounds(ids)
    n = int(bounds[-1])
    uslots = np.empty(n, dtype=np.int64)
    summed = np.empty((n, tables[0].dim), dtype=np.float32)
    kept = np.empty(len(tables), dtype=np.int64)
    dropped = np.empty(len(tables), dtype=np.int64)
    with _plain(tables) as views:
        if views is None:
            return None
        refs = _refs(views)
        if not _find_sum(refs, np.concatenate(ids), np.concatenate(grads), bounds, uslots,
                         summed, kept, dropped):
            return None
        first = views[0].optimizer  # one config object in every table, or equal ones
        refused = None
        if all(v.optimizer is first or v.optimizer == first for v in views):
            refused = apply_updates(first, refs, ROWS, ACCUM, uslots, summed, bounds[:-1], kept)
            if refused is not None:
                for view, count in zip(views, refused.tolist(), strict=True):
                    view.counters["refused_nonfinite"] += count
        if refused is None:  # each table's optimizer in turn (it counts what it refuses)
            refused = np.array([view.apply(uslots[lo:lo + k], summed[lo:lo + k])
                                for view, lo, k in zip(views, bounds.tolist(), kept.tolist(),
                                                       strict=False)], dtype=np.int64)
        _mark_dirty(refs, uslots, bounds, kept)
        _mark_used(views, refs, uslots, bounds, kept)
        results = []
        for t, view in enumerate(views):
            k, bad, no = int(kept[t]), int(dropped[t]), int(refused[t])
            view.counters["pushes"] += 1
            view.counters["ids_pushed"] += ids[t].shape[0]
            view.counters["dropped_nonfinite"] += bad
            results.append(PushResult(applied=k - no, dropped_nonfinite=bad + no))
    return results


def warm_up(configs: Sequence[TableConfig]) -> None:
    """Look up and push ids on scratch tables of ``configs`` (of one dim), twice, each table
    alone and all of them as one request, so that numba loads (or compiles) now, not during
    the first training steps, every kernel tables of these kinds run (the kernels over
    several tables take any number of them under one signature). More ids than a scratch
    table first holds make it grow (its index rehashed). The scratch tables are dropped."""
    dims = {config.dim for config in configs}
    if len(dims) != 1:
        raise ValueError(f"warm_up needs tables of one dim, got dims {sorted(dims)}")
    tables = [EmbeddingTable(replace(config, initial_capacity=16)) for config in configs]
    ids = np.arange(64, dtype=np.uint64)
    grads = np.zeros((ids.size, dims.pop()), dtype=np.float32)
    for round_ in range(2):
        new = ids + np.uint64(ids.size * (2 * round_ + 1))  # ids no table holds yet
        for table in tables:
            lookup_plain([table], [new], table.dim)  # rows created first, then one call
            table.lookup(ids)
            table.push(ids, grads)
            lookup_plain([table], [ids], table.dim)
            push_plain([table], [ids], [grads])
        if len(tables) > 1:
            lookup_plain(tables, [new + np.uint64(ids.size)] * len(tables), tables[0].dim)
            lookup_plain(tables, [ids] * len(tables), tables[0].dim)
            push_plain(tables, [ids] * len(tables), [grads] * len(tables))


def dim_groups(tables: Mapping[str, EmbeddingTable]) -> list[list[str]]:
    """The tables' names by dim, in creation order: the requests a worker sends by default
    (its tables of one dim together)."""
    groups: dict[int, list[str]] = {}
    for name, table in tables.items():
        groups.setdefault(table.dim, []).append(name)
    return list(groups.values())


def warm_up_groups(requests: Sequence[Sequence[TableConfig]]) -> None:
    """Load the compiled kernels of the id check, of each table's kind and of each request
    of tables (:func:`warm_up`), before the first request; an InvalidArgument for a request
    of tables of several dims."""
    for configs in requests:
        if len({config.dim for config in configs}) != 1:
            raise InvalidArgument("the tables of one request must have one dim, got "
                                  f"{ {config.name: config.dim for config in configs} }")
    shard_of(np.arange(4, dtype=np.uint64), 2)
    for configs in requests:
        warm_up(configs)
