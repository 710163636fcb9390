"""What a record holds (label, dense and sparse features) and how a text line lays it out.

:class:`FeatureSchema` names the features and their hashing options; :class:`TextLayout`
maps the columns of a delimited line to them. Built-ins cover Criteo (label, 13 integer and
26 categorical columns, tab-separated, no header) and Avazu (CSV with a header; ``click`` is
the label, ``id`` is dropped, every other column is categorical); any other CSV/TSV is
described by a small YAML or JSON schema file, see :func:`load_schema_file`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services.common.config import from_dict
from services.common.errors import ConfigError
from services.loader.hashing import feature_seed

__all__ = [
    "AVAZU_COLUMNS",
    "FeatureSchema",
    "SchemaFile",
    "TextLayout",
    "avazu_layout",
    "criteo_layout",
    "load_schema_file",
]

ROLE_IGNORE, ROLE_LABEL, ROLE_DENSE, ROLE_SPARSE = 0, 1, 2, 3

AVAZU_COLUMNS = [
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]


def _one_byte(sep: str, what: str) -> int:
    data = sep.encode()
    if len(data) != 1 or data in (b"\n", b"\r"):
        raise ConfigError(f"{what} must be one ASCII character other than a newline, got {sep!r}")
    return data[0]


@dataclass(kw_only=True, slots=True)
class FeatureSchema:
    """Feature names in output order, multi-hot separators and hashing buckets."""

    dense: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)
    multi_hot: dict[str, str] = field(default_factory=dict)
    buckets: dict[str, int] = field(default_factory=dict)
    default_buckets: int = 0

    def __post_init__(self) -> None:
        names = [*self.dense, *self.sparse]
        if len(names) != len(set(names)):
            raise ConfigError(f"feature names must be unique, got {names}")
        if not self.sparse:
            raise ConfigError("a schema needs at least one sparse (categorical) feature")
        for mapping, what in ((self.multi_hot, "multi_hot"), (self.buckets, "buckets")):
            unknown = sorted(set(mapping) - set(self.sparse))
            if unknown:
                raise ConfigError(f"{what} names unknown sparse features {unknown}")
        for name, sep in self.multi_hot.items():
            _one_byte(sep, f"multi_hot separator of {name!r}")
        if self.default_buckets < 0 or any(b < 0 for b in self.buckets.values()):
            raise ConfigError("bucket counts must be >= 0 (0: no hashing trick)")

    def bucket_of(self, name: str) -> int:
        return self.buckets.get(name, self.default_buckets)

    def seeds(self) -> np.ndarray:
        return np.array([feature_seed(n) for n in self.sparse], dtype=np.uint64)

    def bucket_array(self) -> np.ndarray:
        return np.array([self.bucket_of(n) for n in self.sparse], dtype=np.uint64)

    def separator_array(self) -> np.ndarray:
        """Per sparse feature its multi-hot separator byte (0: single-valued)."""
        return np.array([_one_byte(self.multi_hot[n], n) if n in self.multi_hot else 0
                         for n in self.sparse], dtype=np.uint8)

    def describe(self) -> dict[str, Any]:
        return {"dense_features": list(self.dense), "sparse_features": list(self.sparse),
                "multi_hot": dict(self.multi_hot),
                "buckets": {n: self.bucket_of(n) for n in self.sparse}}


@dataclass(kw_only=True, slots=True)
class TextLayout:
    """The columns of a delimited line in file order, and which one is the label."""

    columns: list[str]
    label: str
    schema: FeatureSchema
    delimiter: str = "\t"
    header: bool = False

    def __post_init__(self) -> None:
        if len(self.columns) != len(set(self.columns)):
            raise ConfigError(f"column names must be unique, got {self.columns}")
        missing = sorted({self.label, *self.schema.dense, *self.schema.sparse} - set(self.columns))
        if missing:
            raise ConfigError(f"columns {missing} are not in the file's columns {self.columns}")
        if self.label in self.schema.dense or self.label in self.schema.sparse:
            raise ConfigError(f"label column {self.label!r} cannot also be a feature")
        delim = _one_byte(self.delimiter, "delimiter")
        if delim in set(self.schema.separator_array().tolist()):
            raise ConfigError("a multi_hot separator cannot be the column delimiter")

    def roles(self) -> tuple[np.ndarray, np.ndarray]:
        """Per column its role (ignore/label/dense/sparse) and its index among its kind."""
        dense = {n: i for i, n in enumerate(self.schema.dense)}
        sparse = {n: i for i, n in enumerate(self.schema.sparse)}
        roles = np.zeros(len(self.columns), dtype=np.int8)
        slots = np.zeros(len(self.columns), dtype=np.int32)
        for c, name in enumerate(self.columns):
            if name == self.label:
                roles[c] = ROLE_LABEL
            elif name in dense:
                roles[c], slots[c] = ROLE_DENSE, dense[name]
            elif name in sparse:
                roles[c], slots[c] = ROLE_SPARSE, sparse[name]
        return roles, slots


def criteo_layout(num_dense: int = 13, num_sparse: int = 26, multi_hot: str | None = None,
                  buckets: int = 0) -> TextLayout:
    """Criteo TSV: label, ``I1..I{num_dense}``, ``C1..C{num_sparse}``; no header.

    ``multi_hot`` (e.g. ``","``) splits every categorical field on that separator, which the
    synthetic data set uses for its variable-length features.
    """
    if num_dense < 0 or num_sparse < 1:
        raise ConfigError(f"criteo needs dense >= 0 and sparse >= 1, got {num_dense}, {num_sparse}")
    dense = [f"I{i + 1}" for i in range(num_dense)]
    sparse = [f"C{i + 1}" for i in range(num_sparse)]
    schema = FeatureSchema(dense=dense, sparse=sparse, default_buckets=buckets,
                           multi_hot={n: multi_hot for n in sparse} if multi_hot else {})
    return TextLayout(columns=["label", *dense, *sparse], label="label", schema=schema,
                      delimiter="\t", header=False)


def avazu_layout(columns: list[str] | None = None, buckets: int = 0) -> TextLayout:
    """Avazu CSV: ``click`` is the label, ``id`` is dropped, every other column is categorical."""
    columns = list(columns or AVAZU_COLUMNS)
    if "click" not in columns:
        raise ConfigError(f"an Avazu file needs a 'click' column, got header {columns}")
    sparse = [c for c in columns if c not in ("id", "click")]
    return TextLayout(columns=columns, label="click", delimiter=",", header=True,
                      schema=FeatureSchema(sparse=sparse, default_buckets=buckets))


@dataclass(kw_only=True, slots=True)
class SchemaFile:
    """The schema file of ``csv:GLOB?schema=FILE`` (YAML or JSON)."""

    label: str
    sparse: list[str]
    dense: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    delimiter: str = ","
    header: bool = True
    multi_hot: dict[str, str] = field(default_factory=dict)
    buckets: dict[str, int] = field(default_factory=dict)
    default_buckets: int = 0

    def __post_init__(self) -> None:
        if not self.columns and not self.header:
            raise ConfigError("a schema without a header line must list its 'columns'")

    def feature_schema(self) -> FeatureSchema:
        return FeatureSchema(dense=list(self.dense), sparse=list(self.sparse),
                             multi_hot=dict(self.multi_hot), buckets=dict(self.buckets),
                             default_buckets=self.default_buckets)

    def layout(self, header_columns: list[str] | None = None) -> TextLayout:
        """The layout; ``header_columns`` (the file's header) is used when no columns are listed."""
        columns = list(self.columns or header_columns or [])
        return TextLayout(columns=columns, label=self.label, schema=self.feature_schema(),
                          delimiter=self.delimiter, header=self.header)


def load_schema_file(path: str | Path) -> SchemaFile:
    """Read and validate a schema file; any problem is a ConfigError naming the file."""
    try:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read schema file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"schema file {path} must hold a mapping")
    schema = from_dict(SchemaFile, data, where=f"schema file {path}")
    schema.feature_schema()  # validate names now, not at the first record
    return schema
