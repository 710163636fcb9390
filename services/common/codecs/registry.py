"""The codec registry: name → codec class, and the one way arrays are encoded and decoded.

:func:`encode_array` and :func:`decode_array` are the only path between a numpy array and its
:class:`WireArray` for every message: ``raw_array(x)`` is the ``none`` codec (a memoryview of
``x``, no copy), and a received array is decoded by the codec its header names (raw arrays
are a view over the received bytes, no copy).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np

from services.common.codecs.array import MAX_WRAPPERS, WireArray
from services.common.codecs.base import Codec
from services.common.codecs.floats import BF16Codec, FP16Codec, NoneCodec
from services.common.codecs.lossless import WRAPPERS, LosslessCodec
from services.common.codecs.masked import DCTMPCodec
from services.common.codecs.qsgd import AdaQuantCodec, QSGDCodec
from services.common.codecs.quant import Int8Codec, OneBitCodec, UniformCodec
from services.common.codecs.sparse import DCTCodec, TopKCodec
from services.common.errors import InvalidArgument, MalformedMessage, PersimmonError

__all__ = [
    "CODECS",
    "available_codecs",
    "decode_array",
    "decoder",
    "encode_array",
    "get_codec",
    "raw_array",
    "register_codec",
    "split_codec_name",
]

CODECS: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Add ``cls`` under ``cls.name``; usable as a class decorator."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    CODECS[cls.name] = cls
    return cls


for _cls in (NoneCodec, FP16Codec, BF16Codec, Int8Codec, UniformCodec, OneBitCodec, TopKCodec,
             DCTCodec, DCTMPCodec, QSGDCodec, AdaQuantCodec):
    register_codec(_cls)


def available_codecs() -> list[str]:
    return sorted(CODECS)


def _param_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def split_codec_name(spec: str) -> tuple[str, dict[str, Any]]:
    """``"dct:keep=0.005,refresh=100+zstd"`` → ``("dct+zstd", {"keep": 0.005, "refresh": 100})``.

    Parameters after ``:`` (comma-separated ``key=value``; ints, floats, true/false/none,
    else strings) let a flat config field carry them; they go to the first codec.
    """
    base, *wrappers = str(spec).split("+")
    name, _, args = base.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InvalidArgument(f"codec {spec!r}: parameters are key=value pairs after ':', "
                                  f"got {item!r}")
        params[key.strip()] = _param_value(value.strip())
    return "+".join([name, *wrappers]), params


def get_codec(name: str, **params: Any) -> Codec:
    """A new codec instance; unknown names or parameters are an InvalidArgument.

    ``"<codec>+<wrapper>[+<wrapper>…]"`` wraps the codec in lossless compressors
    (:data:`WRAPPERS`, at most :data:`MAX_WRAPPERS`); ``params``, and those spelled in the
    name (:func:`split_codec_name`), go to the first codec.
    """
    if ":" in str(name):
        name, spelled = split_codec_name(name)
        params = {**spelled, **params}
    base, *wrappers = str(name).split("+")
    cls = CODECS.get(base)
    if cls is None:
        hint = f" (a wrapper goes after a codec: 'none+{base}')" if base in WRAPPERS else ""
        raise InvalidArgument(f"unknown codec {name!r}{hint}; available: {available_codecs()}, "
                              f"optionally followed by +{'/+'.join(sorted(WRAPPERS))}")
    if len(wrappers) > MAX_WRAPPERS:
        raise InvalidArgument(f"codec {name!r} stacks {len(wrappers)} wrappers; at most "
                              f"{MAX_WRAPPERS}")
    unknown = [w for w in wrappers if w not in WRAPPERS]
    if unknown:
        raise InvalidArgument(f"unknown lossless wrapper {unknown[0]!r} in codec {name!r}; "
                              f"available: {sorted(WRAPPERS)}")
    try:
        codec = cls(**params)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad parameters for codec {name!r}: {exc}") from exc
    for wrapper in wrappers:
        codec = LosslessCodec(codec, wrapper)
    return codec


@cache
def decoder(name: str) -> Codec:
    """A shared instance used only to decode (decoding is stateless)."""
    return get_codec(name)


_RAW = NoneCodec()


def raw_array(x: np.ndarray) -> WireArray:
    """``x`` uncompressed (the ``none`` codec): a memoryview of its bytes, no copy if contiguous."""
    return _RAW.to_wire(x)


def encode_array(x: np.ndarray, codec: Codec | None = None, *, key: Any = None) -> WireArray:
    """``x`` encoded with ``codec`` (None: raw)."""
    return _RAW.to_wire(x) if codec is None else codec.to_wire(x, key=key)


def decode_array(arr: WireArray | Mapping[str, Any] | Any, where: str = "array"
                 ) -> np.ndarray:
    """The array of a received :class:`WireArray` (or its map, checked first), decoded by the
    codec its header names; unknown codecs and bad payloads are a MalformedMessage."""
    if not isinstance(arr, WireArray):
        arr = WireArray.from_wire(arr, where)
    try:
        codec = _RAW if arr.codec == "none" else decoder(arr.codec)
    except PersimmonError as exc:
        raise MalformedMessage(f"{where}: unknown codec {arr.codec!r}") from exc
    return codec.from_wire(arr)
