"""Model versions on disk: one directory per version, dense and sparse together, atomic.

Layout (``DIR`` is the model directory ``persimmon serve --model-dir`` watches)::

    DIR/<version-id>/manifest.json        written last: a version is complete once it exists
                    /dense.safetensors    the model's state_dict (services/serve/weights.py)
                    /feature_spec.json    how raw records become inputs (services/loader/featurize.py)
                    /t<i>-ids.npy, t<i>-rows.npy[, t<i>-scale.npy]   rows (services/serve/rows.py)
                    [/t<i>-tombstones.npy]   ids deleted since the base (incremental only)

The manifest holds the format version (2; format 1 versions, whose dense weights are a
``dense.pt`` pickle, still load, deprecated), version id, step, creation time, the model config
(:class:`~services.worker.models.ModelConfig` fields), each sparse feature's table and dim,
the order in which the model takes the sparse features (``feature_order``: the manifest's
mappings are written with sorted keys, and a model's weights depend on the order; versions
written before it take the feature spec's order, :func:`model_sparse_dims`), the dense width, the pooling, the row dtype, every table's PS config (its initializer makes
the rows of ids never trained) and a sha256 and size per file. A version is written into a
temporary directory ``DIR/.tmp-...``, every file and the directory are fsynced, the manifest
goes in last, then the directory is renamed into place. Readers ignore directories without a
valid manifest and refuse a version whose files fail their checksums. :func:`prune` keeps
the newest K versions (and the bases they build on).

An incremental version names its ``base`` in the manifest and holds only the rows that
differ from the base as stored, plus tombstones for the ids the base holds and the new
version does not (rows evicted or deleted on the PS); a reader applies the chain from the
full version up. Dense weights and the feature spec are whole in every version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import shutil
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.common.files import publish_dir, read_json, write_durable
from services.loader import FeatureSpec
from services.serve.bags import POOLING
from services.serve.rows import (
    ROW_DTYPES,
    EmbeddingRows,
    InitialRows,
    PSLookup,
    PSRows,
    RowLayer,
    TableRows,
    decode_rows,
    encode_rows,
    find_sorted,
)
from services.serve.weights import DENSE, check_dense_state, dense_bytes

if TYPE_CHECKING:  # writing a version needs torch (the [train] extra); reading does not
    from services.worker.models import ModelConfig

__all__ = ["FORMAT_VERSION", "MANIFEST", "SnapshotLike", "list_versions", "model_sparse_dims",
           "new_version_id", "open_tables", "prune", "read_manifest", "tables_from_snapshots", "verify_version",
           "version_chain", "write_version"]

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # 1: dense weights as dense.pt (torch.save), deprecated
MANIFEST = "manifest.json"
SPEC = "feature_spec.json"
VERSION_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


class SnapshotLike(Protocol):
    """A PS table snapshot as the PS checkpoint reader returns it (duck-typed: serving does
    not import the PS)."""

    config: Any
    ids: np.ndarray
    rows: np.ndarray
    tombstones: np.ndarray
    incremental: bool


def new_version_id(step: int) -> str:
    """``v<step, 12 digits>-<time ms>-<random>``: sorts by step, then by time."""
    return f"v{step:012d}-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}"


def _check_id(version_id: str) -> None:
    if not isinstance(version_id, str) or not VERSION_RE.fullmatch(version_id) \
            or version_id == "latest":
        raise InvalidArgument(f"version id {version_id!r} must be 1-128 letters, digits, '-', "
                              "'_' or '.', not starting with '.' (and not 'latest')")


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    from services.common.config import config_to_dict

    return config_to_dict(config)


def tables_from_snapshots(chains: Mapping[str, Sequence[SnapshotLike]]) -> dict[str, TableRows]:
    """Each table's rows after applying its snapshots in order: the first is a full one; each
    later one (another shard's part, or an incremental snapshot) deletes its tombstones and
    puts its rows in place of those of the same ids."""
    out = {}
    for name, chain in chains.items():
        if not chain:
            raise InvalidArgument(f"table {name}: no snapshots")
        if chain[0].incremental:
            raise FailedPrecondition(f"table {name}: the first snapshot must be a full one")
        ids = np.asarray(chain[0].ids, dtype=np.uint64)
        values = np.asarray(chain[0].rows, dtype=np.float32)
        for snap in chain[1:]:
            changed = np.asarray(snap.ids, dtype=np.uint64)
            gone = np.concatenate([np.asarray(snap.tombstones, dtype=np.uint64), changed])
            kept = ~np.isin(ids, gone)
            ids = np.concatenate([ids[kept], changed])
            values = np.concatenate([values[kept], np.asarray(snap.rows, dtype=np.float32)])
        out[name] = TableRows(name=name, ids=ids, rows=values,
                              config=_config_dict(chain[-1].config))
    return out


def _write_file(directory: Path, name: str, data: bytes) -> dict[str, Any]:
    write_durable(directory / name, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _check_inputs(model: ModelConfig, state: Mapping[str, Any], features: Mapping[str, str],
                  tables: Mapping[str, TableRows], spec: FeatureSpec, num_dense: int,
                  row_dtype: str, pooling: str) -> dict[str, int]:
    if row_dtype not in ROW_DTYPES:
        raise InvalidArgument(f"row dtype must be one of {ROW_DTYPES}, got {row_dtype!r}")
    if pooling not in POOLING:
        raise InvalidArgument(f"pooling must be one of {POOLING}, got {pooling!r}")
    missing = sorted(set(features.values()) - set(tables))
    if missing:
        raise InvalidArgument(f"tables {missing} of the features have no rows to export")
    unspecified = sorted(set(features) - set(spec.sparse))
    if unspecified:
        raise InvalidArgument(f"features {unspecified} are not sparse features of the spec")
    if num_dense != len(spec.dense):
        raise InvalidArgument(f"the model takes {num_dense} dense values, the feature spec "
                              f"has {len(spec.dense)}")
    dims = {f: int(tables[t].config["dim"]) for f, t in features.items()}
    check_dense_state(state)
    try:  # the weights must load into the model the manifest describes
        model.build(sparse_dims=dims, num_dense=num_dense).load_state_dict(dict(state))
    except (RuntimeError, KeyError) as exc:
        raise InvalidArgument(f"the dense weights do not fit the model config: {exc}") from exc
    return dims


def write_version(model_dir: Path | str, *, step: int, model: ModelConfig,
                  state: Mapping[str, Any], features: Mapping[str, str], num_dense: int,
                  tables: Mapping[str, TableRows], spec: FeatureSpec,
                  row_dtype: str = "float32", pooling: str = "sum",
                  version_id: str | None = None, keep: int | None = None,
                  source: Mapping[str, Any] | None = None,
                  base: str | None = None, ps_tables: Collection[str] = ()) -> dict[str, Any]:
    """Write one complete model version atomically; returns its manifest.

    ``state`` is the dense model's state_dict, ``features`` maps each sparse feature to its
    table, ``tables`` holds every table's rows. ``base``: write an incremental version on top
    of that version (only the rows that differ from it, and tombstones for the ids it holds
    that ``tables`` does not). ``keep``: prune to the newest ``keep`` versions afterwards.
    ``ps_tables``: tables served from the live PS shards, not copied (their entry holds the
    config only; ``tables`` gives it); a base must have the same ones.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgument(f"step must be an int >= 0, got {step!r}")
    dims = _check_inputs(model, state, features, tables, spec, num_dense, row_dtype, pooling)
    ps_tables = set(ps_tables)
    if not ps_tables <= set(features.values()):
        raise InvalidArgument(f"PS tables {sorted(ps_tables - set(features.values()))} are "
                              f"not tables of the features")
    version_id = version_id or new_version_id(step)
    _check_id(version_id)
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    below = (_base_tables(root, base, tables, features, row_dtype, ps_tables)
             if base is not None else None)
    final = root / version_id
    if final.exists():
        raise AlreadyExists(f"model version {version_id!r} already exists in {root}")
    tmp = root / f".tmp-{version_id}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        files: dict[str, dict[str, Any]] = {}
        files[DENSE] = _write_file(tmp, DENSE, dense_bytes(state, version_id=version_id,
                                                           step=step))
        files[SPEC] = _write_file(tmp, SPEC, json.dumps(spec.to_dict(), indent=1).encode())
        entries = {}
        for i, name in enumerate(sorted(set(features.values()))):
            if name in ps_tables:
                entries[name] = {"dim": int(tables[name].config["dim"]), "dtype": row_dtype,
                                 "rows": 0, "tombstones": 0, "on_ps": True, "files": {},
                                 "config": _config_dict(tables[name].config)}
                continue
            rows, tombstones = tables[name].sorted(), None
            if below is not None:
                rows, tombstones = _delta(below[name], rows, row_dtype)
            entries[name] = _write_table(tmp, f"t{i}", rows, row_dtype, files, tombstones)
        manifest = {
            "format": FORMAT_VERSION, "version_id": version_id, "step": step,
            "created": time.time(), "model": dataclasses.asdict(model),
            "features": dict(features), "sparse_dims": dims, "feature_order": list(dims),
            "num_dense": num_dense,
            "pooling": pooling, "row_dtype": row_dtype, "tables": entries, "files": files,
            "source": dict(source or {}), "base": base,
        }
        write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune(root, keep)
    return manifest


def _write_table(directory: Path, prefix: str, table: TableRows, row_dtype: str,
                 files: dict[str, dict[str, Any]], tombstones: np.ndarray | None
                 ) -> dict[str, Any]:
    stored, scale = encode_rows(table.rows, row_dtype)
    arrays = {"ids": table.ids, "rows": stored, **({"scale": scale} if scale is not None else {}),
              **({"tombstones": tombstones} if tombstones is not None else {})}
    names = {}
    for kind, array in arrays.items():
        names[kind] = f"{prefix}-{kind}.npy"
        files[names[kind]] = _write_file(directory, names[kind], _npy(array))
    return {"dim": int(table.config["dim"]), "dtype": row_dtype, "rows": int(table.ids.size),
            "tombstones": int(tombstones.size) if tombstones is not None else 0,
            "config": _config_dict(table.config), "files": names}


def _no_initial_rows(config: Mapping[str, Any], ids: np.ndarray) -> np.ndarray:
    raise FailedPrecondition("an export never makes initial rows")


def _ps_tables_of(manifest: Mapping[str, Any]) -> set[str]:
    return {name for name, entry in manifest["tables"].items() if entry.get("on_ps")}


def _base_tables(root: Path, base: str, tables: Mapping[str, TableRows],
                 features: Mapping[str, str], row_dtype: str, ps_tables: set[str]
                 ) -> dict[str, EmbeddingRows]:
    """The rows of version ``base``, checked to be a base the new version can build on."""
    _check_id(base)
    chain = version_chain(root, base)
    if chain[-1]["row_dtype"] != row_dtype:
        raise InvalidArgument(f"base version {base!r} stores {chain[-1]['row_dtype']} rows, "
                              f"not {row_dtype}")
    if _ps_tables_of(chain[-1]) != ps_tables:
        raise InvalidArgument(f"base version {base!r} reads tables "
                              f"{sorted(_ps_tables_of(chain[-1]))} from the PS, not "
                              f"{sorted(ps_tables)}")
    opened = {name: rows for name, rows in
              open_tables(root, chain, _no_initial_rows, skip_ps=True).items()
              if isinstance(rows, EmbeddingRows)}
    names = set(features.values()) - ps_tables
    if set(opened) != names or any(opened[t].dim != int(tables[t].config["dim"])
                                   for t in names):
        raise InvalidArgument(f"base version {base!r} has other tables or dims: "
                              f"{ {t: r.dim for t, r in opened.items()} }")
    return opened


def _delta(below: EmbeddingRows, table: TableRows, row_dtype: str
           ) -> tuple[TableRows, np.ndarray]:
    """The rows of ``table`` (ids sorted) that differ from ``below`` as stored, and the ids
    ``below`` holds that ``table`` does not (tombstones, sorted)."""
    stored, scale = encode_rows(table.rows, row_dtype)
    have, old = below.stored(table.ids)
    changed = ~have | np.any(old != decode_rows(stored, scale), axis=1)
    live = below.live_ids()
    rows = TableRows(name=table.name, ids=table.ids[changed], rows=table.rows[changed],
                     config=table.config)
    return rows, live[~find_sorted(table.ids, live)[0]]


def version_chain(model_dir: Path | str, version_id: str) -> list[dict[str, Any]]:
    """Manifests from the full version under ``version_id`` up to it (FailedPrecondition
    when a base is missing or the chain loops)."""
    root = Path(model_dir)
    chain: list[dict[str, Any]] = []
    current: str | None = version_id
    while current is not None:
        if any(m["version_id"] == current for m in chain):
            raise FailedPrecondition(f"model version {version_id!r} has a cyclic base chain")
        try:
            manifest = read_manifest(root / current)
        except NotFound as exc:
            if not chain:
                raise
            raise FailedPrecondition(f"model version {version_id!r} builds on {current!r}, "
                                     "which is missing") from exc
        chain.append(manifest)
        current = manifest.get("base")
    return chain[::-1]


def open_tables(model_dir: Path | str, chain: Sequence[Mapping[str, Any]],
                initial_rows: InitialRows, ps_lookup: PSLookup | None = None, *,
                skip_ps: bool = False) -> dict[str, EmbeddingRows | PSRows]:
    """Every table of the newest version of ``chain`` (base first), memory-mapped; tables on
    the PS read through ``ps_lookup`` (``skip_ps``: left out)."""
    root, newest = Path(model_dir), chain[-1]
    out: dict[str, EmbeddingRows | PSRows] = {}
    for name, entry in newest["tables"].items():
        if entry.get("on_ps"):
            if skip_ps:
                continue
            if ps_lookup is None:
                raise FailedPrecondition(
                    f"model version {newest['version_id']} reads table {name} from the live "
                    "PS shards: serve it with --ps (the shards' addresses)")
            out[name] = PSRows(name, entry["config"], ps_lookup)
            continue
        layers = []
        for manifest in reversed(chain):
            part = manifest["tables"].get(name)
            if part is None or int(part["dim"]) != int(entry["dim"]):
                raise FailedPrecondition(f"table {name} differs between versions "
                                         f"{manifest['version_id']} and {newest['version_id']}")
            layers.append(RowLayer(name, root / manifest["version_id"], part))
        out[name] = EmbeddingRows(name, entry["config"], layers, initial_rows)
    return out


def read_manifest(version_dir: Path | str) -> dict[str, Any]:
    """The manifest of a version directory (checked for shape, not checksums)."""
    path = Path(version_dir) / MANIFEST
    manifest = read_json(path, what="model manifest",
                         absent=f"{path.parent.name!r} is not a complete model version")
    required = ("version_id", "step", "created", "model", "features", "sparse_dims",
                "num_dense", "pooling", "row_dtype", "tables", "files")
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS \
            or any(k not in manifest for k in required):
        raise FailedPrecondition(f"model manifest {path} has an unknown format")
    if manifest["version_id"] != path.parent.name:
        raise FailedPrecondition(f"model manifest {path} names version "
                                 f"{manifest['version_id']!r}, not its directory's name")
    return manifest


def model_sparse_dims(manifest: Mapping[str, Any], spec: FeatureSpec) -> dict[str, int]:
    """Each sparse feature's dim in the order the model takes them: the manifest's
    ``feature_order``, or (a version written before it) the feature spec's order, the order
    of the loader's batches that the trainer built its model in."""
    dims = manifest["sparse_dims"]
    order = manifest.get("feature_order")
    if order is None:
        order = [f for f in spec.sparse if f in dims]
    if not isinstance(order, list) or sorted(order) != sorted(dims):
        raise FailedPrecondition(f"model version {manifest['version_id']}: its feature order "
                                 f"{order!r} is not an order of its features {sorted(dims)}")
    return {f: dims[f] for f in order}


def verify_version(version_dir: Path | str, manifest: Mapping[str, Any]) -> None:
    """Check every file against the manifest's size and sha256 (FailedPrecondition)."""
    directory = Path(version_dir)
    for name, entry in manifest["files"].items():
        path = directory / name
        if "/" in name or name.startswith("."):
            raise FailedPrecondition(f"model version {directory.name}: bad file name {name!r}")
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                size = 0
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise FailedPrecondition(f"model file {path} cannot be read: {exc}") from exc
        if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
            raise FailedPrecondition(f"model file {path} is corrupt: its size or sha256 does "
                                     "not match the manifest")


def list_versions(model_dir: Path | str) -> list[dict[str, Any]]:
    """Manifests of the complete versions under ``model_dir``, oldest first (by step, then
    creation time); directories without a valid manifest are skipped."""
    root = Path(model_dir)
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            if not entry.is_dir() or not VERSION_RE.fullmatch(entry.name):
                continue
            try:
                found.append(read_manifest(entry))
            except (NotFound, FailedPrecondition):
                continue
    return sorted(found, key=lambda m: (m["step"], m["created"], m["version_id"]))


def prune(model_dir: Path | str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete versions and the bases they build on;
    returns the deleted ids."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidArgument(f"keep must be an int >= 1, got {keep!r}")
    versions = list_versions(model_dir)
    by_id = {m["version_id"]: m for m in versions}
    needed: set[str] = set()
    for manifest in versions[max(0, len(versions) - keep):]:
        current: str | None = manifest["version_id"]
        while current is not None and current not in needed:
            needed.add(current)
            current = by_id[current].get("base") if current in by_id else None
    doomed = [m["version_id"] for m in versions if m["version_id"] not in needed]
    for version_id in doomed:
        directory = Path(model_dir) / version_id
        (directory / MANIFEST).unlink(missing_ok=True)  # incomplete first, then gone
        shutil.rmtree(directory, ignore_errors=True)
    return doomed
