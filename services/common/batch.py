"""The unit of training data a loader streams to a worker, and its wire form.

A :class:`Batch` of B samples holds

- ``labels``: float32 (B,)
- ``dense``: float32 (B, num_dense)
- ``sparse``: per feature name a :class:`Jagged` id list in the KeyedJaggedTensor layout:
  ``values`` uint64 (total,) and ``lengths`` int32 (B,) with ``lengths.sum() == total``;
  sample i's ids are ``values[offsets[i]:offsets[i + 1]]``, ``offsets = [0, *cumsum(lengths)]``
- ``batch_id``: the loader's sequence number (batch b goes to worker rank ``b % world_size``)
- ``positions``: per source partition (``"kafka:clicks:3"``, ``"file:e0:day_0.gz"``,
  ``"redis:events"``) the first and last source position (offset, line or row) of the batch's
  records there; informational, the loader commits offsets itself once the batch is acked.

Its wire form is :class:`services.common.loader_messages.BatchBody`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from services.common.errors import MalformedMessage

__all__ = ["Batch", "Batches", "Jagged", "RankBatches", "iterate"]


class Jagged(NamedTuple):
    """One sparse feature of a batch: ``values`` uint64 (total,), ``lengths`` int32 (B,)."""

    values: np.ndarray
    lengths: np.ndarray

    def offsets(self) -> np.ndarray:
        """int64 (B + 1,): sample i's ids are ``values[offsets[i]:offsets[i + 1]]``."""
        out = np.zeros(self.lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out


@dataclass(slots=True, eq=False)
class Batch:
    """B samples; construction checks dtypes and shapes (raises MalformedMessage)."""

    batch_id: int
    labels: np.ndarray
    dense: np.ndarray
    sparse: dict[str, Jagged]
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.batch_id, bool) or not isinstance(self.batch_id, int | np.integer) \
                or self.batch_id < 0:
            raise MalformedMessage(f"batch_id must be a non-negative int, got {self.batch_id!r}")
        self.batch_id = int(self.batch_id)
        _check(self.labels, np.float32, 1, "labels")
        size = self.labels.shape[0]
        _check(self.dense, np.float32, 2, "dense")
        if self.dense.shape[0] != size:
            raise MalformedMessage(f"dense has {self.dense.shape[0]} rows, labels {size}")
        for name, feature in self.sparse.items():
            if not isinstance(feature, Jagged):
                feature = self.sparse[name] = Jagged(*feature)
            _check(feature.values, np.uint64, 1, f"sparse[{name!r}].values")
            _check(feature.lengths, np.int32, 1, f"sparse[{name!r}].lengths")
            if feature.lengths.shape[0] != size:
                raise MalformedMessage(f"sparse[{name!r}].lengths has {feature.lengths.shape[0]}"
                                       f" entries for a batch of {size}")
            total = int(feature.lengths.sum(dtype=np.int64))
            if total != feature.values.shape[0] or (size and int(feature.lengths.min()) < 0):
                raise MalformedMessage(f"sparse[{name!r}]: lengths sum to {total} but there are "
                                       f"{feature.values.shape[0]} values")

    @property
    def size(self) -> int:
        """The number of samples B."""
        return int(self.labels.shape[0])

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def feature_names(self) -> list[str]:
        return list(self.sparse)


def _check(arr: Any, dtype: type, ndim: int, what: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise MalformedMessage(f"{what} must be an array, got {type(arr).__name__}")
    if arr.dtype != dtype or arr.ndim != ndim:
        raise MalformedMessage(f"{what} must be {np.dtype(dtype).name} with {ndim} dimension(s), "
                               f"got {arr.dtype} with shape {arr.shape}")


Batches = AsyncIterable[Batch] | Iterable[Batch]


@runtime_checkable
class RankBatches(Protocol):
    """Batches each rank of a job reads on its own (a cache of parsed columns, say): rank
    ``rank`` of ``world`` reads :meth:`for_rank`. It pickles, to reach the ranks' processes."""

    def for_rank(self, rank: int, world: int) -> Batches: ...


async def iterate(batches: Batches) -> AsyncGenerator[Batch, None]:
    """The batches of an iterable or an async iterable."""
    if isinstance(batches, AsyncIterable):
        async for b in batches:
            yield b
    else:
        for b in batches:
            yield b
