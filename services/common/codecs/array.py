"""The typed wire form of one array: :class:`WireArray`, a msgspec Struct.

On the wire an array is the map ``{"dtype", "shape", "codec", "meta", "data"}``: ``data`` is
the codec's output buffer (for the ``none`` codec the raw little-endian bytes), ``meta`` the
codec's parameters (scalars, and one level of nested map for a lossless wrapper's inner
codec). Decoding a message checks the header (dtype, shape, codec name, meta, buffer type; a
raw array's bytes against its shape) without decoding or allocating anything; decoding
belongs to the codec the header names (:func:`services.common.codecs.decode_array`). No copy
is made either way: ``data`` is the memoryview or bytes it was given, and a received array's
``data`` a view of the received frame.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from services.common.errors import MalformedMessage
from services.common.wire import Record, explain

__all__ = ["ALLOWED_DTYPES", "MAX_ARRAY_ELEMENTS", "MAX_WRAPPERS", "CodecMeta", "WireArray"]

ALLOWED_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
     "int64", "uint64", "bool"}
)
#: the most elements a received array may declare (a codec could otherwise be asked to
#: allocate a huge array from a tiny payload)
MAX_ARRAY_ELEMENTS = 2**31
MAX_DIMS = 8
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}

DType = Literal["float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
                "uint32", "int64", "uint64", "bool"]
Dim = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Shape = Annotated[tuple[Dim, ...], Meta(max_length=MAX_DIMS)]
CodecName = Annotated[str, Meta(min_length=1, max_length=64)]
MetaKey = Annotated[str, Meta(max_length=64)]
MetaScalar = int | float | str | bool | None
#: lossless wrappers a codec may stack (bounds what decoders cache); CodecMeta nests this deep
MAX_WRAPPERS = 2
_BaseMeta = Annotated[dict[MetaKey, MetaScalar], Meta(max_length=64)]
_WrappedOnce = Annotated[dict[MetaKey, MetaScalar | _BaseMeta], Meta(max_length=64)]
#: a codec's parameters: scalars, and the inner codec's map (``"m"``) under each lossless
#: wrapper, as deep as :data:`MAX_WRAPPERS` wrappers go
CodecMeta = Annotated[dict[MetaKey, MetaScalar | _WrappedOnce], Meta(max_length=64)]


class BadArray(MalformedMessage, ValueError):
    """A header whose fields disagree (a ValueError too, so that msgspec names its place)."""


class WireArray(Record, kw_only=True):
    """One encoded array: header plus the codec's buffer (bytes or a memoryview, not copied).
    Construction checks what spans fields: the element count against the limit, a raw
    array's bytes against its shape, a codec name without parameters."""

    dtype: DType
    shape: Shape
    codec: CodecName = "none"
    meta: CodecMeta = {}
    data: memoryview = memoryview(b"")

    def __post_init__(self) -> None:
        count = math.prod(self.shape)  # Python ints: a huge declared shape cannot overflow
        if count > MAX_ARRAY_ELEMENTS:
            raise BadArray(f"array of shape {list(self.shape)} needs {count} elements, "
                                   f"more than the limit of {MAX_ARRAY_ELEMENTS}")
        if self.codec == "none":
            nbytes = memoryview(self.data).nbytes
            if nbytes != count * _ITEMSIZE[self.dtype]:
                raise BadArray(f"array of shape {list(self.shape)} and dtype "
                                       f"{self.dtype} needs {count * _ITEMSIZE[self.dtype]} "
                                       f"bytes, got {nbytes}")
        elif ":" in self.codec:
            raise BadArray(f"array codec {self.codec!r} must be a codec name "
                                   "(parameters travel in meta, never in the name)")

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
        """The array's map (for frames built by hand: tests, probes)."""
        return {"dtype": self.dtype, "shape": list(self.shape), "codec": self.codec,
                "meta": self.meta, "data": self.data}

    @classmethod
    def from_wire(cls, body: Any, where: str = "array") -> WireArray:
        """Check an array map; anything malformed is a :class:`MalformedMessage` naming
        the field."""
        if isinstance(body, WireArray):
            return body
        try:
            return msgspec.convert(body, cls, builtin_types=(bytes, bytearray, memoryview))
        except msgspec.ValidationError as exc:
            raise MalformedMessage(explain(exc, where)) from exc
        except MalformedMessage as exc:
            raise MalformedMessage(f"{where}: {exc.message}") from exc

