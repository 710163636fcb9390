"""One codec registry for every path: PS rows and gradients, activations, dense all-reduce.

``get_codec("fp16")`` returns a fresh instance (its own state and byte counters);
``decoder("fp16")`` returns a shared stateless instance for receivers. Codecs whose
optional backend is missing are left out of the registry.

Names: ``none``, ``fp16``, ``bf16``, ``int8``, ``uniform``, ``onebit``, ``topk``, ``dct``, ``qsgd``,
``adaquant``; any of them followed by lossless wrappers, e.g. ``"fp16+zstd"`` or
``"dct+lz4"`` (parameters go to the first codec). :class:`StreamCodecs` holds one codec
per stream and counts bytes per stream and codec; :class:`RowEncoder` encodes rows pushed by
id with error feedback kept per id.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from services.common.codecs.base import Codec, CodecStats, ErrorFeedback
from services.common.codecs.floats import BF16Codec, FP16Codec, NoneCodec
from services.common.codecs.lossless import WRAPPERS, LosslessCodec
from services.common.codecs.qsgd import AdaQuantCodec, QSGDCodec
from services.common.codecs.quant import Int8Codec, OneBitCodec, UniformCodec
from services.common.codecs.rows import RowEncoder, RowResiduals, codec_without_feedback
from services.common.codecs.sparse import DCTCodec, TopKCodec
from services.common.codecs.streams import CodecSpec, StreamCodecs, WireStats, WireStatsCollector
from services.common.errors import InvalidArgument

__all__ = [
    "CODECS",
    "WRAPPERS",
    "Codec",
    "CodecSpec",
    "CodecStats",
    "ErrorFeedback",
    "RowEncoder",
    "RowResiduals",
    "StreamCodecs",
    "WireStats",
    "WireStatsCollector",
    "available_codecs",
    "codec_without_feedback",
    "decoder",
    "get_codec",
    "register_codec",
    "split_codec_name",
]

CODECS: dict[str, type[Codec]] = {}
MAX_WRAPPERS = 2  # bounds the names decoder() can cache


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Add ``cls`` under ``cls.name``; usable as a class decorator."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    CODECS[cls.name] = cls
    return cls


for _cls in (NoneCodec, FP16Codec, BF16Codec, Int8Codec, UniformCodec, OneBitCodec, TopKCodec,
             DCTCodec, QSGDCodec, AdaQuantCodec):
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
