"""Embedding rows of one table in a model version: sorted ids and rows, memory-mapped.

Files of table ``t<i>`` (``.npy``, loadable with ``np.load(mmap_mode="r")``)::

    t<i>-ids.npy         uint64 (n,), strictly increasing
    t<i>-rows.npy        (n, dim) float32 or float16, or int8 with
    t<i>-scale.npy       float32 (n,): row j is rows[j] * scale[j] (int8 only)
    t<i>-tombstones.npy  uint64, sorted (incremental versions only): ids deleted since the base

A lookup is a binary search (``np.searchsorted``) of the sorted ids, newest layer first (an
incremental version over its base); an id the version does not hold (never trained, or
deleted: evicted on the PS) gets the row the PS would create for it (``initial_rows``,
deterministic per id), so it serves as it would have in training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument

__all__ = ["ROW_DTYPES", "EmbeddingRows", "InitialRows", "PSLookup", "PSRows", "RowLayer",
           "TableRows", "decode_rows", "encode_rows", "find_sorted", "lookup_tables"]

ROW_DTYPES = ("float32", "float16", "int8")

# (the PS table config as a dict, uint64 ids) -> float32 (n, dim): the rows before any update
InitialRows = Callable[[Mapping[str, Any], np.ndarray], np.ndarray]
# {table: uint64 ids} -> {table: float32 (len(ids), dim)}: one read-only lookup of several
# tables on the live PS shards (one message per shard)
PSLookup = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(slots=True, frozen=True)
class TableRows:
    """One table's rows to export: ``ids`` uint64 (any order, unique), ``rows`` (n, dim) float,
    ``config`` the PS table config (dim, initializer, seed, ...) as a dict."""

    name: str
    ids: np.ndarray
    rows: np.ndarray
    config: Mapping[str, Any]

    def __post_init__(self) -> None:
        dim = int(self.config.get("dim", -1))
        if self.ids.ndim != 1 or self.rows.ndim != 2 or self.rows.shape != (self.ids.size, dim):
            raise InvalidArgument(f"table {self.name}: rows must be (len(ids), {dim}), got "
                                  f"ids {self.ids.shape} and rows {self.rows.shape}")

    def sorted(self) -> TableRows:
        """The same rows with ids in increasing order (duplicate ids are an error)."""
        ids = np.asarray(self.ids, dtype=np.uint64)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise InvalidArgument(f"table {self.name}: ids repeat")
        return TableRows(name=self.name, ids=ids,
                         rows=np.asarray(self.rows, dtype=np.float32)[order], config=self.config)


def encode_rows(rows: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(stored rows, per-row scale or None)`` of float32 ``rows`` in ``dtype``."""
    if dtype == "float32":
        return np.ascontiguousarray(rows, dtype=np.float32), None
    if dtype == "float16":
        return rows.astype(np.float16), None
    if dtype == "int8":
        peak = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(rows.shape[0])
        scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
        return q, scale
    raise InvalidArgument(f"row dtype must be one of {ROW_DTYPES}, got {dtype!r}")


def decode_rows(stored: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """float32 rows of stored rows (and their int8 scale)."""
    rows = np.asarray(stored, dtype=np.float32)
    return rows * scale[:, None] if scale is not None else rows


def find_sorted(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mask of ``ids`` present in ``sorted_ids``, their positions there)."""
    n = int(sorted_ids.shape[0])
    pos = np.searchsorted(sorted_ids, ids) if n else np.zeros(ids.size, dtype=np.int64)
    found = pos < n
    found[found] = sorted_ids[pos[found]] == ids[found]
    return found, pos[found]


class RowLayer:
    """One version's files of a table: its rows, and (incremental) the ids it deleted."""

    def __init__(self, name: str, directory: Path, entry: Mapping[str, Any]) -> None:
        dim, dtype, n = int(entry["dim"]), str(entry["dtype"]), int(entry["rows"])
        files = entry["files"]
        self.ids = _load(directory / files["ids"])
        self.rows = _load(directory / files["rows"])
        self.scale = _load(directory / files["scale"]) if "scale" in files else None
        self.tombstones = (_load(directory / files["tombstones"]) if "tombstones" in files
                           else np.empty(0, dtype=np.uint64))
        if self.ids.shape != (n,) or self.ids.dtype != np.uint64 \
                or self.rows.shape != (n, dim) or self.rows.dtype != np.dtype(dtype) \
                or (dtype == "int8") != (self.scale is not None) \
                or (self.scale is not None and self.scale.shape != (n,)) \
                or self.tombstones.dtype != np.uint64 or self.tombstones.ndim != 1:
            raise FailedPrecondition(f"table {name} in {directory.name}: files do not match "
                                     f"the manifest ({n} rows of dim {dim} in {dtype})")

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of ``ids`` this layer holds, their float32 rows)."""
        found, pos = find_sorted(self.ids, ids)
        scale = self.scale[pos] if self.scale is not None else None
        return found, decode_rows(self.rows[pos], scale)


class EmbeddingRows:
    """A table's exported rows, memory-mapped, over one full version and the incremental
    versions on top of it (``layers``, newest first); :meth:`lookup` answers any ids."""

    def __init__(self, name: str, config: Mapping[str, Any], layers: list[RowLayer],
                 initial_rows: InitialRows) -> None:
        self.name = name
        self.config = dict(config)
        self.dim = int(config["dim"])
        self.layers = layers
        self._initial_rows = initial_rows

    def __len__(self) -> int:
        return int(self.live_ids().size) if len(self.layers) > 1 else int(self.layers[0].ids.size)

    def stored(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of ``ids`` the version holds, float32 ``(len(ids), dim)`` rows; rows of ids
        it does not hold are undefined)."""
        ids = np.asarray(ids, dtype=np.uint64)
        out = np.zeros((ids.size, self.dim), dtype=np.float32)
        have = np.zeros(ids.size, dtype=bool)
        pending = np.arange(ids.size)
        for layer in self.layers:  # newest first: a newer row or tombstone wins
            found, rows = layer.find(ids[pending])
            out[pending[found]] = rows
            have[pending[found]] = True
            pending = pending[~found]
            if layer.tombstones.size and pending.size:
                pending = pending[~find_sorted(layer.tombstones, ids[pending])[0]]
        return have, out

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``(len(ids), dim)``: stored rows, initial rows for ids not stored (never
        trained, or deleted since)."""
        ids = np.asarray(ids, dtype=np.uint64)
        have, out = self.stored(ids)
        if not bool(have.all()):
            fresh = self._initial_rows(self.config, ids[~have])
            out[~have] = np.asarray(fresh, dtype=np.float32).reshape(-1, self.dim)
        return out

    def live_ids(self) -> np.ndarray:
        """Every id the version holds, sorted."""
        ids = np.asarray(self.layers[-1].ids)
        for layer in reversed(self.layers[:-1]):  # oldest incremental first
            gone = np.union1d(layer.tombstones, layer.ids)
            ids = np.union1d(ids[~np.isin(ids, gone)], layer.ids)
        return ids


class PSRows:
    """A table a version reads from the live PS shards (read-only lookups: no row created,
    none marked used) instead of its own files, for tables too big to copy. Its rows are the
    PS's current ones: they move on with training while the dense weights stay the
    version's. Loading checks the PS serves the table at the version's dim."""

    def __init__(self, name: str, config: Mapping[str, Any], lookup: PSLookup) -> None:
        self.name = name
        self.config = dict(config)
        self.dim = int(config["dim"])
        self.read = lookup  # shared by every PS table of a version
        self.lookup(np.zeros(1, dtype=np.uint64))

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``(len(ids), dim)``: the PS's rows now (initial rows for ids it lacks)."""
        return lookup_tables({self.name: self}, {self.name: ids})[self.name]

    def checked(self, ids: np.ndarray, rows: Any) -> np.ndarray:
        """``rows`` the PS gave for ``ids``, float32, checked against the version's dim."""
        rows = np.asarray(rows, dtype=np.float32)
        if rows.shape != (np.size(ids), self.dim):
            raise FailedPrecondition(f"table {self.name} on the PS has rows of shape "
                                     f"{list(rows.shape[1:])}, the version dim {self.dim}")
        return rows


def lookup_tables(tables: Mapping[str, EmbeddingRows | PSRows],
                  ids: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows of each table's ids (``{table: ids}``); the tables on the PS in one read."""
    ids = {t: np.asarray(i, dtype=np.uint64) for t, i in ids.items()}
    on_ps = {t: rows for t, rows in tables.items() if t in ids and isinstance(rows, PSRows)}
    out = {t: tables[t].lookup(i) for t, i in ids.items() if t not in on_ps}
    if on_ps:
        read = next(iter(on_ps.values())).read({t: ids[t] for t in on_ps})  # one read for all
        out.update((t, rows.checked(ids[t], read[t])) for t, rows in on_ps.items())
    return out


def _load(path: Path) -> np.ndarray:
    try:
        # a plain ndarray over the mapping: a np.memmap wraps every slice it gives (a third
        # of a small batch's lookup time)
        return np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"{path} is not a readable array: {exc}") from exc
