"""Arrow tables (Parquet files, JSON messages) → hashed columnar rows.

Categorical columns may be strings/binary (hashed as their bytes), integers (hashed as their
decimal text, so ``"42"`` and ``42`` are the same id), or lists of either (multi-hot); a
string column of a multi-hot feature is split on its separator. Nulls and empty strings are
missing (no id). Rows whose label is missing or not a number are rejected as bad records.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from services.common.batch import Jagged
from services.common.errors import ConfigError
from services.loader.hashing import (
    DenseTransform,
    hash_decimal_ints,
    hash_strings,
)
from services.loader.parsers import BadRecord, Parsed
from services.loader.schema import FeatureSchema

__all__ = ["ArrowConverter", "infer_schema"]


def _flat(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def _hash_scalar_column(arr: pa.Array, name: str, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes of every entry, mask of present entries) of a non-list column."""
    t = arr.type
    if pa.types.is_null(t):
        return np.zeros(len(arr), dtype=np.uint64), np.zeros(len(arr), dtype=bool)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
            or pa.types.is_large_binary(t):
        off_type = np.int64 if pa.types.is_large_string(t) or pa.types.is_large_binary(t) \
            else np.int32
        bufs = arr.buffers()
        offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset:arr.offset + len(arr) + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None \
            else np.zeros(0, dtype=np.uint8)
        present = np.diff(offsets) > 0
        hashes = hash_strings(data, offsets.astype(np.int64), name, buckets)
    elif pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t):
        ints = pc.cast(arr, pa.int64(), safe=False).fill_null(0)
        hashes = hash_decimal_ints(ints.to_numpy(zero_copy_only=False), name, buckets)
        present = np.ones(len(arr), dtype=bool)
    else:
        raise ConfigError(f"sparse column {name!r} has type {t}; use strings, integers or "
                          f"lists of them")
    if arr.null_count:
        present &= arr.is_valid().to_numpy(zero_copy_only=False)
    return hashes, present


def hash_column(arr: pa.Array | pa.ChunkedArray, name: str, buckets: int = 0,
                separator: str | None = None) -> Jagged:
    """One categorical column as a jagged id list (values uint64, lengths int32)."""
    arr = _flat(arr)
    n = len(arr)
    if separator and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = pc.split_pattern(arr, separator)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        child = _flat(pc.list_flatten(arr))
        hashes, present = _hash_scalar_column(child, name, buckets)
        lengths = np.bincount(parents[present], minlength=n).astype(np.int32)
        return Jagged(hashes[present], lengths)
    hashes, present = _hash_scalar_column(arr, name, buckets)
    return Jagged(hashes[present], present.astype(np.int32))


def _numbers(arr: pa.Array | pa.ChunkedArray) -> np.ndarray | None:
    """float64 values (NaN where null), or None when the column is not numeric."""
    arr = _flat(arr)
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)
            or pa.types.is_boolean(arr.type) or pa.types.is_null(arr.type)):
        try:
            arr = pc.cast(arr, pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
    return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)


def infer_schema(schema: pa.Schema, label: str, buckets: int = 0) -> FeatureSchema:
    """Numeric columns are dense, strings/binary/lists are sparse; ``label`` is the label."""
    if label not in schema.names:
        raise ConfigError(f"label column {label!r} is not in {schema.names}")
    dense, sparse = [], []
    for f in schema:
        if f.name == label:
            continue
        if pa.types.is_integer(f.type) or pa.types.is_floating(f.type):
            dense.append(f.name)
        else:
            sparse.append(f.name)
    return FeatureSchema(dense=dense, sparse=sparse, default_buckets=buckets)


class ArrowConverter:
    """Converts tables with the columns of ``schema`` (plus ``label``) to parsed rows."""

    def __init__(self, schema: FeatureSchema, label: str,
                 transform: DenseTransform | None = None) -> None:
        self.schema = schema
        self.label = label
        self.transform = transform or DenseTransform()
        self.columns = [label, *schema.dense, *schema.sparse]

    def convert(self, table: pa.Table) -> Parsed:
        """Rows of ``table``; ``Parsed.lines`` are row indices, ``bad`` the rejected rows.

        An absent feature column counts as missing in every row (JSON objects may omit keys);
        an absent or non-numeric label rejects the row.
        """
        n = table.num_rows
        names = set(table.column_names)
        labels = _numbers(table.column(self.label)) if self.label in names else None
        reasons = np.zeros(n, dtype=np.int8)  # 0 ok, 1 label, 2 dense
        if labels is None:
            reasons[:] = 1
        else:
            reasons[np.isnan(labels)] = 1
        dense = np.full((n, len(self.schema.dense)), np.nan)
        for d, name in enumerate(self.schema.dense):
            values = _numbers(table.column(name)) if name in names else dense[:, d]
            if values is None:
                reasons[reasons == 0] = 2
            else:
                dense[:, d] = values
        good = np.flatnonzero(reasons == 0)
        bad = [BadRecord(int(i), ("label_not_numeric", "dense_not_numeric")[reasons[i] - 1],
                         _row_bytes(table, int(i))) for i in np.flatnonzero(reasons)]
        kept = table.take(pa.array(good)) if good.shape[0] < n else table
        sparse: dict[str, Jagged] = {}
        for name in self.schema.sparse:
            if name in names and good.shape[0]:
                sparse[name] = hash_column(kept.column(name), name, self.schema.bucket_of(name),
                                           self.schema.multi_hot.get(name))
            else:
                sparse[name] = Jagged(np.zeros(0, np.uint64), np.zeros(good.shape[0], np.int32))
        out_labels = labels[good] if labels is not None else np.zeros(0)
        return Parsed(labels=out_labels.astype(np.float32), dense=self.transform.apply(dense[good]),
                      sparse=sparse, lines=good, bad=bad)


def _row_bytes(table: pa.Table, i: int) -> bytes:
    row = table.slice(i, 1).to_pylist()[0]
    return json.dumps(row, default=str).encode()
