"""Source positions of a consistent cut: per partition, the first position the cut does not hold.

A cut holds exactly the records of the batches trained before it. With an unshuffled loader
the rows of one partition in batch ``b`` are a contiguous run of that partition (each
:class:`~services.common.batch.Batch` says ``positions[partition] = (first, last)``), and the
batches with ids below ``B`` hold a prefix of every partition. So a rank that trained its
batches below ``B`` knows, per partition, the position after the last record it trained
(:func:`advance`); the ranks' positions merged by maximum (:func:`merge`) are the cut's, and
a loader resumed there (Kafka: ``seek``) replays exactly the records after the cut.

The positions travel in the job checkpoint as the part ``positions`` (:func:`encode_positions`
/ :func:`decode_positions`: JSON of ``{partition: int}``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from services.common.checkpoints.jobs import latest_complete, read_job_manifest, read_part
from services.common.errors import FailedPrecondition, InvalidArgument

__all__ = ["POSITIONS_PART", "advance", "cut_positions", "decode_positions",
           "encode_positions", "merge"]

POSITIONS_PART = "positions"


def advance(positions: dict[str, int], batch_positions: Mapping[str, tuple[int, int]]) -> None:
    """Move ``positions`` past a trained batch's ``{partition: (first, last)}`` (in place)."""
    for partition, (first, last) in batch_positions.items():
        if not 0 <= first <= last:
            raise InvalidArgument(f"batch positions of {partition!r} must satisfy "
                                  f"0 <= first <= last, got ({first}, {last})")
        if last + 1 > positions.get(partition, 0):
            positions[partition] = last + 1


def merge(ranks: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The cut's positions from every rank's: per partition, the furthest."""
    out: dict[str, int] = {}
    for positions in ranks:
        for partition, position in _checked(positions).items():
            out[partition] = max(out.get(partition, 0), position)
    return dict(sorted(out.items()))


def encode_positions(positions: Mapping[str, int]) -> bytes:
    return json.dumps(_checked(positions), sort_keys=True).encode()


def decode_positions(data: bytes) -> dict[str, int]:
    """The positions :func:`encode_positions` wrote; :class:`FailedPrecondition` if malformed."""
    try:
        return _checked(json.loads(data))
    except (ValueError, InvalidArgument) as exc:
        raise FailedPrecondition(f"the cut's positions part is malformed: {exc}") from exc


def _checked(positions: Any) -> dict[str, int]:
    if not isinstance(positions, Mapping):
        raise InvalidArgument(f"positions must map partition to position, got "
                              f"{type(positions).__name__}")
    for partition, position in positions.items():
        if not isinstance(partition, str) or isinstance(position, bool) \
                or not isinstance(position, int) or position < 0:
            raise InvalidArgument(f"position of partition {partition!r} must be an int >= 0, "
                                  f"got {position!r}")
    return dict(positions)


def cut_positions(root: Path | str, checkpoint_id: str | None = None) -> dict[str, int]:
    """The positions of the complete job cut ``checkpoint_id`` under ``root`` (None: of the
    newest complete job checkpoint; ``{}`` when there is none yet: the job's start)."""
    if checkpoint_id is None:
        manifest = latest_complete(root)
        if manifest is None:
            return {}
    else:
        manifest = read_job_manifest(root, checkpoint_id)
    if POSITIONS_PART not in manifest["parts"]:
        raise FailedPrecondition(f"job checkpoint {manifest['checkpoint_id']!r} is no cut: it "
                                 "has no source positions")
    return decode_positions(read_part(root, manifest, POSITIONS_PART))
