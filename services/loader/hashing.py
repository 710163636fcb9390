"""Feature hashing: a categorical value becomes a stable uint64 id, and dense transforms.

The id of value ``v`` (its bytes, as written in the source) in feature ``f`` is::

    h = FNV-1a-64(v) started from the basis seed(f) instead of the FNV offset basis
    id = splitmix64_finalizer(h)            (then ``% buckets`` when the feature has buckets)
    seed(f) = splitmix64_finalizer(FNV-1a-64(utf-8 bytes of f))

FNV-1a and splitmix64 are plain integer arithmetic, so every machine, run and process gets
the same ids (unlike Python's salted ``hash``). Integers from typed sources (Parquet, JSON)
are hashed as their decimal text and synthetic raw ids as their 8-digit lowercase hex text, so
the same value gets the same id whatever the file format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = [
    "DenseTransform",
    "feature_seed",
    "hash_decimal_ints",
    "hash_hex_ids",
    "hash_strings",
    "hash_value",
    "pack_strings",
]

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


@njit(inline="always")
def fnv_byte(h: np.uint64, byte: np.uint8) -> np.uint64:
    return (h ^ np.uint64(byte)) * np.uint64(FNV_PRIME)


@njit(inline="always")
def finalize(z: np.uint64) -> np.uint64:
    """The splitmix64 finalizer (a bijection that spreads nearby inputs)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(inline="always")
def bucketize(h: np.uint64, buckets: np.uint64) -> np.uint64:
    return h % buckets if buckets > np.uint64(0) else h


def _py_finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _py_fnv(data: bytes, h: int) -> int:
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


def feature_seed(name: str) -> int:
    """The FNV basis of feature ``name`` (an int in [0, 2**64))."""
    return _py_finalize(_py_fnv(name.encode(), FNV_OFFSET))


def hash_value(name: str, value: str | bytes, buckets: int = 0) -> int:
    """The id of one value: the reference definition, in plain Python (slow; for tests/docs)."""
    data = value.encode() if isinstance(value, str) else value
    h = _py_finalize(_py_fnv(data, feature_seed(name)))
    return h % buckets if buckets > 0 else h


@njit(nogil=True, cache=True)
def _hash_spans(data: np.ndarray, offsets: np.ndarray, seed: np.uint64,
                buckets: np.uint64) -> np.ndarray:
    n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.uint64)
    for i in range(n):
        h = seed
        for j in range(offsets[i], offsets[i + 1]):
            h = fnv_byte(h, data[j])
        out[i] = bucketize(finalize(h), buckets)
    return out


def hash_strings(data: np.ndarray, offsets: np.ndarray, name: str, buckets: int = 0) -> np.ndarray:
    """Ids of the byte strings ``data[offsets[i]:offsets[i+1]]`` (Arrow's string layout)."""
    return _hash_spans(np.asarray(data, dtype=np.uint8), np.asarray(offsets, dtype=np.int64),
                       np.uint64(feature_seed(name)), np.uint64(buckets))


def pack_strings(values: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated utf-8 bytes and offsets of a list of strings (for :func:`hash_strings`)."""
    encoded = [v.encode() if isinstance(v, str) else v for v in values]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


@njit(nogil=True, cache=True)
def _hash_hex(ids: np.ndarray, seed: np.uint64, buckets: np.uint64, width: int) -> np.ndarray:
    out = np.empty(ids.shape[0], dtype=np.uint64)
    for i in range(ids.shape[0]):
        v = ids[i]
        ndig = 1
        while ndig < 16 and (v >> np.uint64(4 * ndig)) != np.uint64(0):
            ndig += 1
        ndig = max(ndig, width)
        h = seed
        for k in range(ndig - 1, -1, -1):
            d = (v >> np.uint64(4 * k)) & np.uint64(15)
            h = fnv_byte(h, np.uint8(48 + d if d < 10 else 87 + d))
        out[i] = bucketize(finalize(h), buckets)
    return out


def hash_hex_ids(ids: np.ndarray, name: str, buckets: int = 0, width: int = 8) -> np.ndarray:
    """Ids of integers written as lowercase hex zero-padded to ``width`` (``f"{v:08x}"``)."""
    return _hash_hex(np.asarray(ids, dtype=np.uint64), np.uint64(feature_seed(name)),
                     np.uint64(buckets), width)


@njit(nogil=True, cache=True)
def _hash_decimal(values: np.ndarray, seed: np.uint64, buckets: np.uint64) -> np.ndarray:
    out = np.empty(values.shape[0], dtype=np.uint64)
    digits = np.empty(20, dtype=np.uint8)
    for i in range(values.shape[0]):
        v = values[i]
        h = seed
        if v < 0:
            h = fnv_byte(h, np.uint8(45))  # '-'
            mag = np.uint64(-(v + 1)) + np.uint64(1)  # safe for int64 min
        else:
            mag = np.uint64(v)
        n = 0
        while True:
            digits[n] = np.uint8(48 + mag % np.uint64(10))
            mag //= np.uint64(10)
            n += 1
            if mag == np.uint64(0):
                break
        for k in range(n - 1, -1, -1):
            h = fnv_byte(h, digits[k])
        out[i] = bucketize(finalize(h), buckets)
    return out


def hash_decimal_ints(values: np.ndarray, name: str, buckets: int = 0) -> np.ndarray:
    """Ids of integers written in decimal (``str(v)``), as a typed source would print them."""
    return _hash_decimal(np.asarray(values, dtype=np.int64), np.uint64(feature_seed(name)),
                         np.uint64(buckets))


@dataclass(kw_only=True, slots=True)
class DenseTransform:
    """Dense preprocessing: missing → ``fill``, clip to [clip_min, clip_max], then log1p.

    The Criteo convention is the default: counts below 0 become 0, then ``log(1 + x)``.
    """

    fill: float = 0.0
    clip_min: float | None = 0.0
    clip_max: float | None = None
    log1p: bool = True

    def __post_init__(self) -> None:
        if not math.isfinite(self.fill):
            raise ValueError(f"dense fill must be finite, got {self.fill}")
        if self.clip_min is not None and self.clip_max is not None \
                and self.clip_min > self.clip_max:
            raise ValueError(f"clip_min {self.clip_min} is above clip_max {self.clip_max}")
        if self.log1p and (self.clip_min is None or self.clip_min <= -1.0):
            raise ValueError("log1p needs clip_min > -1 (log1p(x) is undefined for x <= -1)")

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The transformed float32 copy of ``x`` (any shape; NaN means missing)."""
        out = np.array(x, dtype=np.float32, copy=True)
        big = float(np.finfo(np.float32).max)
        np.nan_to_num(out, copy=False, nan=self.fill,
                      posinf=self.clip_max if self.clip_max is not None else big,
                      neginf=self.clip_min if self.clip_min is not None else -big)
        if self.clip_min is not None or self.clip_max is not None:
            np.clip(out, self.clip_min, self.clip_max, out=out)
        if self.log1p:
            np.log1p(out, out=out)
        return out
