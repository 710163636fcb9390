"""Job checkpoint store on disk: complete only when every part is written; an incomplete or
damaged checkpoint is never picked; bad input is refused and changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.checkpoints import (
    JOB_MANIFEST,
    latest_complete,
    list_job_checkpoints,
    read_job_manifest,
    read_part,
    write_job_manifest,
    write_part,
)
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound


def ps_part(root: Path, checkpoint_id: str, k: int, n: int) -> None:
    part = root / checkpoint_id / f"shard-{k}-of-{n}"
    part.mkdir(parents=True)
    (part / "manifest.json").write_text("{}")


def complete(root: Path, checkpoint_id: str, step: int, n: int = 2) -> dict:
    for k in range(n):
        ps_part(root, checkpoint_id, k, n)
    entry = write_part(root, checkpoint_id, "dense", f"dense@{step}".encode())
    return write_job_manifest(root, checkpoint_id, step=step, num_shards=n,
                              parts={"dense": entry})


def test_latest_complete_skips_incomplete_checkpoints(tmp_path: Path) -> None:
    complete(tmp_path, "a", step=10)
    complete(tmp_path, "b", step=20)
    ps_part(tmp_path, "c", 0, 2)           # newest, but only one shard part and no manifest
    ps_part(tmp_path, "c", 1, 2)
    write_part(tmp_path, "c", "dense", b"dense@30")
    assert latest_complete(tmp_path)["checkpoint_id"] == "b"
    assert [m["step"] for m in list_job_checkpoints(tmp_path)] == [10, 20]
    with pytest.raises(NotFound):
        read_job_manifest(tmp_path, "c")


def test_manifest_refused_while_a_part_is_missing(tmp_path: Path) -> None:
    ps_part(tmp_path, "x", 0, 2)
    entry = write_part(tmp_path, "x", "dense", b"d")
    with pytest.raises(FailedPrecondition, match="shard-1-of-2"):
        write_job_manifest(tmp_path, "x", step=1, num_shards=2, parts={"dense": entry})
    ps_part(tmp_path, "x", 1, 2)
    ghost = {"file": "parts/offsets", "sha256": "0" * 64, "bytes": 1}
    with pytest.raises(FailedPrecondition, match="parts/offsets"):
        write_job_manifest(tmp_path, "x", step=1, num_shards=2,
                           parts={"dense": entry, "offsets": ghost})
    assert not (tmp_path / "x" / JOB_MANIFEST).exists()
    assert latest_complete(tmp_path) is None
    write_job_manifest(tmp_path, "x", step=1, num_shards=2, parts={"dense": entry})
    with pytest.raises(FailedPrecondition, match="already complete"):
        write_job_manifest(tmp_path, "x", step=2, num_shards=2, parts={"dense": entry})
    assert read_job_manifest(tmp_path, "x")["step"] == 1


def test_checkpoint_losing_a_part_is_no_longer_complete(tmp_path: Path) -> None:
    complete(tmp_path, "a", step=10)
    complete(tmp_path, "b", step=20)
    (tmp_path / "b" / "shard-1-of-2" / "manifest.json").unlink()
    assert latest_complete(tmp_path)["checkpoint_id"] == "a"


def test_parts_round_trip_and_corruption_is_detected(tmp_path: Path) -> None:
    manifest = complete(tmp_path, "a", step=10)
    assert read_part(tmp_path, manifest, "dense") == b"dense@10"
    (tmp_path / "a" / "parts" / "dense").write_bytes(b"dense@99")
    with pytest.raises(FailedPrecondition, match="corrupt"):
        read_part(tmp_path, manifest, "dense")
    with pytest.raises(NotFound, match="no part 'offsets'"):
        read_part(tmp_path, manifest, "offsets")


def test_unreadable_manifest_is_skipped(tmp_path: Path) -> None:
    complete(tmp_path, "a", step=10)
    complete(tmp_path, "b", step=20)
    (tmp_path / "b" / JOB_MANIFEST).write_text("{not json")
    assert latest_complete(tmp_path)["checkpoint_id"] == "a"
    (tmp_path / "a" / JOB_MANIFEST).write_text(json.dumps({"checkpoint_id": "other"}))
    assert latest_complete(tmp_path) is None


@pytest.mark.parametrize("bad", ["../up", ".hidden", "", "a/b"])
def test_bad_ids_and_names_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(InvalidArgument):
        write_part(tmp_path, bad, "dense", b"x")
    with pytest.raises(InvalidArgument):
        write_part(tmp_path, "ok", bad, b"x")
    assert not any(tmp_path.rglob("*x*"))
    with pytest.raises(InvalidArgument):
        write_job_manifest(tmp_path, "ok", step=-1, num_shards=1, parts={})
