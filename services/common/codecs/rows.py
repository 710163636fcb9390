"""Rows pushed by id (embedding gradients up to the PS), with error feedback kept per id.

A push carries the gradients of a different set of ids every step, so the residual of an
error-feedback codec (``dct``, ``topk``, ``onebit``) cannot be one array per stream: the
residual of id ``i`` must come back the next time ``i`` is pushed. :class:`RowEncoder` keeps
one residual row per id (:class:`RowResiduals`) and drives its codec with the codec's own
error feedback off::

    a = grads + residual[ids];  body = codec(a);  residual[ids] = a − decode(body)

so, per id, Σ sent = Σ pushed − residual (tested). Codecs without error feedback (``fp16``,
``qsgd``, …) are used as they are. Memory: one float32 row per id ever pushed with a
non-zero residual, the size of the worker's share of the table; :meth:`RowEncoder.reset`
frees it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.codecs.array import WireArray
from services.common.codecs.base import Codec
from services.common.codecs.bits import all_finite
from services.common.codecs.registry import get_codec
from services.common.errors import InvalidArgument

__all__ = ["RowEncoder", "RowResiduals", "codec_without_feedback"]


def codec_without_feedback(name: str, **params: Any) -> tuple[Codec, bool]:
    """Codec ``name`` with its error feedback off, and whether it had any.

    For streams whose arrays never repeat (rows of changing ids, per-sample pooled
    gradients): a residual kept per stream would be added to the wrong entries.
    """
    codec = get_codec(name, **params)
    if not getattr(codec, "error_feedback", False):
        return codec, False
    return get_codec(name, **{**params, "error_feedback": False}), True


class RowResiduals:
    """id → residual row (float32, one width), in a growing arena indexed by a dict."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self._rows = np.zeros((0, 0), dtype=np.float32)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        return int(self._rows.nbytes)

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        get = self._slot.get
        return np.fromiter((get(i, -1) for i in ids.tolist()), dtype=np.int64, count=ids.size)

    def take(self, ids: np.ndarray, dim: int) -> np.ndarray:
        """The residual rows of ``ids`` (zeros for ids without one), ``(len(ids), dim)``."""
        out = np.zeros((ids.size, dim), dtype=np.float32)
        if self._slot:
            self._check_dim(dim)
            slots = self._slots(ids)
            found = slots >= 0
            out[found] = self._rows[slots[found]]
        return out

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Set the residual rows of the (unique) ``ids``."""
        dim = rows.shape[1]
        if not self._slot:
            self._rows = np.zeros((max(16, ids.size), dim), dtype=np.float32)
        self._check_dim(dim)
        slots = self._slots(ids)
        new = np.flatnonzero(slots < 0)
        if new.size:
            start = len(self._slot)
            if start + new.size > self._rows.shape[0]:
                grown = np.zeros((max(2 * self._rows.shape[0], start + new.size), dim),
                                 dtype=np.float32)
                grown[:start] = self._rows[:start]
                self._rows = grown
            slots[new] = np.arange(start, start + new.size)
            self._slot.update(zip(ids[new].tolist(), slots[new].tolist(), strict=True))
        self._rows[slots] = rows

    def _check_dim(self, dim: int) -> None:
        if self._rows.shape[1] != dim:
            raise InvalidArgument(f"rows of width {dim} pushed where residuals have width "
                                  f"{self._rows.shape[1]}: one RowEncoder per table")

    def reset(self) -> None:
        self._slot.clear()
        self._rows = np.zeros((0, 0), dtype=np.float32)


class RowEncoder:
    """Encodes the rows of unique ids with ``name``; error feedback per id when the codec has it.

    ``key`` selects the codec's other per-key state (DCT's cached threshold): use the table.
    """

    def __init__(self, name: str, **params: Any) -> None:
        codec, had_feedback = codec_without_feedback(name, **params)
        self.feedback = RowResiduals() if had_feedback else None
        self.codec: Codec = codec

    @property
    def name(self) -> str:
        return self.codec.name

    def to_wire(self, ids: np.ndarray, rows: np.ndarray, *, key: Any = None) -> WireArray:
        """The wire array of ``rows`` (``(len(ids), dim)``), residuals of ``ids`` added first."""
        if self.feedback is None:
            return self.codec.to_wire(rows, key=key)
        rows = np.asarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] != ids.size:
            raise InvalidArgument(f"rows must be (len(ids), dim) = ({ids.size}, dim), "
                                  f"got {rows.shape}")
        corrected = rows + self.feedback.take(ids, rows.shape[1])
        body = self.codec.to_wire(corrected, key=key)
        if all_finite(corrected):  # a NaN push is dropped by the PS: keep the old residuals
            self.feedback.put(ids, corrected - self.codec.from_wire(body))
        return body

    def residual(self, ids: np.ndarray, dim: int) -> np.ndarray:
        """What error feedback still owes for ``ids`` (zeros without feedback)."""
        if self.feedback is None:
            return np.zeros((np.size(ids), dim), dtype=np.float32)
        return self.feedback.take(np.asarray(ids), dim)

    def reset(self) -> None:
        """Forget every residual and threshold (e.g. after a PS checkpoint restore)."""
        if self.feedback is not None:
            self.feedback.reset()
        reset = getattr(self.codec, "reset", None)
        if callable(reset):
            reset()
