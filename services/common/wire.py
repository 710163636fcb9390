"""Message framing: a msgpack map with the protocol version, within a size limit.

Every frame is a msgpack map carrying ``"v"`` (:data:`PROTOCOL_VERSION`) and, on the
multiplexed streams, ``"rid"`` (the request id a reply echoes). The rest of the map is a
message of :mod:`services.common.messages`; arrays inside it are
:class:`~services.common.codecs.WireArray` values, packed through their ``to_wire()``
(the buffer is handed to msgpack as a memoryview, never copied by us). This module knows
nothing of arrays or codecs.

A received frame is bounded before msgpack builds anything from it: its size against
``max_bytes``; then, for frames past :data:`SCAN_FROM` bytes, a walk over its msgpack headers
(payloads of strings and binaries skipped, so O(objects), at most ``max_objects`` steps)
refuses a frame that declares more than ``max_objects`` objects (maps count their keys and
values); msgpack's own limits (``max_bin_len``, ``max_str_len``, ``max_array_len``,
``max_map_len``, ``max_ext_len``) come from the frame's size. So the Python objects a frame
becomes number at most ``max_objects`` (or ``SCAN_FROM``), whatever it declares
(``tests/unit/common/test_wire_limits.py``).
"""

from __future__ import annotations

from typing import Any

import msgpack

from services.common.errors import InvalidArgument, MalformedMessage, ProtocolMismatch

__all__ = [
    "ENVELOPE_KEYS",
    "MAX_MESSAGE_BYTES",
    "MAX_OBJECTS",
    "PROTOCOL_VERSION",
    "SCAN_FROM",
    "count_objects",
    "decode_message",
    "encode_message",
]

#: 2: one typed message per method (PushThenLookup is its own method; Lookup/Push always
#: multi-table); 1: dict messages with several shapes per method.
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_OBJECTS = 1 << 20  # msgpack objects a frame may hold unless the receiver says fewer
SCAN_FROM = 4096  # frames of at most this many bytes hold few objects anyway: not walked
ENVELOPE_KEYS = frozenset({"v", "rid"})

# What follows each msgpack type byte from 0xc0 on: ("fixed", bytes to skip),
# ("blob", width of the length, extra bytes: ext's type byte), ("array"/"map", width of the
# count), or ("bad", 0).
_HEADS: list[tuple[str, int, int]] = [
    ("fixed", 0, 0), ("bad", 0, 0), ("fixed", 0, 0), ("fixed", 0, 0),  # nil, -, false, true
    ("blob", 1, 0), ("blob", 2, 0), ("blob", 4, 0),  # bin 8/16/32
    ("blob", 1, 1), ("blob", 2, 1), ("blob", 4, 1),  # ext 8/16/32
    ("fixed", 4, 0), ("fixed", 8, 0),  # float 32/64
    ("fixed", 1, 0), ("fixed", 2, 0), ("fixed", 4, 0), ("fixed", 8, 0),  # uint 8..64
    ("fixed", 1, 0), ("fixed", 2, 0), ("fixed", 4, 0), ("fixed", 8, 0),  # int 8..64
    ("fixed", 2, 0), ("fixed", 3, 0), ("fixed", 5, 0), ("fixed", 9, 0), ("fixed", 17, 0),
    ("blob", 1, 0), ("blob", 2, 0), ("blob", 4, 0),  # str 8/16/32
    ("array", 2, 0), ("array", 4, 0), ("map", 2, 0), ("map", 4, 0),
]


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


def count_objects(data: bytes | memoryview, max_objects: int) -> int:
    """How many msgpack objects the frame ``data`` declares (a map's keys and values each
    count), found by walking its headers only; InvalidArgument as soon as the declared
    count passes ``max_objects``, so the walk takes at most that many steps. A truncated or
    invalid frame is left to msgpack to refuse (the count so far is returned)."""
    view = memoryview(data).cast("B")
    size, pos, todo, seen = len(view), 0, 1, 0
    while todo and pos < size:
        b = view[pos]
        pos += 1
        todo -= 1
        seen += 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            continue
        if b <= 0x9F:  # fixmap, fixarray
            todo += (b & 0x0F) * (2 if b <= 0x8F else 1)
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
            continue
        else:
            kind, width, extra = _HEADS[b - 0xC0]
            if kind == "fixed":
                pos += width
                continue
            if kind == "bad" or pos + width > size:
                return seen
            length = int.from_bytes(view[pos:pos + width], "big")
            pos += width
            if kind == "blob":
                pos += extra + length
                continue
            todo += length * (2 if kind == "map" else 1)
        if seen + todo > max_objects:
            raise InvalidArgument(f"message declares more than {max_objects} msgpack objects "
                                  "(arrays and maps too long or too many)")
    return seen


def _limits(size: int, max_objects: int) -> dict[str, int]:
    """msgpack's per-object limits for a frame of ``size`` bytes."""
    return {"max_bin_len": size, "max_str_len": size, "max_ext_len": size,
            "max_array_len": min(size, max_objects), "max_map_len": min(size // 2, max_objects)}


def decode_message(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES,
                   max_objects: int = MAX_OBJECTS) -> dict[str, Any]:
    """The map of a frame, ``"v"`` removed (``"rid"`` kept). A frame over ``max_bytes`` or
    declaring more than ``max_objects`` msgpack objects is an InvalidArgument, refused
    before msgpack builds it; an undecodable one a MalformedMessage, another protocol
    version (or none) a ProtocolMismatch."""
    if len(data) > max_bytes:
        raise InvalidArgument(f"message of {len(data)} bytes exceeds the limit of {max_bytes} "
                              "bytes (max_message_bytes)")
    if len(data) > SCAN_FROM:
        count_objects(data, max_objects)
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True,
                               **_limits(len(data), max_objects))
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
