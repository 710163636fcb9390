"""DES-style partial pooling on a shard: the checks of a pooled request and the per-sample sums
of the rows the shard owns (sample ``b`` owns the next ``lengths[b]`` ids)."""

from __future__ import annotations

import numpy as np

from services.common.errors import InvalidArgument

__all__ = ["check_lengths", "segment_sum"]


def check_lengths(ids: np.ndarray, lengths: np.ndarray, max_samples: int) -> np.ndarray:
    """Per-sample id counts: a 1-d array of at most ``max_samples`` non-negative integers
    adding up to ``ids.size`` (int64), or :class:`InvalidArgument`."""
    if not isinstance(lengths, np.ndarray) or lengths.ndim != 1 \
            or lengths.dtype.kind not in "iu":
        raise InvalidArgument("lengths must be a 1-d integer array (ids per sample)")
    if lengths.size > max_samples:
        raise InvalidArgument(f"{lengths.size} samples exceed the limit of {max_samples} per "
                              "request")
    if lengths.size and int(lengths.min()) < 0:
        raise InvalidArgument("lengths must be >= 0")
    total = int(lengths.sum(dtype=np.int64))
    if total != ids.size:
        raise InvalidArgument(f"lengths add up to {total} but there are {ids.size} ids")
    return lengths.astype(np.int64, copy=False)


def segment_sum(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``rows``, run ``b`` of ``lengths[b]`` rows (0 rows: zeros)."""
    out = np.zeros((lengths.size, rows.shape[1]), dtype=np.float32)
    nonempty = lengths > 0
    if rows.shape[0]:
        starts = np.cumsum(lengths) - lengths
        out[nonempty] = np.add.reduceat(rows, starts[nonempty], axis=0)
    return out
