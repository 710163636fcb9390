"""One codec registry for every path: PS rows and gradients, activations, dense all-reduce.

``get_codec("fp16")`` returns a fresh instance (its own state and byte counters);
``decoder("fp16")`` returns a shared stateless instance for receivers. Codecs whose
optional backend is missing are left out of the registry.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from services.common.codecs.base import Codec, CodecStats, ErrorFeedback
from services.common.codecs.floats import BF16Codec, FP16Codec, NoneCodec
from services.common.errors import InvalidArgument

__all__ = [
    "CODECS",
    "Codec",
    "CodecStats",
    "ErrorFeedback",
    "available_codecs",
    "decoder",
    "get_codec",
    "register_codec",
]

CODECS: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Add ``cls`` under ``cls.name``; usable as a class decorator."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    CODECS[cls.name] = cls
    return cls


for _cls in (NoneCodec, FP16Codec, BF16Codec):
    register_codec(_cls)


def available_codecs() -> list[str]:
    return sorted(CODECS)


def get_codec(name: str, **params: Any) -> Codec:
    """A new codec instance; unknown names or parameters are an InvalidArgument."""
    cls = CODECS.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown codec {name!r}; available: {available_codecs()}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise InvalidArgument(f"bad parameters for codec {name!r}: {exc}") from exc


@cache
def decoder(name: str) -> Codec:
    """A shared instance used only to decode (decoding is stateless)."""
    return get_codec(name)
