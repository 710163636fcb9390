"""Source positions of a consistent cut: advance past trained batches, merge the ranks', and
the positions part of a job checkpoint (bad input gets a clear error)."""

from __future__ import annotations

import pytest

from services.common.checkpoints import write_job_manifest, write_part
from services.common.checkpoints.positions import (
    POSITIONS_PART,
    advance,
    cut_positions,
    decode_positions,
    encode_positions,
    merge,
)
from services.common.errors import FailedPrecondition, InvalidArgument


def test_a_rank_is_past_the_last_record_of_every_partition_it_trained() -> None:
    # rank 0 trained batches 0 and 2; partition p0 in both, p1 only in batch 0
    rank0: dict[str, int] = {}
    advance(rank0, {"kafka:t:0": (0, 9), "kafka:t:1": (0, 4)})
    advance(rank0, {"kafka:t:0": (18, 25)})
    assert rank0 == {"kafka:t:0": 26, "kafka:t:1": 5}  # not the first position, not the last
    # a batch that redelivers older records never moves a partition back
    advance(rank0, {"kafka:t:1": (2, 3)})
    assert rank0["kafka:t:1"] == 5


def test_the_cut_is_the_furthest_position_of_each_partition_over_the_ranks() -> None:
    rank0 = {"kafka:t:0": 26, "kafka:t:1": 5}
    rank1 = {"kafka:t:0": 18, "kafka:t:1": 12, "kafka:t:2": 3}
    # neither rank's alone, nor the smallest: per partition the furthest
    assert merge([rank0, rank1]) == {"kafka:t:0": 26, "kafka:t:1": 12, "kafka:t:2": 3}
    assert merge([rank1, rank0]) == merge([rank0, rank1])


def test_bad_positions_get_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="first <= last"):
        advance({}, {"kafka:t:0": (5, 4)})
    with pytest.raises(InvalidArgument, match="int >= 0"):
        merge([{"kafka:t:0": -1}])
    with pytest.raises(InvalidArgument, match="int >= 0"):
        encode_positions({"kafka:t:0": True})
    for data in (b"not json", b"[1, 2]", b'{"kafka:t:0": "7"}'):
        with pytest.raises(FailedPrecondition, match="malformed"):
            decode_positions(data)
    positions = {"kafka:t:0": 0, "kafka:t:1": 2**40}
    assert decode_positions(encode_positions(positions)) == positions


def test_the_positions_of_a_cut_come_from_its_complete_job_checkpoint(tmp_path) -> None:
    assert cut_positions(tmp_path) == {}  # no cut yet: the job's start
    entry = write_part(tmp_path, "plain", "dense", b"weights")
    (tmp_path / "plain" / "shard-0-of-1").mkdir()
    (tmp_path / "plain" / "shard-0-of-1" / "manifest.json").write_text("{}")
    write_job_manifest(tmp_path, "plain", step=3, num_shards=1, parts={"dense": entry})
    with pytest.raises(FailedPrecondition, match="no cut"):
        cut_positions(tmp_path)  # a job checkpoint without positions is no cut

    entry = write_part(tmp_path, "cut", POSITIONS_PART, encode_positions({"kafka:t:0": 7}))
    (tmp_path / "cut" / "shard-0-of-1").mkdir()
    (tmp_path / "cut" / "shard-0-of-1" / "manifest.json").write_text("{}")
    write_part(tmp_path, "half", POSITIONS_PART, encode_positions({"kafka:t:0": 9}))
    write_job_manifest(tmp_path, "cut", step=5, num_shards=1, parts={POSITIONS_PART: entry})
    assert cut_positions(tmp_path) == {"kafka:t:0": 7}  # the newest complete, not "half"
    assert cut_positions(tmp_path, "cut") == {"kafka:t:0": 7}
    (tmp_path / "cut" / "parts" / POSITIONS_PART).write_bytes(b'{"kafka:t:0": 8}')
    with pytest.raises(FailedPrecondition, match="corrupt"):
        cut_positions(tmp_path, "cut")
