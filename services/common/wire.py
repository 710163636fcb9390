"""The wire format: msgpack message bodies carrying raw little-endian array buffers.

Every message is a msgpack map with the key ``"v"`` (the protocol version). An array
travels as ``{"dtype", "shape", "codec", "meta", "data"}`` where ``data`` is the codec's
output buffer. Packing hands msgpack a memoryview (no ``tobytes()`` copy); unpacking
wraps the received bytes with ``np.frombuffer`` (no copy either).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from services.common.errors import MalformedMessage, PersimmonError, ProtocolMismatch

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "array_from_wire",
    "array_to_wire",
    "decode_message",
    "encode_message",
    "raw_array",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
ALLOWED_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
     "int64", "uint64", "bool"}
)


def encode_message(body: dict[str, Any]) -> bytes:
    """Serialize ``body`` with the protocol version added."""
    return msgpack.packb({**body, "v": PROTOCOL_VERSION}, use_bin_type=True)


def decode_message(data: bytes) -> dict[str, Any]:
    """Parse a message; raise MalformedMessage or ProtocolMismatch for anything else."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedMessage(f"message is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(body, dict):
        raise MalformedMessage(f"message must be a map, got {type(body).__name__}")
    version = body.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    return body


def raw_array(arr: np.ndarray) -> dict[str, Any]:
    """An uncompressed array for the wire: a little-endian memoryview, no copy if contiguous."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return {
        "dtype": arr.dtype.name,
        "shape": list(arr.shape),
        "codec": "none",
        "meta": {},
        # cast needs a 1-D view when a dimension is 0, e.g. a (B, 0) dense matrix
        "data": memoryview(arr if arr.ndim == 1 or arr.size else arr.reshape(-1)).cast("B"),
    }


def array_to_wire(arr: np.ndarray, codec: Any = None) -> dict[str, Any]:
    """Encode ``arr`` with ``codec`` (a Codec instance; None means raw)."""
    if codec is None:
        return raw_array(arr)
    return codec.to_wire(arr)


def array_from_wire(body: Any, codecs: Any = None) -> np.ndarray:
    """Decode an array dict; validates dtype, shape and buffer length against each other.

    ``codecs`` is a callable name → Codec used for compressed arrays; raw arrays need none.
    """
    if not isinstance(body, dict):
        raise MalformedMessage("array must be a map with dtype, shape, codec, data")
    dtype, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
    codec_name = body.get("codec", "none")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise MalformedMessage(f"array dtype {dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
    if not isinstance(shape, list) or not all(
            type(s) is int and 0 <= s < 2**63 for s in shape):
        raise MalformedMessage(f"array shape {shape!r} must be a list of non-negative ints")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedMessage("array data must be a binary buffer")
    if not isinstance(codec_name, str):
        raise MalformedMessage(f"array codec {codec_name!r} must be a codec name")
    if codec_name == "none":
        count = math.prod(shape)  # Python ints: a huge declared shape cannot overflow
        itemsize = np.dtype(dtype).itemsize
        if count * itemsize != len(data):
            raise MalformedMessage(
                f"array of shape {shape} and dtype {dtype} needs {count * itemsize} bytes, "
                f"got {len(data)}"
            )
        return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    if codecs is None:
        from services.common.codecs import decoder

        codecs = decoder
    try:
        codec = codecs(codec_name)
    except Exception as exc:
        raise MalformedMessage(f"unknown codec {codec_name!r}") from exc
    try:
        return codec.from_wire(body)
    except PersimmonError:
        raise
    except Exception as exc:  # a codec's own parsing of a hostile body
        raise MalformedMessage(f"array with codec {codec_name!r} cannot be decoded "
                               f"({type(exc).__name__}: {exc})") from exc
