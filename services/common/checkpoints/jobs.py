"""Job checkpoints on disk: every PS shard's part plus the job's own parts under one id.

Layout (``root`` is shared by the PS shards and the coordinator)::

    root/<id>/shard-<k>-of-<n>/...     each PS shard's atomic part (services/ps/checkpoint.py)
    root/<id>/parts/<name>             dense model + optimizer state, loader offsets, ...
    root/<id>/job.json                 written last: the job manifest

A job checkpoint is *complete* only when ``job.json`` exists, and ``job.json`` is written
(temp file, fsync, rename) only after every PS part and every job part is in place, so a crash
at any moment leaves either a complete checkpoint or one that :func:`latest_complete` skips.
:func:`prune_job_checkpoints` keeps the newest complete ones (and what a kept checkpoint's PS
part chains to); :func:`clean_job_temp` removes the temp files a crash left.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.files import atomic_write, read_json

__all__ = ["JOB_MANIFEST", "clean_job_temp", "is_complete", "latest_complete",
           "list_job_checkpoints", "prune_job_checkpoints", "read_job_manifest", "read_part",
           "write_job_manifest", "write_part"]

JOB_MANIFEST = "job.json"
_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


def _check(value: str, pattern: re.Pattern[str], what: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidArgument(f"{what} {value!r} must be letters, digits, '-', '_' or '.', "
                              "not starting with '.'")


def write_part(root: Path | str, checkpoint_id: str, name: str, data: bytes) -> dict[str, Any]:
    """Write one job part atomically; returns its manifest entry (file, sha256, bytes)."""
    _check(checkpoint_id, _ID_RE, "checkpoint id")
    _check(name, _NAME_RE, "part name")
    directory = Path(root) / checkpoint_id / "parts"
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / name, data)
    return {"file": f"parts/{name}", "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data)}


def read_part(root: Path | str, manifest: dict[str, Any], name: str) -> bytes:
    """The bytes of part ``name`` of a job checkpoint, checked against the manifest."""
    entry = manifest["parts"].get(name)
    if entry is None:
        raise NotFound(f"job checkpoint {manifest['checkpoint_id']!r} has no part {name!r}; "
                       f"it has {sorted(manifest['parts'])}")
    path = Path(root) / manifest["checkpoint_id"] / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"job part {path} cannot be read: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise FailedPrecondition(f"job part {path} is corrupt (sha256 mismatch)")
    return data


def _ps_parts_present(ckpt_dir: Path, num_shards: int) -> list[int]:
    return [k for k in range(num_shards)
            if (ckpt_dir / f"shard-{k}-of-{num_shards}" / "manifest.json").is_file()]


def write_job_manifest(root: Path | str, checkpoint_id: str, *, step: int, num_shards: int,
                       parts: dict[str, dict[str, Any]],
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Mark a job checkpoint complete: check every PS part and job part exists, then write
    ``job.json`` atomically. Raises :class:`FailedPrecondition` naming what is missing."""
    _check(checkpoint_id, _ID_RE, "checkpoint id")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgument(f"step must be an int >= 0, got {step!r}")
    if num_shards < 1:
        raise InvalidArgument(f"num_shards must be >= 1, got {num_shards}")
    ckpt_dir = Path(root) / checkpoint_id
    present = _ps_parts_present(ckpt_dir, num_shards)
    missing = [f"shard-{k}-of-{num_shards}" for k in range(num_shards) if k not in present]
    missing += [e["file"] for e in parts.values() if not (ckpt_dir / e["file"]).is_file()]
    if missing:
        raise FailedPrecondition(f"job checkpoint {checkpoint_id!r} is incomplete: "
                                 f"{missing} missing")
    if (ckpt_dir / JOB_MANIFEST).exists():
        raise FailedPrecondition(f"job checkpoint {checkpoint_id!r} is already complete")
    manifest = {"checkpoint_id": checkpoint_id, "step": step, "num_shards": num_shards,
                "created": time.time(), "parts": parts, **(extra or {})}
    atomic_write(ckpt_dir / JOB_MANIFEST, json.dumps(manifest, sort_keys=True).encode())
    return manifest


def read_job_manifest(root: Path | str, checkpoint_id: str) -> dict[str, Any]:
    _check(checkpoint_id, _ID_RE, "checkpoint id")
    path = Path(root) / checkpoint_id / JOB_MANIFEST
    manifest = read_json(path, what="job manifest",
                         absent=f"job checkpoint {checkpoint_id!r} is absent or incomplete")
    if not isinstance(manifest, dict) or manifest.get("checkpoint_id") != checkpoint_id:
        raise FailedPrecondition(f"job manifest {path} does not describe {checkpoint_id!r}")
    return manifest


def is_complete(root: Path | str, manifest: dict[str, Any]) -> bool:
    """True when the manifest's PS parts and job parts are all still on disk."""
    ckpt_dir = Path(root) / manifest["checkpoint_id"]
    n = int(manifest["num_shards"])
    return (len(_ps_parts_present(ckpt_dir, n)) == n
            and all((ckpt_dir / e["file"]).is_file() for e in manifest["parts"].values()))


def list_job_checkpoints(root: Path | str) -> list[dict[str, Any]]:
    """Manifests of the complete job checkpoints under ``root``, oldest (by step) first."""
    root = Path(root)
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            if _ID_RE.fullmatch(entry.name) and (entry / JOB_MANIFEST).is_file():
                try:
                    manifest = read_job_manifest(root, entry.name)
                except FailedPrecondition:
                    continue
                if is_complete(root, manifest):
                    found.append(manifest)
    return sorted(found, key=lambda m: (m["step"], m["created"], m["checkpoint_id"]))


def latest_complete(root: Path | str) -> dict[str, Any] | None:
    """The newest complete job checkpoint's manifest, or None."""
    known = list_job_checkpoints(root)
    return known[-1] if known else None


def _parents(root: Path) -> set[str]:
    """Every checkpoint id some PS part under ``root`` chains to (an incremental's parent)."""
    found = set()
    for manifest in root.glob("*/shard-*-of-*/manifest.json"):
        try:
            parent = json.loads(manifest.read_text()).get("parent")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(parent, str):
            found.add(parent)
    return found


def prune_job_checkpoints(root: Path | str, keep: int) -> list[str]:
    """Remove whole complete job checkpoints but the ``keep`` newest (0: keep all), never one
    that a remaining PS part chains to; returns the ids removed."""
    if keep <= 0:
        return []
    root = Path(root)
    old = [m["checkpoint_id"] for m in list_job_checkpoints(root)[:-keep]]
    needed = _parents(root)
    removed = []
    for checkpoint_id in old:
        if checkpoint_id in needed:
            continue
        (root / checkpoint_id / JOB_MANIFEST).unlink()  # incomplete first: never half-read
        shutil.rmtree(root / checkpoint_id, ignore_errors=True)
        removed.append(checkpoint_id)
    return removed


def clean_job_temp(root: Path | str) -> list[Path]:
    """Remove the temp files of manifests and job parts a crash left under ``root``
    (``<id>/.tmp-*`` files and ``<id>/parts/.tmp-*``); PS staging directories are their
    shards' to clean."""
    root = Path(root)
    removed = [p for pattern in ("*/.tmp-*", "*/parts/.tmp-*") for p in root.glob(pattern)
               if p.is_file()]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
