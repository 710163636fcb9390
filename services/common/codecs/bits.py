"""Bit packing and payload checks shared by the lossy codecs.

Layouts (all little-endian, bit order ``little``: element ``i`` is bit ``i % 8`` of byte ``i // 8``):

- sign bits: bit 1 means negative, so ``sign(0) = +1`` (a zero travels as ``+scale``);
- fixed-width unsigned codes: ``width`` bits per element, packed back to back.

The ``meta_*`` and ``expect_nbytes`` helpers turn a bad payload into a
:class:`~services.common.errors.MalformedMessage` before any array is built, and the
``nonfinite`` helpers give every lossy codec one way to ship an input holding NaN/Inf:
no data and ``{"nonfinite": 1}``, decoded as all-NaN so a receiver's NaN check drops it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.errors import InvalidArgument, MalformedMessage

__all__ = [
    "NONFINITE",
    "all_finite",
    "byte_view",
    "decode_nonfinite",
    "expect_nbytes",
    "float_input",
    "meta_choice",
    "meta_int",
    "nbytes_of",
    "numel",
    "pack_signs",
    "pack_uint",
    "unpack_signs",
    "unpack_uint",
]

NONFINITE = "nonfinite"


def numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def byte_view(x: np.ndarray) -> memoryview:
    """The bytes of ``x`` in C order as a flat memoryview (copies only a non-contiguous ``x``);
    works for 0-d and zero-size multi-dimensional arrays, which ``memoryview.cast`` refuses."""
    return np.ascontiguousarray(x).reshape(-1).data.cast("B")


def nbytes_of(data: Any) -> int:
    return memoryview(data).nbytes


def expect_nbytes(data: Any, expected: int, what: str) -> None:
    """Raise MalformedMessage unless ``data`` holds exactly ``expected`` bytes."""
    got = nbytes_of(data)
    if got != expected:
        raise MalformedMessage(f"{what} needs {expected} bytes, got {got}")


def meta_int(meta: dict[str, Any], key: str, lo: int, hi: int, codec: str) -> int:
    """The integer ``meta[key]``, checked to lie in ``[lo, hi]``."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise MalformedMessage(f"{codec} meta {key!r} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def meta_choice(meta: dict[str, Any], key: str, choices: tuple[str, ...], codec: str) -> str:
    value = meta.get(key)
    if value not in choices:
        raise MalformedMessage(f"{codec} meta {key!r} must be one of {choices}, got {value!r}")
    return str(value)


def float_input(x: np.ndarray, codec: str) -> np.ndarray:
    """``x`` as a flat float32 array; non-float inputs are an InvalidArgument."""
    if x.dtype.kind != "f":
        raise InvalidArgument(f"codec {codec} encodes float arrays, got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def all_finite(x: np.ndarray) -> bool:
    """True when no element is NaN or ±Inf (one float64 sum, no boolean temporary)."""
    return bool(np.isfinite(np.sum(x, dtype=np.float64)))


def decode_nonfinite(data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...], codec: str) -> np.ndarray | None:
    """The all-NaN array of a payload flagged ``nonfinite``; None for an ordinary payload."""
    if not meta.get(NONFINITE):
        return None
    expect_nbytes(data, 0, f"{codec} non-finite payload")
    if dtype.kind != "f":
        raise MalformedMessage(f"{codec} cannot decode to dtype {dtype}")
    return np.full(shape, np.nan, dtype=dtype)


def pack_signs(x: np.ndarray) -> np.ndarray:
    """One bit per element, 1 where ``x < 0``; ``ceil(n / 8)`` bytes."""
    return np.packbits(np.asarray(x).reshape(-1) < 0, bitorder="little")


def unpack_signs(packed: np.ndarray, count: int) -> np.ndarray:
    """±1.0 (float32) from :func:`pack_signs`; ``count`` elements."""
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count, bitorder="little")
    return 1.0 - 2.0 * bits.astype(np.float32)


def _container(width: int) -> np.dtype:
    if not 1 <= width <= 32:
        raise ValueError(f"code width must be in [1, 32], got {width}")
    return np.dtype("<u1" if width <= 8 else "<u2" if width <= 16 else "<u4")


def pack_uint(codes: np.ndarray, width: int) -> np.ndarray:
    """Pack unsigned codes below ``2**width`` into ``ceil(n * width / 8)`` bytes."""
    ctype = _container(width)
    c = np.ascontiguousarray(codes, dtype=ctype).reshape(-1)
    bits = np.unpackbits(c.view(np.uint8).reshape(c.size, ctype.itemsize), axis=1,
                         bitorder="little")
    return np.packbits(bits[:, :width].reshape(-1), bitorder="little")


def unpack_uint(packed: np.ndarray, count: int, width: int) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``count`` codes in the smallest unsigned container."""
    ctype = _container(width)
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count * width,
                         bitorder="little").reshape(count, width)
    full = np.zeros((count, ctype.itemsize * 8), dtype=np.uint8)
    full[:, :width] = bits
    return np.packbits(full, axis=1, bitorder="little").view(ctype).reshape(-1)
