"""Embedding rows of one table in a model version: sorted ids and rows, memory-mapped.

Files of table ``t<i>`` (``.npy``, loadable with ``np.load(mmap_mode="r")``)::

    t<i>-ids.npy     uint64 (n,), strictly increasing
    t<i>-rows.npy    (n, dim) float32 or float16, or int8 with
    t<i>-scale.npy   float32 (n,): row j is rows[j] * scale[j] (int8 only)

A lookup is a binary search (``np.searchsorted``) of the sorted ids; an id the table does not
hold gets the row the PS would create for it (``initial_rows``, deterministic per id), so an
id never trained serves as it would have in training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument

__all__ = ["ROW_DTYPES", "EmbeddingRows", "InitialRows", "TableRows", "encode_rows"]

ROW_DTYPES = ("float32", "float16", "int8")

# (the PS table config as a dict, uint64 ids) -> float32 (n, dim): the rows before any update
InitialRows = Callable[[Mapping[str, Any], np.ndarray], np.ndarray]


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


class EmbeddingRows:
    """A table's exported rows, memory-mapped; :meth:`lookup` answers any ids."""

    def __init__(self, name: str, directory: Path, entry: Mapping[str, Any],
                 initial_rows: InitialRows) -> None:
        self.name = name
        self.config = dict(entry["config"])
        self.dim = int(entry["dim"])
        self.dtype = str(entry["dtype"])
        files = entry["files"]
        self.ids = _load(directory / files["ids"])
        self.rows = _load(directory / files["rows"])
        self.scale = _load(directory / files["scale"]) if "scale" in files else None
        n = int(entry["rows"])
        if self.ids.shape != (n,) or self.ids.dtype != np.uint64 \
                or self.rows.shape != (n, self.dim) or self.rows.dtype != np.dtype(self.dtype) \
                or (self.dtype == "int8") != (self.scale is not None) \
                or (self.scale is not None and self.scale.shape != (n,)):
            raise FailedPrecondition(f"table {name}: files do not match the manifest "
                                     f"({n} rows of dim {self.dim} in {self.dtype})")
        self._initial_rows = initial_rows

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``(len(ids), dim)``: stored rows, initial rows for ids not stored."""
        ids = np.asarray(ids, dtype=np.uint64)
        out = np.empty((ids.size, self.dim), dtype=np.float32)
        n = len(self)
        pos = np.searchsorted(self.ids, ids) if n else np.zeros(ids.size, dtype=np.int64)
        found = pos < n
        found[found] = self.ids[pos[found]] == ids[found]
        hit = pos[found]
        rows = np.asarray(self.rows[hit], dtype=np.float32)
        if self.scale is not None:
            rows *= self.scale[hit][:, None]
        out[found] = rows
        if not bool(found.all()):
            fresh = self._initial_rows(self.config, ids[~found])
            out[~found] = np.asarray(fresh, dtype=np.float32).reshape(-1, self.dim)
        return out


def _load(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"{path} is not a readable array: {exc}") from exc
