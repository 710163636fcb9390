"""Message framing: a msgpack map with the protocol version, within a size limit.

Every frame is a msgpack map carrying ``"v"`` (:data:`PROTOCOL_VERSION`) and, on the
multiplexed streams, ``"rid"`` (the request id a reply echoes). The rest of the map is a
message: a :class:`Message` (a msgspec Struct, :mod:`services.common.messages`) framed by
:func:`encode` and checked straight from the frame by :func:`decode` with a reused msgspec
decoder; or, for frames built by hand (probes, tests), a plain map through
:func:`encode_message`/:func:`decode_message`. This module knows nothing of arrays or codecs.

A received frame is bounded before anything is built from it: its size against
``max_bytes``; then, for frames past :data:`SCAN_FROM` bytes, a walk over its msgpack headers
(payloads of strings and binaries skipped, so O(objects), at most ``max_objects`` steps)
refuses a frame that declares more than ``max_objects`` objects (maps count their keys and
values). msgspec checks every declared length against the bytes left and a message's bounds
(in its annotations) as it decodes; a plain map gets msgpack's own limits (``max_bin_len``,
``max_str_len``, ``max_array_len``, ``max_map_len``, ``max_ext_len``) from the frame's size.
So the Python objects a frame becomes number at most ``max_objects`` (or ``SCAN_FROM``),
whatever it declares (``tests/unit/common/test_wire_limits.py``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar, get_args

import msgpack
import msgspec
from msgspec import Meta, Struct

from services.common.errors import InvalidArgument, MalformedMessage, ProtocolMismatch

__all__ = [
    "ENVELOPE_KEYS",
    "Items",
    "Message",
    "MAX_ITEMS",
    "MAX_MESSAGE_BYTES",
    "MAX_OBJECTS",
    "PROTOCOL_VERSION",
    "MAX_TEXT",
    "Record",
    "SCAN_FROM",
    "Text",
    "TextMap",
    "UInt",
    "check_frame",
    "count_objects",
    "decode",
    "decode_message",
    "encode",
    "encode_message",
    "explain",
    "frame_rid",
    "version_error",
]

#: 2: one typed message per method (PushThenLookup is its own method; Lookup/Push always
#: multi-table); 1: dict messages with several shapes per method.
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_OBJECTS = 1 << 20  # msgpack objects a frame may hold unless the receiver says fewer
SCAN_FROM = 4096  # frames of at most this many bytes hold few objects anyway: not walked
ENVELOPE_KEYS = frozenset({"v", "rid"})
MAX_ITEMS = 1 << 20  # the longest list or map a message may hold unless a field says less
MAX_TEXT = 4096  # the longest string a message may hold unless a field says less
#: the field types every message uses: a non-negative int64, a bounded string
UInt = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
M = TypeVar("M")
T = TypeVar("T")
#: a list, and a map with Text keys, of at most MAX_ITEMS entries (``TextMap[UInt]``); a
#: field bounded tighter spells its own bound
Items = Annotated[list[T], Meta(max_length=MAX_ITEMS)]
TextMap = Annotated[dict[Text, T], Meta(max_length=MAX_ITEMS)]
_S = TypeVar("_S", bound=Struct)

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


def check_frame(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES,
                max_objects: int = MAX_OBJECTS) -> None:
    """Bound a received frame before anything is built from it: its size against
    ``max_bytes``, and (past :data:`SCAN_FROM` bytes) the objects it declares against
    ``max_objects``; InvalidArgument otherwise."""
    if len(data) > max_bytes:
        raise InvalidArgument(f"message of {len(data)} bytes exceeds the limit of {max_bytes} "
                              "bytes (max_message_bytes)")
    if len(data) > SCAN_FROM:
        count_objects(data, max_objects)


def version_error(version: Any) -> ProtocolMismatch:
    """The error for a frame of another protocol version (``None``: it named none)."""
    said = "carries no protocol version" if version is None else \
        f"speaks protocol version {version!r}"
    return ProtocolMismatch(f"the peer {said}; this side speaks version {PROTOCOL_VERSION} "
                            "(run the same Persimmon release on both ends)")


def explain(exc: msgspec.ValidationError, where: str) -> str:
    """msgspec's validation error as our text: the path rooted at ``where`` (``$.ids.shape``
    becomes ``LookupRequest.ids.shape``), its two commonest cases in the words of the rest of
    the protocol."""
    text, _, at = str(exc).partition(" - at `")
    place = where + at.rstrip("`")[1:]
    if text.startswith("Object missing required field `"):
        return f"{place} needs the field '{text.split('`')[1]}'"
    if text.startswith("Object contains unknown field `"):
        return f"{place} has unknown fields ['{text.split('`')[1]}']"
    if text.startswith("Expected `object`"):
        return f"{place} must be a map, {text[len('Expected `object`, '):] or 'got another type'}"
    return f"{place}: {text}"


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
    check_frame(data, max_bytes=max_bytes, max_objects=max_objects)
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True,
                               **_limits(len(data), max_objects))
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedMessage(f"message is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(body, dict):
        raise MalformedMessage(f"message must be a map, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise version_error(version)
    return body


# ---- typed messages: msgspec Structs decoded straight from a frame ------------------------

class Record(Struct, forbid_unknown_fields=True):
    """Base of the records a message nests (a batch, a table's config, an error) and of
    :class:`Message`: an unknown field is refused, naming it. A subclass built by keyword
    only says ``kw_only=True`` (msgspec applies it to a class's own fields)."""


class Message(Record, kw_only=True, omit_defaults=True):
    """Base of every message. ``v`` and ``rid`` are the frame's envelope: :func:`encode` sets
    them, :func:`decode` checks ``v``; a reply echoes its request's ``rid``."""

    v: int | None = None
    rid: int | None = None
    #: fields of the protocol-1 shape of this message and where their content went
    moved: ClassVar[dict[str, str]] = {}

    def to_wire(self) -> dict[str, Any]:
        """The message as a plain map, without the envelope (buffers kept as they are;
        defaults left out)."""
        body: dict[str, Any] = msgspec.to_builtins(
            _canonical(self), builtin_types=_BUFFERS)
        body.pop("v", None)
        body.pop("rid", None)
        return body

    @classmethod
    def from_wire(cls: type[M], body: Any, where: str = "") -> M:
        """Check a plain map (e.g. a frame decoded by hand) and build the message."""
        name = where or cls.__name__
        try:
            return msgspec.convert(body, cls, builtin_types=_BUFFERS)
        except msgspec.ValidationError as exc:
            raise MalformedMessage(_explained(cls, exc, name)) from exc


_ENCODER = msgspec.msgpack.Encoder()
_BUFFERS = (bytes, bytearray, memoryview)  # kept as they are by to_wire/from_wire
_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


class _Version(Struct):
    """A frame's protocol version alone (every other field skipped)."""

    v: Any = None


_VERSION = msgspec.msgpack.Decoder(_Version)


def encode(message: Message, *, rid: int | None = None) -> bytes:
    """A framed message: the protocol version and, on a stream, the request id. Anything
    else with a ``to_wire()`` map (a body made by hand: probes, tests) is framed as it is."""
    if not isinstance(message, Struct):
        return encode_message(message.to_wire(), rid=rid)
    return _ENCODER.encode(_canonical(message, v=PROTOCOL_VERSION, rid=rid))


#: per message class, its fields whose default is a str, int, float or bytes
_SCALAR_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _scalar_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    found = _SCALAR_DEFAULTS.get(cls)
    if found is None:
        found = _SCALAR_DEFAULTS[cls] = tuple(
            (f.name, f.default) for f in msgspec.structs.fields(cls)
            if type(f.default) in (str, int, float, bytes))
    return found


def _canonical(message: _S, **envelope: Any) -> _S:
    """``message`` (with ``envelope`` set) where every field equal to its default holds the
    default itself, in nested messages too. msgspec's ``omit_defaults`` leaves a scalar out
    only when it *is* the default object, so an equal value made elsewhere (unpickled in the
    PS client process, parsed from a flag) would travel: the same message would take more
    bytes one way than another."""
    changes = envelope
    for name, default in _scalar_defaults(type(message)):
        value = getattr(message, name)
        if value is not default and type(value) is type(default) and value == default:
            changes[name] = default
    for name in message.__struct_fields__:
        value = getattr(message, name)
        if isinstance(value, Message):
            inner = _canonical(value)
            if inner is not value:
                changes[name] = inner
    return msgspec.structs.replace(message, **changes) if changes else message


def decode(cls: type[M] | Any, raw: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES,
           max_objects: int = MAX_OBJECTS) -> M:
    """Check one frame straight into ``cls`` (a message, or a union of tagged messages).
    Over ``max_bytes`` or declaring more than ``max_objects`` objects: InvalidArgument;
    another protocol version: ProtocolMismatch; anything else wrong: MalformedMessage."""
    check_frame(raw, max_bytes=max_bytes, max_objects=max_objects)
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    try:
        message = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        _check_version(raw)
        raise MalformedMessage(_explained(cls, exc, _name(cls))) from exc
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"message is not valid msgpack ({exc})") from exc
    except MalformedMessage:
        _check_version(raw)
        raise
    if message.v != PROTOCOL_VERSION:
        raise version_error(message.v)
    return message  # type: ignore[no-any-return]


class _Rid(Struct):
    """A frame's request id alone (every other field skipped)."""

    rid: Any = None


_RID = msgspec.msgpack.Decoder(_Rid)


def frame_rid(raw: bytes) -> int | None:
    """The ``rid`` of a frame (None when it names none); MalformedMessage when ``raw`` is
    not a msgpack map."""
    try:
        rid = _RID.decode(raw).rid
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"message is not a msgpack map ({exc})") from exc
    return rid if type(rid) is int else None


def _check_version(raw: bytes) -> None:
    try:
        version = _VERSION.decode(raw).v
    except msgspec.DecodeError:
        return
    if version != PROTOCOL_VERSION:
        raise version_error(version)


def _name(cls: Any) -> str:
    """A message class's name; a union's, its members' names joined by ``|``."""
    return getattr(cls, "__name__", None) or " | ".join(a.__name__ for a in get_args(cls))


def _explained(cls: Any, exc: msgspec.ValidationError, name: str) -> str:
    """The error text, with the message's fields and a hint where a protocol-1 field went."""
    text = explain(exc, name)
    if text.startswith(f"{name} has unknown fields") and isinstance(cls, type):
        fields = sorted(f for f in getattr(cls, "__struct_fields__", ())
                        if f not in ("v", "rid"))
        unknown = text.split("'")[1]
        hint = getattr(cls, "moved", {}).get(unknown)
        text += f"; its fields are {fields}" + (f" ({hint})" if hint else "")
    return text
