"""One model version, loaded and immutable: featurize, look rows up, pool, run the model.

:meth:`Predictor.load` reads a version directory (:mod:`services.serve.export`): it checks
the manifest and every file's sha256, memory-maps the rows, reads the dense weights
(safetensors, as NumPy arrays) and builds the eval-mode forward of the model the manifest
describes (:mod:`services.serve.forward`). Nothing in a Predictor changes after loading, so
a server swaps versions by swapping the reference: a batch that took a Predictor computes all
of its answer, dense and sparse, from that one version.

The forward pass is the trainer's, in NumPy (no torch): each table's unique ids are looked
up once (:class:`EmbeddingRows`: stored rows, initial rows for ids never trained), each
feature's rows pooled per record in the training's pooling mode
(:func:`~services.serve.bags.pool_bags`) and fed to the model with the dense features; the
answer is ``sigmoid(logits)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from services.common.batch import Jagged
from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument
from services.loader import Features, FeatureSpec
from services.serve.bags import POOLING, pool_bags
from services.serve.export import (
    SPEC,
    model_sparse_dims,
    open_tables,
    verify_version,
    version_chain,
)
from services.serve.forward import DenseForward, dense_forward, sigmoid
from services.serve.rows import EmbeddingRows, InitialRows, PSLookup, PSRows, lookup_tables
from services.serve.weights import read_dense

__all__ = ["Predictor"]

_MAX_ID = 2**64 - 1


class Predictor:
    """A loaded model version (see the module docstring); build with :meth:`load`."""

    def __init__(self, manifest: Mapping[str, Any], spec: FeatureSpec, model: DenseForward,
                 tables: Mapping[str, EmbeddingRows | PSRows]) -> None:
        self.manifest = dict(manifest)
        self.version_id: str = manifest["version_id"]
        self.step: int = int(manifest["step"])
        self.spec = spec
        self.model = model
        self.tables = dict(tables)
        self.features: dict[str, str] = dict(manifest["features"])
        self.num_dense = int(manifest["num_dense"])
        self.pooling: str = manifest["pooling"]

    @classmethod
    def load(cls, version_dir: Path | str, *, initial_rows: InitialRows,
             verify: bool = True, verified: set[str] | None = None,
             ps_lookup: PSLookup | None = None) -> Predictor:
        """Load and check a version; any problem is a FailedPrecondition naming it.
        ``ps_lookup`` reads the tables the version keeps on the live PS.

        ``verified``: versions (``id@created``) whose checksums were checked before (a
        version never changes once complete), skipped; the versions checked now are added."""
        directory = Path(version_dir)
        chain = version_chain(directory.parent, directory.name)
        manifest = chain[-1]
        keys = [f"{m['version_id']}@{m['created']}" for m in chain]
        if verify:
            for m, key in zip(chain, keys, strict=True):
                if verified is None or key not in verified:
                    verify_version(directory.parent / m["version_id"], m)
        if verify and verified is not None:
            verified.update(keys)
        try:
            spec = FeatureSpec.from_dict(_json(directory / SPEC))
            if manifest["pooling"] not in POOLING:
                raise ValueError(f"pooling must be one of {POOLING}, got "
                                 f"{manifest['pooling']!r}")
            model = dense_forward(manifest["model"],
                                  sparse_dims=model_sparse_dims(manifest, spec),
                                  num_dense=int(manifest["num_dense"]),
                                  state=read_dense(directory, manifest))
        except (ConfigError, FailedPrecondition, OSError, ValueError, KeyError,
                TypeError) as exc:
            raise FailedPrecondition(f"model version {directory.name} cannot be loaded: "
                                     f"{exc}") from exc
        tables = open_tables(directory.parent, chain, initial_rows, ps_lookup)
        missing = sorted(set(manifest["features"].values()) - set(tables))
        if missing:
            raise FailedPrecondition(f"model version {directory.name} lacks tables {missing}")
        return cls(manifest, spec, model, tables)

    def describe(self) -> dict[str, Any]:
        return {"version_id": self.version_id, "step": self.step,
                "created": self.manifest["created"], "model": self.manifest["model"]["name"],
                "row_dtype": self.manifest["row_dtype"],
                "base": self.manifest.get("base"),
                "tables": {n: {"rows": t["rows"], "tombstones": t.get("tombstones", 0)}
                           for n, t in self.manifest["tables"].items()}}

    # ---- inputs ----------------------------------------------------------------------------

    def featurize(self, request: Mapping[str, Any]) -> Features:
        """Features of one request body: ``records`` (JSON objects), ``lines`` (delimited
        lines) or ``ids`` (pre-hashed ids per feature, per record) with ``dense``."""
        kinds = [k for k in ("records", "lines", "ids") if request.get(k) is not None]
        if len(kinds) != 1:
            raise InvalidArgument("give exactly one of 'records', 'lines' or 'ids'")
        if kinds[0] == "records":
            return self.spec.records(request["records"])
        if kinds[0] == "lines":
            return self.spec.lines(request["lines"])
        return self.prehashed(request["ids"], request.get("dense"))

    def prehashed(self, ids: Any, dense: Any) -> Features:
        """Features from ids already hashed: ``ids[feature][record]`` a list of uint64 ids,
        ``dense[record]`` the model's dense inputs (after the dense transform)."""
        if not isinstance(ids, Mapping):
            raise InvalidArgument("'ids' must map each sparse feature to per-record id lists")
        unknown = sorted(set(ids) - set(self.features))
        missing = sorted(set(self.features) - set(ids))
        if unknown or missing:
            raise InvalidArgument(f"'ids' must have exactly the features {list(self.features)}"
                                  f" (unknown {unknown[:10]}, missing {missing[:10]})")
        sparse = {name: _jagged(name, ids[name]) for name in self.features}
        sizes = {name: j.lengths.size for name, j in sparse.items()}
        size = next(iter(sizes.values()))
        if len(set(sizes.values())) != 1 or size == 0:
            raise InvalidArgument(f"every feature needs the same, non-zero number of records; "
                                  f"got {sizes}")
        if dense is None and self.num_dense == 0:
            dense = [[] for _ in range(size)]
        try:
            values = np.array(dense, dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as exc:  # overflow: a huge integer
            raise InvalidArgument(f"'dense' must be a list of {self.num_dense} numbers per "
                                  f"record: {exc}") from exc
        if values.shape != (size, self.num_dense) or _has_bool(dense):
            raise InvalidArgument(f"'dense' must be ({size}, {self.num_dense}) finite numbers,"
                                  f" got shape {values.shape}")
        if not np.isfinite(values).all():
            bad = np.argwhere(~np.isfinite(values))[0]
            raise InvalidArgument(f"'dense' must be finite numbers, got {values[tuple(bad)]} "
                                  f"at record {bad[0]}, value {bad[1]}")
        return Features(sparse=sparse, dense=values)

    # ---- forward ---------------------------------------------------------------------------

    def predict(self, features: Features) -> np.ndarray:
        """float32 probabilities, one per record."""
        return sigmoid(self.logits(features))

    def logits(self, features: Features) -> np.ndarray:
        if features.dense.shape[1:] != (self.num_dense,):
            raise InvalidArgument(f"dense inputs must be (B, {self.num_dense}), got "
                                  f"{features.dense.shape}")
        missing = sorted(set(self.features) - set(features.sparse))
        if missing:
            raise InvalidArgument(f"the features lack sparse features {missing}")
        pooled = pool_bags(features.sparse, self.features,
                           lambda ids: lookup_tables(self.tables, ids), self.pooling)
        return self.model(pooled, features.dense).astype(np.float32, copy=False)


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _has_bool(rows: Any) -> bool:
    return any(isinstance(v, bool) for row in rows if isinstance(row, list) for v in row)


def _jagged(name: str, per_record: Any) -> Jagged:
    if not isinstance(per_record, list) or not all(isinstance(r, list) for r in per_record):
        raise InvalidArgument(f"ids[{name!r}] must be a list of id lists, one per record")
    flat = [v for r in per_record for v in r]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_ID
               for v in flat):
        raise InvalidArgument(f"ids[{name!r}] must hold integers in [0, 2**64)")
    return Jagged(np.array(flat, dtype=np.uint64),
                  np.array([len(r) for r in per_record], dtype=np.int32))
