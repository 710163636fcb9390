"""Job checkpoints pruned to the newest complete ones (never one a PS part chains to), and the
temp files a crashed coordinator left removed."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.checkpoints import (
    clean_job_temp,
    list_job_checkpoints,
    prune_job_checkpoints,
    write_job_manifest,
    write_part,
)


def _job(root: Path, checkpoint_id: str, step: int, parent: str | None = None) -> None:
    part = root / checkpoint_id / "shard-0-of-1"
    part.mkdir(parents=True)
    (part / "manifest.json").write_text(json.dumps({"parent": parent,
                                                    "incremental": parent is not None}))
    entry = write_part(root, checkpoint_id, "dense", b"weights")
    write_job_manifest(root, checkpoint_id, step=step, num_shards=1, parts={"dense": entry})


def test_only_the_newest_complete_job_checkpoints_are_kept(tmp_path):
    for step in range(1, 6):
        _job(tmp_path, f"step-{step}", step)
    (tmp_path / "step-9" / "parts").mkdir(parents=True)  # incomplete: being written
    assert prune_job_checkpoints(tmp_path, 2) == ["step-1", "step-2", "step-3"]
    assert [m["checkpoint_id"] for m in list_job_checkpoints(tmp_path)] == ["step-4", "step-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5", "step-9"]
    assert prune_job_checkpoints(tmp_path, 0) == []


def test_a_checkpoint_a_kept_part_chains_to_is_kept(tmp_path):
    _job(tmp_path, "step-1", 1)
    _job(tmp_path, "step-2", 2)
    _job(tmp_path, "step-3", 3, parent="step-1")  # its PS part is incremental on step-1
    assert prune_job_checkpoints(tmp_path, 1) == ["step-2"]
    assert (tmp_path / "step-1" / "job.json").exists()


def test_a_crashs_temp_files_are_removed(tmp_path):
    _job(tmp_path, "step-1", 1)
    left = [tmp_path / "step-1" / ".tmp-job.json-0abc", tmp_path / "step-1" / "parts" / ".tmp-dense-0abc"]
    for path in left:
        path.write_bytes(b"half")
    staging = tmp_path / "step-1" / ".tmp-shard-0-of-1-0abc"  # a shard's: the shard's to clean
    staging.mkdir()
    assert sorted(clean_job_temp(tmp_path)) == sorted(left)
    assert not any(p.exists() for p in left) and staging.exists()
    assert list_job_checkpoints(tmp_path)[0]["checkpoint_id"] == "step-1"
