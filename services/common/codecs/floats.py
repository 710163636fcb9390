"""Lossless passthrough and the half-precision float codecs (fp16, bf16)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from services.common.codecs.base import Codec
from services.common.codecs.bits import byte_view
from services.common.errors import MalformedMessage

__all__ = ["BF16Codec", "FP16Codec", "NoneCodec", "bf16_to_float32", "float32_to_bf16"]


def _check_len(data: Any, count: int, itemsize: int, name: str) -> None:
    if memoryview(data).nbytes != count * itemsize:
        raise MalformedMessage(
            f"{name} array of {count} elements needs {count * itemsize} bytes, "
            f"got {memoryview(data).nbytes}"
        )


class NoneCodec(Codec):
    """The raw little-endian buffer (a view of the array's memory, no copy when contiguous)."""

    name = "none"
    lossless = True

    def encode(self, x: np.ndarray, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
        if x.dtype.byteorder == ">":
            x = x.astype(x.dtype.newbyteorder("<"))
        return byte_view(x), {}

    def decode(self, data, meta, dtype, shape):
        _check_len(data, math.prod(shape), dtype.itemsize, self.name)
        return np.frombuffer(data, dtype=dtype).reshape(shape)


class FP16Codec(Codec):
    """IEEE half precision: 2 bytes per element, relative error ≤ 2^-11 in range."""

    name = "fp16"

    def encode(self, x: np.ndarray, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
        return byte_view(x.astype(np.float16)), {}

    def decode(self, data, meta, dtype, shape):
        _check_len(data, int(np.prod(shape, dtype=np.int64)), 2, self.name)
        return np.frombuffer(data, dtype=np.float16).reshape(shape).astype(dtype)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Flat bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    bits = flat.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(flat)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class BF16Codec(Codec):
    """bfloat16: fp32's exponent range, 8 bits of mantissa (relative error ≤ 2^-8)."""

    name = "bf16"

    def encode(self, x: np.ndarray, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
        return byte_view(float32_to_bf16(x)), {}

    def decode(self, data, meta, dtype, shape):
        _check_len(data, int(np.prod(shape, dtype=np.int64)), 2, self.name)
        return bf16_to_float32(np.frombuffer(data, dtype=np.uint16)).reshape(shape).astype(dtype)
