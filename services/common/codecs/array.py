"""The typed wire form of one array: :class:`WireArray`.

On the wire an array is the map ``{"dtype", "shape", "codec", "meta", "data"}``: ``data`` is
the codec's output buffer (for the ``none`` codec the raw little-endian bytes), ``meta`` the
codec's parameters. :meth:`WireArray.from_wire` checks the header (dtype, shape, codec name,
meta, buffer type; a raw array's bytes against its shape) without decoding or allocating
anything; decoding belongs to the codec the header names
(:func:`services.common.codecs.decode_array`). No copy is made either way: ``data`` stays the
memoryview or received bytes it was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.errors import MalformedMessage

__all__ = ["ALLOWED_DTYPES", "MAX_ARRAY_ELEMENTS", "WireArray"]

ALLOWED_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
     "int64", "uint64", "bool"}
)
#: the most elements a received array may declare (a codec could otherwise be asked to
#: allocate a huge array from a tiny payload)
MAX_ARRAY_ELEMENTS = 2**31
MAX_DIMS = 8
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}
_KEYS = frozenset({"dtype", "shape", "codec", "meta", "data"})
_BUFFERS = frozenset({bytes, bytearray, memoryview})
_MAX_DIM = 2**63


@dataclass(kw_only=True, slots=True)
class WireArray:
    """One encoded array: header plus the codec's buffer (bytes or a memoryview, not copied)."""

    dtype: str
    shape: tuple[int, ...]
    codec: str = "none"
    meta: dict[str, Any] = field(default_factory=dict)
    data: Any = b""

    @property
    def nbytes(self) -> int:
        """Bytes of the payload on the wire."""
        return memoryview(self.data).nbytes

    @property
    def size(self) -> int:
        """Number of elements of the decoded array."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "codec": self.codec,
                "meta": self.meta, "data": self.data}

    @classmethod
    def from_wire(cls, body: Any, where: str = "array") -> WireArray:
        """Check a received array map; anything malformed is a :class:`MalformedMessage`."""
        if type(body) is not dict:  # exact types: msgpack gives dict, list, str, bytes
            if isinstance(body, WireArray):
                return body
            raise MalformedMessage(f"{where} must be a map with dtype, shape, codec, meta, data; "
                                   f"got {type(body).__name__}")
        if not body.keys() <= _KEYS:
            extra = sorted(map(str, body.keys() - _KEYS))
            raise MalformedMessage(f"{where} has unknown keys {extra}")
        get = body.get
        dtype, data, codec, meta = get("dtype"), get("data"), get("codec", "none"), get("meta", {})
        shape: Any = get("shape")
        if type(dtype) is not str or dtype not in ALLOWED_DTYPES:
            raise MalformedMessage(f"{where} dtype {_show(dtype)} is not one of "
                                   f"{sorted(ALLOWED_DTYPES)}")
        if not _good_shape(shape):
            raise MalformedMessage(f"{where} shape {_show(shape)} must be a list of at most "
                                   f"{MAX_DIMS} non-negative ints")
        count = math.prod(shape)  # Python ints: a huge declared shape cannot overflow
        if count > MAX_ARRAY_ELEMENTS:
            raise MalformedMessage(f"{where} of shape {list(shape)} needs {count} elements, "
                                   f"more than the limit of {MAX_ARRAY_ELEMENTS}")
        if type(data) not in _BUFFERS:
            raise MalformedMessage(f"{where} data must be a binary buffer")
        nbytes = memoryview(data).nbytes  # type: ignore[arg-type]  # a buffer: checked above
        if codec == "none" and nbytes != count * _ITEMSIZE[dtype]:
            raise MalformedMessage(f"{where} of shape {list(shape)} and dtype {dtype} needs "
                                   f"{count * _ITEMSIZE[dtype]} bytes, got {nbytes}")
        if type(codec) is not str or not codec or ":" in codec:
            raise MalformedMessage(f"{where} codec {_show(codec)} must be a codec name "
                                   "(parameters travel in meta, never in the name)")
        if type(meta) is not dict:
            raise MalformedMessage(f"{where} codec meta must be a map, got {type(meta).__name__}")
        return cls(dtype=dtype, shape=tuple(shape), codec=codec, meta=meta, data=data)


def _good_shape(shape: Any) -> bool:
    if type(shape) not in (list, tuple) or len(shape) > MAX_DIMS:
        return False
    for s in shape:
        if type(s) is not int or not 0 <= s < _MAX_DIM:
            return False
    return True


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
