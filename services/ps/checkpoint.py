"""Atomic, checksummed, reshardable checkpoints of a PS shard's tables.

Layout::

    root/<checkpoint_id>/shard-<k>-of-<n>/manifest.json
                                         /t<i>-ids.npy, t<i>-rows.npy, t<i>-tombstones.npy,
                                          t<i>-state-<name>.npy, t<i>-meta-<name>.npy,
                                          pushes-<name>.npy (the window of applied pushes)

Each shard writes its own part into a temporary directory inside ``root/<checkpoint_id>``,
fsyncs every file and the directory, then renames it into place, so a part is either
complete or absent. The manifest records every table's config, row counts and a sha256 per
file; reading verifies them. An incremental checkpoint names its ``parent``; reading follows
the chain back to a full checkpoint and returns the snapshots in the order to apply them.
When the checkpoint was written by another number of shards, every old part is read and only
the ids ``shard_of(id, num_shards) == shard_id`` are kept.

A part may hold the shard's window of applied pushes (:mod:`services.ps.dedup`), always whole
(also in an incremental checkpoint), taken with the rows: :func:`read_push_window` returns
the one of the checkpoint named (None when it has none or was written by another number of
shards, whose clients numbered their pushes per old shard).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from services.common.admin_replies import (
    CheckpointFile,
    CheckpointManifest,
    CheckpointSummary,
    CheckpointTable,
)
from services.common.config import from_dict
from services.common.errors import (
    AlreadyExists,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from services.common.files import fsync_dir, publish_dir, write_durable
from services.common.sharding import shard_of
from services.common.wire import explain
from services.ps.store import EmbeddingTable, TableSnapshot
from services.ps.tables import TableConfig, table_info

__all__ = ["check_checkpoint_id", "list_checkpoints", "read_checkpoint", "read_epoch",
           "read_push_window", "restore_tables", "write_checkpoint"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_PART_RE = re.compile(r"shard-(\d+)-of-(\d+)")


def _part_name(shard_id: int, num_shards: int) -> str:
    return f"shard-{shard_id}-of-{num_shards}"


def check_checkpoint_id(checkpoint_id: str) -> None:
    """InvalidArgument unless ``checkpoint_id`` can name a checkpoint directory."""
    if not isinstance(checkpoint_id, str) or not _ID_RE.fullmatch(checkpoint_id):
        raise InvalidArgument(f"checkpoint id {checkpoint_id!r} must be 1-128 characters of "
                              "letters, digits, '-', '_' or '.', not starting with '.'")


def _write_array(directory: Path, name: str, array: np.ndarray) -> CheckpointFile:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    data = buf.getvalue()
    write_durable(directory / name, data)
    return CheckpointFile(file=name, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def _read_array(directory: Path, entry: CheckpointFile) -> np.ndarray:
    path = directory / entry.file
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"checkpoint file {path} cannot be read: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise FailedPrecondition(f"checkpoint file {path} is corrupt: sha256 {digest} does not "
                                 f"match the manifest's {entry.sha256}")
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise FailedPrecondition(f"checkpoint file {path} is not a readable array: {exc}") from exc


def _write_table(directory: Path, index: int, snap: TableSnapshot) -> CheckpointTable:
    prefix = f"t{index}"
    files = {
        "ids": _write_array(directory, f"{prefix}-ids.npy", snap.ids),
        "rows": _write_array(directory, f"{prefix}-rows.npy", snap.rows),
        "tombstones": _write_array(directory, f"{prefix}-tombstones.npy", snap.tombstones),
    }
    for kind, arrays in (("state", snap.state), ("meta", snap.meta)):
        for key, arr in sorted(arrays.items()):
            files[f"{kind}:{key}"] = _write_array(directory, f"{prefix}-{kind}-{key}.npy", arr)
    config = table_info(snap.config)
    return CheckpointTable(config=config, dim=config.dim, dtype=config.dtype,
                           optimizer=config.optimizer, rows=int(snap.ids.shape[0]),
                           tombstones=int(snap.tombstones.shape[0]), files=files)


def write_checkpoint(root: Path | str, checkpoint_id: str, shard_id: int, num_shards: int,
                     tables: dict[str, EmbeddingTable], *, incremental: bool = False,
                     parent: str | None = None,
                     pushes: dict[str, np.ndarray] | None = None,
                     epoch: int = 0) -> CheckpointManifest:
    """Write this shard's part of a checkpoint atomically; returns its manifest.

    ``pushes``: the shard's window of applied pushes (``PushWindow.snapshot()``), taken
    under the same locks as the tables. ``epoch``: the shard's (services.ps.durability).

    An incremental checkpoint holds the rows changed since the tables' previous snapshot and
    needs ``parent`` (the checkpoint it builds on). If writing fails, the tables' dirty rows
    and tombstones are put back so the next checkpoint still contains them.
    """
    root = Path(root)
    check_checkpoint_id(checkpoint_id)
    if not 0 <= shard_id < num_shards:
        raise InvalidArgument(f"shard_id must be in [0, {num_shards}), got {shard_id}")
    if incremental:
        if parent is None:
            raise InvalidArgument("an incremental checkpoint needs a parent checkpoint id")
        check_checkpoint_id(parent)
        if not (root / parent).is_dir():
            raise NotFound(f"parent checkpoint {parent!r} does not exist under {root}")
    ckpt_dir = root / checkpoint_id
    final = ckpt_dir / _part_name(shard_id, num_shards)
    if final.exists():
        raise AlreadyExists(f"checkpoint {checkpoint_id!r} already has {final.name}")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f".tmp-{final.name}-{uuid.uuid4().hex}"
    snaps = {name: tables[name].snapshot(incremental=incremental) for name in sorted(tables)}
    try:
        tmp.mkdir()
        manifest = CheckpointManifest(
            format=FORMAT_VERSION, checkpoint_id=checkpoint_id, shard_id=shard_id,
            num_shards=num_shards, incremental=incremental,
            parent=parent if incremental else None, created=time.time(), epoch=epoch,
            tables={name: _write_table(tmp, i, snap)
                    for i, (name, snap) in enumerate(snaps.items())},
            pushes=None if pushes is None else {
                key: _write_array(tmp, f"pushes-{key}.npy", arr)
                for key, arr in sorted(pushes.items())})
        write_durable(tmp / MANIFEST, json.dumps(msgspec.to_builtins(manifest), indent=1,
                                                 sort_keys=True).encode())
        publish_dir(tmp, final)  # into ckpt_dir
        fsync_dir(root)
    except BaseException:
        for name, snap in snaps.items():
            tables[name].requeue(snap)
        _remove_tree(tmp)
        raise
    return manifest


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _read_manifest(part: Path) -> CheckpointManifest:
    """The part's manifest; FailedPrecondition for one unreadable, of another format or
    malformed (naming the field)."""
    try:
        manifest = json.loads((part / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"checkpoint manifest {part / MANIFEST} is unreadable: "
                                 f"{exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise FailedPrecondition(f"checkpoint manifest {part / MANIFEST} has an unknown format")
    try:
        return msgspec.convert(manifest, CheckpointManifest)
    except msgspec.ValidationError as exc:
        raise FailedPrecondition(f"checkpoint manifest {part / MANIFEST} is malformed: "
                                 f"{explain(exc, 'manifest')}") from exc


def _parts(root: Path, checkpoint_id: str) -> list[tuple[Path, int, int]]:
    """``(path, shard_id, num_shards)`` of every complete part of a checkpoint."""
    ckpt_dir = root / checkpoint_id
    found = []
    if ckpt_dir.is_dir():
        for entry in sorted(ckpt_dir.iterdir()):
            m = _PART_RE.fullmatch(entry.name)
            if m and (entry / MANIFEST).is_file():
                found.append((entry, int(m.group(1)), int(m.group(2))))
    return found


def list_checkpoints(root: Path | str) -> list[CheckpointSummary]:
    """One summary per checkpoint under ``root``, oldest first (``created``: its earliest
    part's; ``num_shards``: its first part's)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for ckpt_dir in root.iterdir():
        if not ckpt_dir.is_dir() or not _ID_RE.fullmatch(ckpt_dir.name):
            continue
        parts = [_read_manifest(p) for p, _, _ in _parts(root, ckpt_dir.name)]
        if not parts:
            continue
        num_shards = parts[0].num_shards
        rows: dict[str, int] = {}
        for part in parts:
            for name, table in part.tables.items():
                rows[name] = rows.get(name, 0) + table.rows
        shards = sorted(p.shard_id for p in parts if p.num_shards == num_shards)
        out.append(CheckpointSummary(
            checkpoint_id=ckpt_dir.name, created=min(p.created for p in parts),
            num_shards=num_shards, shards=shards, complete=shards == list(range(num_shards)),
            incremental=parts[0].incremental, parent=parts[0].parent, tables=rows,
            parts=parts))
    out.sort(key=lambda c: (c.created, c.checkpoint_id))
    return out


def _chain(root: Path, checkpoint_id: str) -> list[str]:
    """Checkpoint ids from the full base to ``checkpoint_id``."""
    chain: list[str] = []
    current: str | None = checkpoint_id
    while current is not None:
        check_checkpoint_id(current)
        if current in chain:
            raise FailedPrecondition(f"checkpoint {checkpoint_id!r} has a cyclic parent chain")
        parts = _parts(root, current)
        if not parts:
            what = "checkpoint" if current == checkpoint_id else "parent checkpoint"
            raise NotFound(f"{what} {current!r} does not exist under {root}")
        chain.append(current)
        manifest = _read_manifest(parts[0][0])
        current = manifest.parent if manifest.incremental else None
    return chain[::-1]


def _read_part(part: Path, keep: Callable[[np.ndarray], np.ndarray] | None
               ) -> dict[str, TableSnapshot]:
    manifest = _read_manifest(part)
    out = {}
    for name, entry in manifest.tables.items():
        files = entry.files
        try:
            config = from_dict(TableConfig, msgspec.to_builtins(entry.config),
                               where=f"{part.name}:{name}")
        except ConfigError as exc:
            raise FailedPrecondition(f"checkpoint table {name} in {part}: {exc}") from exc
        ids = _read_array(part, files["ids"])
        tomb = _read_array(part, files["tombstones"])
        arrays = {key: _read_array(part, f) for key, f in files.items() if ":" in key}
        rows = _read_array(part, files["rows"])
        state = {k.split(":", 1)[1]: v for k, v in arrays.items() if k.startswith("state:")}
        meta = {k.split(":", 1)[1]: v for k, v in arrays.items() if k.startswith("meta:")}
        if keep is not None:
            sel = keep(ids)
            ids, rows = ids[sel], rows[sel]
            state = {k: v[sel] for k, v in state.items()}
            meta = {k: v[sel] for k, v in meta.items()}
            tomb = tomb[keep(tomb)]
        out[name] = TableSnapshot(config=config, ids=ids, rows=rows, state=state,
                                  tombstones=tomb, incremental=manifest.incremental,
                                  meta=meta)
    return out


def read_checkpoint(root: Path | str, checkpoint_id: str, *, shard_id: int,
                    num_shards: int) -> dict[str, list[TableSnapshot]]:
    """The snapshots shard ``shard_id`` of ``num_shards`` must apply, per table, in order."""
    root = Path(root)
    if not 0 <= shard_id < num_shards:
        raise InvalidArgument(f"shard_id must be in [0, {num_shards}), got {shard_id}")
    result: dict[str, list[TableSnapshot]] = {}

    def mine(ids: np.ndarray) -> np.ndarray:
        return shard_of(ids, num_shards) == shard_id

    for ckpt in _chain(root, checkpoint_id):
        parts = _parts(root, ckpt)
        written_by = parts[0][2]
        parts = [p for p in parts if p[2] == written_by]
        keep: Callable[[np.ndarray], np.ndarray] | None
        if written_by == num_shards:
            chosen = [p for p in parts if p[1] == shard_id]
            keep = None
        else:
            chosen = parts
            keep = mine
        have = sorted(p[1] for p in chosen)
        need = [shard_id] if keep is None else list(range(written_by))
        if have != need:
            missing = sorted(set(need) - set(have))
            raise FailedPrecondition(f"checkpoint {ckpt!r} is incomplete: parts "
                                     f"{[_part_name(k, written_by) for k in missing]} are missing")
        for path, _, _ in chosen:
            for name, snap in _read_part(path, keep).items():
                result.setdefault(name, []).append(snap)
    return result


def read_push_window(root: Path | str, checkpoint_id: str, *, shard_id: int,
                     num_shards: int) -> dict[str, np.ndarray] | None:
    """The window of applied pushes shard ``shard_id`` of ``num_shards`` saved in checkpoint
    ``checkpoint_id``; None when that part has none or the checkpoint was written by another
    number of shards."""
    root = Path(root)
    check_checkpoint_id(checkpoint_id)
    for path, k, n in _parts(root, checkpoint_id):
        if (k, n) == (shard_id, num_shards):
            files = _read_manifest(path).pushes
            if files is None:
                return None
            return {key: _read_array(path, entry) for key, entry in files.items()}
    return None


def read_epoch(root: Path | str, checkpoint_id: str) -> int:
    """The highest epoch a part of checkpoint ``checkpoint_id`` was written in (0: none
    recorded, an older checkpoint)."""
    root = Path(root)
    check_checkpoint_id(checkpoint_id)
    return max((_read_manifest(path).epoch for path, _, _ in _parts(root, checkpoint_id)),
               default=0)


def restore_tables(root: Path | str, checkpoint_id: str, *, shard_id: int, num_shards: int,
                   clock: Callable[[], float] | None = None) -> dict[str, EmbeddingTable]:
    """Fresh tables holding the checkpoint's rows for this shard (config of the newest part)."""
    tables = {}
    for name, chain in read_checkpoint(root, checkpoint_id, shard_id=shard_id,
                                       num_shards=num_shards).items():
        kwargs = {} if clock is None else {"clock": clock}
        table = EmbeddingTable(chain[-1].config, **kwargs)
        for snap in chain:
            table.restore(snap)
        tables[name] = table
    return tables
