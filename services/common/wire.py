"""Message framing: a msgpack map with the protocol version, within a size limit.

Every frame is a msgpack map carrying ``"v"`` (:data:`PROTOCOL_VERSION`) and, on the
multiplexed streams, ``"rid"`` (the request id a reply echoes). The rest of the map is a
message of :mod:`services.common.messages`; arrays inside it are
:class:`~services.common.codecs.WireArray` values, packed through their ``to_wire()``
(the buffer is handed to msgpack as a memoryview, never copied by us). This module knows
nothing of arrays or codecs.
"""

from __future__ import annotations

from typing import Any

import msgpack

from services.common.errors import InvalidArgument, MalformedMessage, ProtocolMismatch

__all__ = [
    "ENVELOPE_KEYS",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "decode_message",
    "encode_message",
]

#: 2: one typed message per method (PushThenLookup is its own method; Lookup/Push always
#: multi-table); 1: dict messages with several shapes per method.
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
ENVELOPE_KEYS = frozenset({"v", "rid"})


def _packable(obj: Any) -> Any:
    """msgpack's hook for values it does not know: typed messages and arrays pack as maps."""
    to_wire = getattr(obj, "to_wire", None)
    if to_wire is None:
        raise TypeError(f"cannot put a {type(obj).__name__} on the wire")
    return to_wire()


def encode_message(body: dict[str, Any], *, rid: int | None = None) -> bytes:
    """Frame ``body`` (a map; values with ``to_wire()`` are packed as their map) with the
    protocol version and, when given, the request id."""
    frame = {**body, "v": PROTOCOL_VERSION}
    if rid is not None:
        frame["rid"] = rid
    return msgpack.packb(frame, use_bin_type=True, default=_packable)


def decode_message(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """The map of a frame, ``"v"`` removed (``"rid"`` kept). An over-limit frame is an
    InvalidArgument, an undecodable one a MalformedMessage, another protocol version (or
    none) a ProtocolMismatch."""
    if len(data) > max_bytes:
        raise InvalidArgument(f"message of {len(data)} bytes exceeds the limit of {max_bytes} "
                              "bytes (max_message_bytes)")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedMessage(f"message is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(body, dict):
        raise MalformedMessage(f"message must be a map, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        said = "carries no protocol version" if version is None else \
            f"speaks protocol version {version!r}"
        raise ProtocolMismatch(f"the peer {said}; this side speaks version {PROTOCOL_VERSION} "
                               "(run the same Persimmon release on both ends)")
    return body
