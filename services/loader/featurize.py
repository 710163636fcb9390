"""The feature spec of a model version: how raw records become model inputs, as in training.

A :class:`FeatureSpec` records what the loader did to every record of the training data: the
layout (``criteo`` / ``text`` delimited lines, or ``json`` objects), the sparse features with
their hashing (the id of a value is :func:`services.loader.hashing.hash_value` of the feature
name and the value's text, ``% buckets`` when the feature has buckets; multi-hot values are
split on their separator) and the dense features with the :class:`DenseTransform` applied to
them. Serving featurizes with the loader's own code (:class:`ArrowConverter` for JSON
objects, :class:`TextParser` for lines), so a served record gets exactly the ids and dense
values its training twin got.

JSON records are checked strictly before hashing: a field that is not a feature (nor the
label) is an error, a missing feature is an error (send ``null`` for a missing value, which
is what an omitted key meant in training), a dense value must be a finite number or null, a
sparse value a string, an integer, a list of them, or null.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from services.common.batch import Jagged
from services.common.config import from_dict
from services.common.errors import ConfigError, InvalidArgument
from services.loader.arrow import ArrowConverter
from services.loader.config import SourceSpec
from services.loader.hashing import DenseTransform, feature_seed
from services.loader.parsers import TextParser
from services.loader.planted import synthetic_profile
from services.loader.schema import FeatureSchema, TextLayout, criteo_layout, load_schema_file
from services.loader.sources.base import message_layout

__all__ = ["LAYOUTS", "FeatureSpec", "Features", "spec_from_source"]

LAYOUTS = ("json", "criteo", "text")


@dataclass(slots=True, frozen=True)
class Features:
    """Model inputs of B records: per sparse feature a jagged id list, dense ``(B, D)``."""

    sparse: dict[str, Jagged]
    dense: np.ndarray

    @property
    def size(self) -> int:
        return int(self.dense.shape[0])

    @staticmethod
    def concat(parts: Sequence[Features]) -> Features:
        """The records of ``parts`` one after another (every part has the same features)."""
        if len(parts) == 1:
            return parts[0]
        names = list(parts[0].sparse)
        sparse = {n: Jagged(np.concatenate([p.sparse[n].values for p in parts]),
                            np.concatenate([p.sparse[n].lengths for p in parts]))
                  for n in names}
        return Features(sparse=sparse, dense=np.concatenate([p.dense for p in parts]))


@dataclass(kw_only=True, slots=True)
class FeatureSpec:
    """What the loader did to each training record (see the module docstring)."""

    layout: str = "json"
    label: str = "label"
    dense: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)
    multi_hot: dict[str, str] = field(default_factory=dict)
    buckets: dict[str, int] = field(default_factory=dict)
    default_buckets: int = 0
    columns: list[str] = field(default_factory=list)
    delimiter: str = "\t"
    transform: DenseTransform = field(default_factory=DenseTransform)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"feature spec layout must be one of {LAYOUTS}, got {self.layout!r}")
        if isinstance(self.transform, dict):
            self.transform = from_dict(DenseTransform, self.transform, where="transform")
        self.schema()  # validates names, buckets and separators
        if self.layout != "json":
            self.text_layout()

    @classmethod
    def from_layout(cls, layout: TextLayout, transform: DenseTransform | None = None, *,
                    kind: str = "text") -> FeatureSpec:
        """The spec of delimited files read with ``layout`` (``kind``: criteo or text)."""
        s = layout.schema
        return cls(layout=kind, label=layout.label, dense=list(s.dense), sparse=list(s.sparse),
                   multi_hot=dict(s.multi_hot), buckets=dict(s.buckets),
                   default_buckets=s.default_buckets, columns=list(layout.columns),
                   delimiter=layout.delimiter, transform=transform or DenseTransform())

    @classmethod
    def from_schema(cls, schema: FeatureSchema, label: str = "label",
                    transform: DenseTransform | None = None) -> FeatureSpec:
        """The spec of JSON objects (or Parquet rows) with the features of ``schema``."""
        return cls(layout="json", label=label, dense=list(schema.dense),
                   sparse=list(schema.sparse), multi_hot=dict(schema.multi_hot),
                   buckets=dict(schema.buckets), default_buckets=schema.default_buckets,
                   transform=transform or DenseTransform())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FeatureSpec:
        body = {k: v for k, v in data.items() if k != "hashing"}
        return from_dict(cls, body, where="feature spec")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``hashing`` (each sparse feature's FNV basis and buckets) is
        informational, for readers that hash in another language."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["transform"] = dataclasses.asdict(self.transform)
        out["hashing"] = {n: {"seed": feature_seed(n), "buckets": self.schema().bucket_of(n),
                              "separator": self.multi_hot.get(n)} for n in self.sparse}
        return out

    def schema(self) -> FeatureSchema:
        return FeatureSchema(dense=list(self.dense), sparse=list(self.sparse),
                             multi_hot=dict(self.multi_hot), buckets=dict(self.buckets),
                             default_buckets=self.default_buckets)

    def text_layout(self) -> TextLayout:
        return TextLayout(columns=list(self.columns), label=self.label, schema=self.schema(),
                          delimiter=self.delimiter, header=False)

    # ---- featurization -------------------------------------------------------------------

    def records(self, records: Sequence[Any]) -> Features:
        """Features of JSON objects (checked strictly, see the module docstring)."""
        if not records:
            raise InvalidArgument("no records given")
        columns = self._columns(records)
        table = pa.table({self.label: pa.array(np.zeros(len(records)), type=pa.float64()),
                          **columns})
        parsed = ArrowConverter(self.schema(), self.label, self.transform).convert(table)
        if parsed.bad or parsed.size != len(records):
            reasons = sorted({b.reason for b in parsed.bad})
            raise InvalidArgument(f"{len(parsed.bad)} records could not be featurized: {reasons}")
        return Features(sparse=dict(parsed.sparse), dense=parsed.dense)

    def lines(self, lines: Sequence[Any]) -> Features:
        """Features of delimited lines in the training files' layout (label column included;
        its value is not used)."""
        if self.layout == "json":
            raise InvalidArgument("this model was trained on JSON records: send 'records'")
        if not lines:
            raise InvalidArgument("no lines given")
        if not all(isinstance(x, str) for x in lines):
            raise InvalidArgument("lines must be strings")
        if any("\n" in x or "\r" in x for x in lines):
            raise InvalidArgument("a line must not contain a newline")
        parsed = TextParser(self.text_layout(), self.transform).parse(
            ("\n".join(lines) + "\n").encode())
        if parsed.bad:
            bad = ", ".join(f"line {b.position}: {b.reason}" for b in parsed.bad[:10])
            raise InvalidArgument(f"{len(parsed.bad)} lines are malformed ({bad})")
        return Features(sparse=dict(parsed.sparse), dense=parsed.dense)

    def _columns(self, records: Sequence[Any]) -> dict[str, pa.Array]:
        known = {self.label, *self.dense, *self.sparse}
        dense: dict[str, list[float | None]] = {n: [] for n in self.dense}
        sparse: dict[str, list[Any]] = {n: [] for n in self.sparse}
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise InvalidArgument(f"record {i} must be a JSON object, "
                                      f"got {type(record).__name__}")
            unknown = sorted(set(record) - known)
            if unknown:
                raise InvalidArgument(f"record {i} has unknown fields {unknown[:10]}; the "
                                      f"model's features are {[*self.dense, *self.sparse]}")
            missing = [n for n in (*self.dense, *self.sparse) if n not in record]
            if missing:
                raise InvalidArgument(f"record {i} lacks fields {missing[:10]} (send null for "
                                      "a missing value)")
            for name in self.dense:
                dense[name].append(_dense_value(record[name], i, name))
            for name in self.sparse:
                sparse[name].append(_sparse_value(record[name], i, name))
        out: dict[str, pa.Array] = {n: pa.array(v, type=pa.float64()) for n, v in dense.items()}
        for name, values in sparse.items():
            out[name] = self._sparse_column(name, values)
        return out

    def _sparse_column(self, name: str, values: list[Any]) -> pa.Array:
        if not any(isinstance(v, list) for v in values):
            return pa.array(values, type=pa.string())
        sep = self.multi_hot.get(name)
        lists = [v if v is None or isinstance(v, list) else (v.split(sep) if sep else [v])
                 for v in values]
        return pa.array(lists, type=pa.list_(pa.string()))


def _dense_value(value: Any, i: int, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"record {i}: dense field {name!r} must be a number or null, "
                              f"got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        raise InvalidArgument(f"record {i}: dense field {name!r} must be a finite number or "
                              f"null, got an integer of {len(str(abs(value)))} digits") from None
    if not math.isfinite(number):  # JSON has no NaN or infinity; Python's parser reads them
        raise InvalidArgument(f"record {i}: dense field {name!r} must be a finite number or "
                              f"null, got {number}")
    return number


def _sparse_scalar(value: Any, i: int, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # typed sources hash integers as their decimal text
    raise InvalidArgument(f"record {i}: sparse field {name!r} must be a string, an integer, a "
                          f"list of them or null, got {type(value).__name__}")


def _sparse_value(value: Any, i: int, name: str) -> str | list[str] | None:
    if value is None:
        return None
    if isinstance(value, list):
        return [_sparse_scalar(v, i, name) for v in value]
    return _sparse_scalar(value, i, name)


def spec_from_source(source: str, transform: DenseTransform | None = None) -> FeatureSpec:
    """The feature spec of the data a loader read with ``--source SOURCE`` (criteo, csv,
    kafka/redis with their ``format``, synthetic), or of a FeatureSpec JSON file ``*.json``."""
    if source.endswith(".json") and ":" not in source.split("/")[0]:
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read feature spec file {source}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"feature spec file {source} must hold an object")
        return FeatureSpec.from_dict(data)
    spec = SourceSpec.parse(source)
    kind = spec.kind.value
    if kind == "criteo":
        layout = criteo_layout(spec.int_param("dense", 13), spec.int_param("sparse", 26),
                               multi_hot=spec.params.get("multi_hot") or None,
                               buckets=spec.int_param("buckets", 0))
        return FeatureSpec.from_layout(layout, transform, kind="criteo")
    if kind == "csv":
        return FeatureSpec.from_layout(load_schema_file(spec.params["schema"]).layout(),
                                       transform)
    if kind in ("kafka", "redis"):
        fmt, text, schema_file = message_layout(spec)
        if text is not None:
            return FeatureSpec.from_layout(text, transform,
                                           kind="criteo" if fmt == "criteo" else "text")
        return FeatureSpec.from_schema(schema_file.feature_schema(), schema_file.label,
                                       transform)
    if kind == "synthetic":
        data = synthetic_profile(spec.params.get("profile", "toy"))
        layout = criteo_layout(data.num_dense, len(data.vocab_sizes), multi_hot=",")
        return FeatureSpec.from_layout(layout, transform, kind="criteo")
    raise ConfigError(f"export cannot describe a {kind} source yet: write a feature spec "
                      "JSON file (FeatureSpec fields) and pass its path")
