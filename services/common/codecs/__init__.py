"""One codec registry for every path: PS rows and gradients, activations, dense all-reduce.

``get_codec("fp16")`` returns a fresh instance (its own state and byte counters);
``decoder("fp16")`` returns a shared stateless instance for receivers. Codecs whose
optional backend is missing are left out of the registry. An array travels as a
:class:`WireArray`; :func:`encode_array`/:func:`raw_array` and :func:`decode_array` are the one
path to and from it.

Names: ``none``, ``fp16``, ``bf16``, ``int8``, ``uniform``, ``onebit``, ``topk``, ``dct``, ``dct_mp``,
``qsgd``, ``adaquant``; any of them followed by lossless wrappers, e.g. ``"fp16+zstd"`` or
``"dct+lz4"`` (parameters go to the first codec). :class:`StreamCodecs` holds one codec
per stream and counts bytes per stream and codec; :class:`RowEncoder` encodes rows pushed by
id with error feedback kept per id.
"""

from __future__ import annotations

from services.common.codecs import registry
from services.common.codecs.array import ALLOWED_DTYPES, MAX_ARRAY_ELEMENTS, WireArray
from services.common.codecs.base import Codec, CodecStats, ErrorFeedback
from services.common.codecs.lossless import WRAPPERS
from services.common.codecs.registry import *  # noqa: F403 - exported as registry.__all__
from services.common.codecs.rows import RowEncoder, RowResiduals, codec_without_feedback
from services.common.codecs.streams import CodecSpec, StreamCodecs, WireStats, WireStatsCollector

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_ARRAY_ELEMENTS",
    "WRAPPERS",
    "Codec",
    "CodecSpec",
    "CodecStats",
    "ErrorFeedback",
    "RowEncoder",
    "RowResiduals",
    "StreamCodecs",
    "WireArray",
    "WireStats",
    "WireStatsCollector",
    "codec_without_feedback",
    *registry.__all__,
]
