"""The codec interface: array → (buffer, meta) → array, with byte accounting.

:meth:`Codec.to_wire` and :meth:`Codec.from_wire` are the one path between an array and its
:class:`~services.common.codecs.array.WireArray` (the raw layout is the ``none`` codec).

A codec instance belongs to one stream (rows down, gradients up, activations, dense
all-reduce). Encoding may keep state between calls (error-feedback residuals, a cached
threshold); decoding is a pure function of ``(data, meta, dtype, shape)`` so a receiver
never needs the sender's state. Every encode updates :class:`CodecStats`.

:class:`FloatCodec` is the base of the lossy codecs of float arrays: it owns the checks every
one of them makes before its own encoding and decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from services.common.codecs.array import WireArray
from services.common.codecs.bits import NONFINITE, all_finite, decode_nonfinite, float_input
from services.common.errors import InvalidArgument, MalformedMessage

__all__ = ["Codec", "CodecStats", "ErrorFeedback", "FloatCodec"]


@dataclass(slots=True)
class CodecStats:
    """Bytes a codec was given (raw) and bytes it put on the wire, and how many arrays."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    arrays: int = 0

    def add(self, raw: int, wire: int) -> None:
        self.raw_bytes += raw
        self.wire_bytes += wire
        self.arrays += 1

    @property
    def ratio(self) -> float:
        """Compression ratio raw / wire (1.0 before anything was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def as_dict(self) -> dict[str, float]:
        return {"raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes,
                "arrays": self.arrays, "ratio": self.ratio}


_DTYPE_NAMES: dict[np.dtype, Any] = {}  # a dtype -> its name (a WireArray DType)


class Codec:
    """Base class of every codec; subclasses implement :meth:`encode` and :meth:`decode`.

    ``name`` is the registry key and travels on the wire; ``lossless`` says whether a
    round trip is exact; ``stateful`` says whether :meth:`encode` keeps state (the
    error-feedback codecs), which makes an instance unsafe to share across streams.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    def __init__(self) -> None:
        self.stats = CodecStats()

    def encode(self, x: np.ndarray, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
        """Return ``(buffer, meta)``; ``key`` selects per-key state of stateful codecs."""
        raise NotImplementedError

    def decode(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
               shape: tuple[int, ...]) -> np.ndarray:
        """Rebuild an array of ``dtype`` and ``shape`` from ``encode``'s output."""
        raise NotImplementedError

    def to_wire(self, x: np.ndarray, *, key: Any = None) -> WireArray:
        """``x`` encoded as a :class:`WireArray` (no copy of a contiguous raw buffer), counted
        in :attr:`stats`."""
        x = np.asarray(x)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)  # (never for a 0-d array, whose shape it would change)
        data, meta = self.encode(x, key=key)
        self.stats.add(x.nbytes, memoryview(data).nbytes)
        name: Any = _DTYPE_NAMES.get(x.dtype)
        if name is None:  # dtype.name is slow (Python code in numpy): cache it per dtype
            name = _DTYPE_NAMES[x.dtype] = x.dtype.name
        return WireArray(dtype=name, shape=x.shape, codec=self.name, meta=meta, data=data)

    def from_wire(self, arr: WireArray | dict[str, Any]) -> np.ndarray:
        """Decode ``arr`` (a :class:`WireArray` or its map, checked first) with this codec."""
        if not isinstance(arr, WireArray):
            arr = WireArray.from_wire(arr)
        try:
            return self.decode(arr.data, arr.meta, np.dtype(arr.dtype), arr.shape)
        except MalformedMessage:
            raise
        except Exception as exc:
            raise MalformedMessage(f"cannot decode {self.name} array: {exc}") from exc


class FloatCodec(Codec):
    """A lossy codec of float arrays; subclasses implement :meth:`encode_float` and
    :meth:`decode_float`, which this class calls after the checks they share.

    Encoding takes the input as flat float32 (another dtype is an InvalidArgument), refuses
    more than ``max_elements`` elements (None: no bound of its own) and, where
    ``nonfinite_flag`` is set, ships an input holding NaN/Inf as no data and
    ``{"nonfinite": 1}``. Decoding gives that flag's all-NaN array and refuses a non-float
    dtype (MalformedMessage). Codecs without the flag (int8, uniform) carry NaN/Inf rows in
    their own payload.
    """

    nonfinite_flag: ClassVar[bool] = True
    max_elements: ClassVar[int | None] = None

    def encode(self, x: np.ndarray, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
        flat = float_input(x, self.name)
        if self.max_elements is not None and flat.size > self.max_elements:
            raise InvalidArgument(f"{self.name} encodes at most {self.max_elements} elements, "
                                  f"got {flat.size}")
        if self.nonfinite_flag and not all_finite(flat):
            return b"", {NONFINITE: 1}
        return self.encode_float(flat, x.shape, key)

    def decode(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
               shape: tuple[int, ...]) -> np.ndarray:
        if self.nonfinite_flag:
            nan = decode_nonfinite(data, meta, dtype, shape, self.name)
            if nan is not None:
                return nan
        if dtype.kind != "f":
            raise MalformedMessage(f"{self.name} cannot decode to dtype {dtype}")
        return self.decode_float(data, meta, dtype, shape)

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        """``(buffer, meta)`` of ``flat`` (float32, the input of ``shape`` flattened; finite
        where ``nonfinite_flag`` is set)."""
        raise NotImplementedError

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        """The array of ``dtype`` (a float) and ``shape`` that ``encode_float`` sent."""
        raise NotImplementedError


class ErrorFeedback:
    """Per-key residuals for error-feedback codecs: ``x + e`` goes in, ``e`` keeps what was not sent.

    Invariant (tested): Σ sent = Σ input − residual.
    """

    def __init__(self) -> None:
        self._residuals: dict[Any, np.ndarray] = {}

    def add(self, key: Any, x: np.ndarray) -> np.ndarray:
        """Return ``x`` plus the residual kept for ``key`` (float32)."""
        e = self._residuals.get(key)
        x = x.astype(np.float32, copy=True)
        if e is not None and e.shape == x.shape:
            x += e
        return x

    def keep(self, key: Any, corrected: np.ndarray, sent: np.ndarray) -> None:
        """Remember ``corrected − sent`` for the next call with ``key``."""
        self._residuals[key] = corrected - sent

    def residual(self, key: Any) -> np.ndarray | None:
        return self._residuals.get(key)

    def reset(self) -> None:
        self._residuals.clear()
