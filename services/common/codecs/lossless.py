"""Lossless wrappers: ``<codec>+zstd`` and ``<codec>+lz4`` compress another codec's output.

The wrapped codec keeps its own meta under ``"m"``; ``"n"`` is the length of its payload
before compression. Decoding refuses a declared length larger than twice the raw array
plus 1 KiB (no codec here produces more), so a hostile payload cannot make the receiver
allocate without bound. A backend whose package is missing is left out of :data:`WRAPPERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from services.common.codecs.base import Codec
from services.common.codecs.bits import meta_int, nbytes_of, numel
from services.common.errors import MalformedMessage

__all__ = ["WRAPPERS", "LosslessCodec"]

Compress = Callable[[Any], bytes]
Decompress = Callable[[Any, int], bytes]

#: backend name → factory of (compress, decompress) for one codec instance.
WRAPPERS: dict[str, Callable[[], tuple[Compress, Decompress]]] = {}

try:
    import zstandard

    def _zstd_decompress(data: Any, size: int) -> bytes:
        # Our frames declare their size; libzstd enforces it, which bounds the output.
        declared = zstandard.frame_content_size(data)
        if declared != size:
            raise MalformedMessage(f"zstd frame declares {declared} bytes, meta says {size}")
        # A decompressor per call: instances are not safe to share between threads.
        dobj = zstandard.ZstdDecompressor().decompressobj()
        out = dobj.decompress(data)
        if not dobj.eof or dobj.unused_data:
            raise MalformedMessage("zstd payload is truncated or has trailing bytes")
        return out

    def _zstd() -> tuple[Compress, Decompress]:
        return zstandard.ZstdCompressor(level=3).compress, _zstd_decompress

    WRAPPERS["zstd"] = _zstd
except ImportError:  # pragma: no cover - optional backend
    pass

try:
    import lz4.block

    def _lz4_compress(data: Any) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def _lz4_decompress(data: Any, size: int) -> bytes:
        return lz4.block.decompress(data, uncompressed_size=size)

    WRAPPERS["lz4"] = lambda: (_lz4_compress, _lz4_decompress)
except ImportError:  # pragma: no cover - optional backend
    pass


class LosslessCodec(Codec):
    """``inner`` followed by a lossless byte compressor; named ``"<inner>+<backend>"``."""

    def __init__(self, inner: Codec, backend: str) -> None:
        super().__init__()
        if backend not in WRAPPERS:
            raise ValueError(f"unknown lossless wrapper {backend!r}; available: {sorted(WRAPPERS)}")
        self.inner = inner
        self.backend = backend
        self._compress, self._decompress = WRAPPERS[backend]()
        # Instance-level name: the registry key of a composed codec is its full spelling.
        setattr(self, "name", f"{inner.name}+{backend}")  # noqa: B010
        setattr(self, "lossless", inner.lossless)  # noqa: B010
        setattr(self, "stateful", inner.stateful)  # noqa: B010

    def encode(self, x: np.ndarray, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
        data, meta = self.inner.encode(x, key=key)
        return self._compress(data), {"n": nbytes_of(data), "m": meta}

    def decode(self, data, meta, dtype, shape):
        limit = 2 * numel(shape) * dtype.itemsize + 1024
        size = meta_int(meta, "n", 0, limit, self.name)
        inner_meta = meta.get("m")
        if not isinstance(inner_meta, dict):
            raise MalformedMessage(f"{self.name} meta 'm' must be a map")
        try:
            raw = self._decompress(data, size)
        except MalformedMessage:
            raise
        except Exception as exc:  # each backend raises its own error type
            raise MalformedMessage(f"{self.name}: corrupt {self.backend} payload: {exc}") from exc
        if len(raw) != size:
            raise MalformedMessage(f"{self.name}: payload decompressed to {len(raw)} bytes, "
                                   f"expected {size}")
        return self.inner.decode(raw, inner_meta, dtype, shape)

    def __getattr__(self, item: str) -> Any:
        """Codec-specific extras (``report_loss``, ``density``, ``residual``) reach the inner codec."""
        if item.startswith("_") or item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)
