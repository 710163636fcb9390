"""``dct_mp``: DCT-MP on a model-parallel wire (Gupta et al. 2020), activations and their
gradients at the same positions.

The sender of activations (a PS shard's per-sample partial sums on the DES path) keeps the
entries with ``|x| ≥ τ``, where τ is the ``(1 − keep)`` quantile of ``|x|``, computed per key
(one per table) and reused for ``refresh`` calls as in the paper (the quantile is the
expensive part; default 32), recomputed sooner only when a call's kept share leaves
``[keep/drift, keep·drift]`` (DCT's drift guard). No error feedback: a sample's activation is
never sent again.

Wire, ``mode: masked``: a bitmap of the kept positions (``ceil(n/8)`` bytes, numpy's
``packbits`` order over the flattened array), then the kept values in that order as fp16
(fp32 when one is out of fp16 range). ``mode: dense``: every entry kept, float32 unchanged
(``keep=1``). :func:`kept_mask` reads the positions back from a received array and
:func:`encode_at` sends the gradient at exactly those positions (bitmap + values): the
receiver of the gradient needs no state of its own, and the gradient of a dropped activation,
which did not reach the model, is never sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.codecs.array import WireArray
from services.common.codecs.bits import (
    NONFINITE,
    all_finite,
    byte_view,
    expect_nbytes,
    float_input,
    meta_choice,
    meta_int,
    numel,
)
from services.common.codecs.sparse import FP16_MAX, DCTCodec
from services.common.errors import InvalidArgument, MalformedMessage

__all__ = ["REFRESH", "DCTMPCodec", "PooledMasks", "encode_at", "kept_mask"]

_VALUES: dict[str, np.dtype[Any]] = {"fp16": np.dtype("<f2"), "fp32": np.dtype("<f4")}
REFRESH = 32  # calls a threshold is reused (reconstructed: the paper gives no MP figure)
# DES: per shard holding any of a feature's ids, the positions its partial sums kept (None:
# that shard's reply was not dct_mp); what a pooled push needs to send the gradient back
PooledMasks = tuple[np.ndarray | None, ...]


class DCTMPCodec(DCTCodec):
    """Threshold τ per key reused for ``refresh`` calls; kept positions as a bitmap."""

    name = "dct_mp"

    def __init__(self, *, keep: float = 0.25, refresh: int = REFRESH,
                 threshold: float | None = None, drift: float | None = 2.0,
                 values: str = "fp16") -> None:
        super().__init__(keep=keep, refresh=refresh, threshold=threshold, drift=drift,
                         values=values, error_feedback=False)

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        n = flat.size
        idx = self._select(flat, np.abs(flat), key)
        self._last_density[key] = idx.size / n if n else 1.0
        self.kept_total += idx.size
        self.seen_total += n
        if idx.size == n:
            return byte_view(flat), {"mode": "dense"}
        mask = np.zeros(n, dtype=bool)
        mask[idx] = True
        return _pack(flat, mask, self.values)

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        n = numel(shape)
        if meta_choice(meta, "mode", ("masked", "dense"), self.name) == "dense":
            expect_nbytes(data, 4 * n, f"{self.name} dense array of {n} elements")
            return np.frombuffer(data, dtype="<f4", count=n).astype(dtype).reshape(shape)
        mask, vals = _unpack(data, meta, n, self.name)
        out = np.zeros(n, dtype=dtype)
        out[mask] = vals
        return out.reshape(shape)


def _pack(flat: np.ndarray, mask: np.ndarray, values: str) -> tuple[Any, dict[str, Any]]:
    vals = flat[mask]
    if values == "fp16" and vals.size and float(np.abs(vals).max()) > FP16_MAX:
        values = "fp32"
    bits = np.packbits(mask)
    out = np.empty(bits.size + vals.size * _VALUES[values].itemsize, dtype=np.uint8)
    out[:bits.size] = bits
    out[bits.size:] = vals.astype(_VALUES[values]).view(np.uint8)
    return out.data, {"mode": "masked", "k": int(vals.size), "v": values}


def _unpack(data: Any, meta: dict[str, Any], n: int, name: str
            ) -> tuple[np.ndarray, np.ndarray]:
    """(kept positions as a bool mask of ``n``, their values) of a ``masked`` payload."""
    k = meta_int(meta, "k", 0, n, name)
    vtype = _VALUES[meta_choice(meta, "v", tuple(_VALUES), name)]
    nbits = (n + 7) // 8
    expect_nbytes(data, nbits + k * vtype.itemsize, f"{name} bitmap of {n} and {k} values")
    mask = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=nbits), count=n).view(bool)
    if int(np.count_nonzero(mask)) != k:
        raise MalformedMessage(f"{name} bitmap marks {int(np.count_nonzero(mask))} positions "
                               f"but {k} values came")
    return mask, np.frombuffer(data, dtype=vtype, offset=nbits, count=k)


def kept_mask(arr: WireArray) -> np.ndarray:
    """The positions a received ``dct_mp`` array kept, a bool array of its shape (all of them
    for a ``dense`` one)."""
    if arr.codec != DCTMPCodec.name:
        raise InvalidArgument(f"kept_mask reads dct_mp arrays, got codec {arr.codec!r}")
    n = numel(arr.shape)
    if meta_choice(arr.meta, "mode", ("masked", "dense"), arr.codec) == "dense":
        return np.ones(arr.shape, dtype=bool)
    return _unpack(arr.data, arr.meta, n, arr.codec)[0].reshape(arr.shape)


def encode_at(x: np.ndarray, mask: np.ndarray) -> WireArray:
    """``x`` (float32) sent at the positions ``mask`` keeps only, as a ``dct_mp`` array: the
    gradient of activations that came with that mask. A non-finite ``x`` travels as such
    (the receiver drops it)."""
    flat = float_input(np.asarray(x, dtype=np.float32), DCTMPCodec.name)
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.shape != np.shape(x):
        raise InvalidArgument(f"mask must be a bool array of shape {np.shape(x)}, "
                              f"got {mask.dtype} {mask.shape}")
    shape = tuple(np.shape(x))
    if not all_finite(flat):
        data: Any = b""
        meta: dict[str, Any] = {NONFINITE: 1}
    elif mask.all():
        data, meta = byte_view(flat), {"mode": "dense"}
    else:
        data, meta = _pack(flat, mask.reshape(-1), "fp16")
    return WireArray(dtype="float32", shape=shape, codec=DCTMPCodec.name, meta=meta, data=data)
