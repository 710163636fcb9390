"""Fixed-rate quantizers: ``int8`` and ``uniform`` (per-row scale), ``onebit`` (sign + per-chunk scale).

int8 wire: ``rows`` float32 scales, then one int8 per element (rows = the last axis).
Each element is within ``max|row| / 254`` of its input. A row holding NaN/Inf travels as
a NaN scale and decodes as all-NaN, so the receiver's NaN check still sees it.

uniform wire (``bits`` b in [2, 8], default 4): ``rows`` bfloat16 scales ``s``, then one
code of b bits per element, packed back to back (:mod:`.bits`); the code ``c`` decodes as
``(c − q) · s`` with ``q = 2^(b−1) − 1``. ``s`` is the smallest bfloat16 ≥ ``max|row| / q``
and codes are rounded to nearest (deterministic, so biased: meant for values that are used,
like rows read by the forward pass, not for gradients that are summed), so every element is
within ``s / 2 ≤ (1 + 2^-7) · max|row| / (2q)`` of its input (``max|row| / 14.0`` at 4 bits)
for any row whose ``max|row| / q`` is a normal bfloat16; NaN/Inf rows as for int8. For
gradients, ``error_feedback=True`` adds the residual kept per ``key`` (as onebit does, and
per id through :class:`~services.common.codecs.rows.RowEncoder`): the bias then never
accumulates, ``Σ sent = Σ input − residual``.

onebit wire: one float32 scale per chunk of ``chunk`` elements (the chunk's RMS,
``||c|| / sqrt(len c)``), then one sign bit per element (see :mod:`.bits`). Error feedback
per ``key``: the input plus the residual is compressed, and what was not sent is kept
for the next call with that key, so ``Σ sent = Σ input − residual``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.codecs.base import ErrorFeedback, FloatCodec
from services.common.codecs.bits import (
    all_finite,
    expect_nbytes,
    meta_int,
    numel,
    pack_signs,
    pack_uint,
    unpack_signs,
    unpack_uint,
)
from services.common.codecs.floats import bf16_to_float32, float32_to_bf16
from services.common.errors import ConfigError, MalformedMessage

__all__ = ["ONEBIT_EMBEDDING_REFUSAL", "Int8Codec", "OneBitCodec", "UniformCodec", "chunk_rms",
           "onebit_values"]

MAX_CHUNK = 1 << 24

#: Why 1-bit Adam / 1-bit LAMB never update embedding rows; every place where they could be
#: configured for embeddings (dense optimizers given an embedding module, PS table
#: optimizers) refuses with this reason.
ONEBIT_EMBEDDING_REFUSAL = (
    "1-bit optimizers apply to dense parameters only: 1-bit compression cannot send exact "
    "zeros (rows absent from a batch would still move) and rows never seen have zero "
    "variance, so the frozen-variance update explodes; keep embeddings on the parameter "
    "server with its own optimizer (sgd, adagrad, adam, ftrl)")


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length) of an array whose rows run along the last axis."""
    if not shape:
        return 1, 1
    width = int(shape[-1])
    return (numel(shape[:-1]) if width else 0), width


class Int8Codec(FloatCodec):
    """Symmetric int8 with one float32 scale per row (``max|row| / 127``)."""

    name = "int8"
    nonfinite_flag = False  # a NaN/Inf row travels as a NaN scale

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        rows, width = _rows(shape)
        if rows == 0:
            return b"", {}
        x2 = flat.reshape(rows, width)
        amax = np.max(np.abs(x2), axis=1)
        scale = (amax / np.float32(127.0)).astype(np.float32)
        ok = np.isfinite(scale)
        safe = np.where(ok & (scale > 0), scale, np.float32(1.0))
        q = np.rint(x2 / safe[:, None])
        q[~ok] = 0
        q = np.clip(q, -127, 127).astype(np.int8)
        scale[~ok] = np.nan
        out = np.empty(4 * rows + q.size, dtype=np.uint8)
        out[: 4 * rows] = scale.astype("<f4").view(np.uint8)
        out[4 * rows:] = q.reshape(-1).view(np.uint8)
        return out.data, {}

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        rows, width = _rows(shape)
        expect_nbytes(data, 4 * rows + rows * width, f"int8 array of shape {list(shape)}")
        if rows == 0:
            return np.zeros(shape, dtype=dtype)
        scale = np.frombuffer(data, dtype="<f4", count=rows)
        q = np.frombuffer(data, dtype=np.int8, offset=4 * rows).reshape(rows, width)
        return (q * scale[:, None]).astype(dtype).reshape(shape)


def _bf16_scales(amax: np.ndarray, q: int) -> np.ndarray:
    """Bit patterns of the smallest bfloat16 ≥ ``amax / q`` per row (NaN for NaN/Inf rows)."""
    wanted = amax.astype(np.float64) / q
    bits = float32_to_bf16(wanted.astype(np.float32))
    short = bf16_to_float32(bits).astype(np.float64) * q < amax  # rounded down: one ulp up
    bits[short] += 1
    bits[~np.isfinite(bf16_to_float32(bits))] = 0x7FC0  # NaN/Inf row, or a scale past bf16 max
    return bits


class UniformCodec(FloatCodec):
    """``bits``-bit symmetric uniform quantization per row, nearest rounding, bf16 scale.

    Bound (tested): each element within half the row's scale, ``s / 2`` with ``s`` ≤
    ``(1 + 2^-7) · max|row| / (2^(bits−1) − 1)`` (of the input plus residual with
    ``error_feedback``). Deterministic; stateless unless ``error_feedback``.
    """

    name = "uniform"
    nonfinite_flag = False  # a NaN/Inf row travels as a NaN scale

    def __init__(self, *, bits: int = 4, error_feedback: bool = False) -> None:
        super().__init__()
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            raise ConfigError(f"uniform bits must be an int in [2, 8], got {bits!r}")
        if not isinstance(error_feedback, bool):
            raise ConfigError(f"uniform error_feedback must be true or false, "
                              f"got {error_feedback!r}")
        self.bits = bits
        self.error_feedback = error_feedback
        self.feedback = ErrorFeedback()
        setattr(self, "stateful", error_feedback)  # noqa: B010

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        rows, width = _rows(shape)
        if rows == 0:
            return b"", {"bits": self.bits}
        feedback = self.error_feedback and all_finite(flat)  # a NaN push keeps the residual
        a = self.feedback.add(key, flat) if feedback else flat
        data = self._quantize(a.reshape(rows, width))
        if feedback:
            sent = self.decode_float(data, {"bits": self.bits}, np.dtype(np.float32), shape)
            self.feedback.keep(key, a, sent.reshape(-1))
        return data, {"bits": self.bits}

    def _quantize(self, x2: np.ndarray) -> Any:
        rows = x2.shape[0]
        q = (1 << (self.bits - 1)) - 1
        bits = _bf16_scales(np.max(np.abs(x2), axis=1), q)
        scale = bf16_to_float32(bits)
        ok = np.isfinite(scale) & (scale > 0)
        codes = np.rint(x2 / np.where(ok, scale, np.float32(1.0))[:, None])
        codes[~ok] = 0
        np.clip(codes, -q, q, out=codes)
        packed = pack_uint((codes + q).astype(np.uint8), self.bits)
        out = np.empty(2 * rows + packed.size, dtype=np.uint8)
        out[: 2 * rows] = bits.astype("<u2").view(np.uint8)
        out[2 * rows:] = packed
        return out.data

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        b = meta_int(meta, "bits", 2, 8, self.name)
        rows, width = _rows(shape)
        n = rows * width
        expect_nbytes(data, 2 * rows + -(-n * b // 8), f"uniform array of shape {list(shape)}")
        if rows == 0:
            return np.zeros(shape, dtype=dtype)
        scale = bf16_to_float32(np.frombuffer(data, dtype="<u2", count=rows))
        if np.any(scale < 0) or np.any(np.isinf(scale)):
            raise MalformedMessage("uniform scales must be finite and ≥ 0 (or NaN)")
        q = (1 << (b - 1)) - 1
        codes = unpack_uint(np.frombuffer(data, dtype=np.uint8, offset=2 * rows), n, b)
        if n and codes.max() > 2 * q:
            raise MalformedMessage(f"uniform code above {2 * q} for {b} bits")
        values = (codes.astype(np.float32) - np.float32(q)).reshape(rows, width) * scale[:, None]
        return values.astype(dtype).reshape(shape)

    def residual(self, key: Any = None) -> np.ndarray | None:
        """What error feedback still owes for ``key`` (None before the first encode)."""
        return self.feedback.residual(key)

    def reset(self) -> None:
        """Forget every residual."""
        self.feedback.reset()


def chunk_rms(x: np.ndarray, chunk: int) -> np.ndarray:
    """Float32 RMS of each consecutive ``chunk`` of flat ``x`` (the last may be short)."""
    n = x.size
    full, rest = divmod(n, chunk)
    sq = np.square(x, dtype=np.float64)
    sums = np.add.reduceat(sq, np.arange(0, n, chunk)) if n else np.zeros(0)
    lengths = np.full(full + (1 if rest else 0), chunk, dtype=np.float64)
    if rest:
        lengths[-1] = rest
    return np.sqrt(sums / lengths).astype(np.float32)


def onebit_values(scales: np.ndarray, signs: np.ndarray, chunk: int) -> np.ndarray:
    """``scale[chunk of i] · sign[i]`` as float32 (what a onebit payload decodes to)."""
    return np.repeat(scales, chunk)[: signs.size] * signs


class OneBitCodec(FloatCodec):
    """Sign bits plus one RMS scale per chunk, with per-key error feedback.

    ``chunk``: elements per scale (default 2048, i.e. 1 + 32/2048 bits per element).
    ``error_feedback=False`` turns the residual off (for streams that are not summed).
    """

    name = "onebit"
    stateful = True

    def __init__(self, *, chunk: int = 2048, error_feedback: bool = True) -> None:
        super().__init__()
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
            raise ConfigError(f"onebit chunk must be an int in [1, {MAX_CHUNK}], got {chunk!r}")
        self.chunk = chunk
        self.error_feedback = bool(error_feedback)
        self.feedback = ErrorFeedback()

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        a = self.feedback.add(key, flat) if self.error_feedback else flat
        scales = chunk_rms(a, self.chunk)
        bits = pack_signs(a)
        if self.error_feedback:
            sent = onebit_values(scales, unpack_signs(bits, a.size), self.chunk)
            self.feedback.keep(key, a, sent)
        out = np.empty(4 * scales.size + bits.size, dtype=np.uint8)
        out[: 4 * scales.size] = scales.astype("<f4").view(np.uint8)
        out[4 * scales.size:] = bits
        return out.data, {"chunk": self.chunk}

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        chunk = meta_int(meta, "chunk", 1, MAX_CHUNK, self.name)
        n = numel(shape)
        chunks = -(-n // chunk)
        expect_nbytes(data, 4 * chunks + -(-n // 8), f"onebit array of {n} elements")
        scales = np.frombuffer(data, dtype="<f4", count=chunks)
        packed = np.frombuffer(data, dtype=np.uint8, offset=4 * chunks)
        values = onebit_values(scales, unpack_signs(packed, n), chunk)
        return values.astype(dtype).reshape(shape)

    def residual(self, key: Any = None) -> np.ndarray | None:
        """What error feedback still owes for ``key`` (None before the first encode)."""
        return self.feedback.residual(key)

    def reset(self) -> None:
        """Forget every residual (e.g. after a checkpoint restore)."""
        self.feedback.reset()

