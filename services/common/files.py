"""Durable file writes shared by every checkpoint writer, and reading their JSON manifests."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from services.common.errors import FailedPrecondition, NotFound

__all__ = ["atomic_write", "fsync_dir", "publish_dir", "read_json", "write_durable"]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (a new file, in a directory made durable
    later, e.g. by :func:`publish_dir`)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def publish_dir(staging: Path, final: Path) -> None:
    """Rename the written directory ``staging`` to ``final`` durably: readers see no
    ``final`` or all of it."""
    fsync_dir(staging)
    os.rename(staging, final)
    fsync_dir(final.parent)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex}")
    try:
        write_durable(tmp, data)
        os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def read_json(path: Path, *, what: str, absent: str) -> Any:
    """The JSON in ``path``: :class:`NotFound` (``absent``) when there is no such file,
    :class:`FailedPrecondition` naming ``what`` when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise NotFound(absent) from exc
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"{what} {path} is unreadable: {exc}") from exc
