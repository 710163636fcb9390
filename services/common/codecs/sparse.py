"""Sparsifiers with error feedback: ``topk`` (exact top-k) and ``dct`` (cached hard threshold).

Both send the kept entries of ``a = x + residual`` as (index, value) pairs and keep
``a − sent`` as the residual for the next call with the same ``key``, so
``Σ sent = Σ input − residual``. They differ in how the kept set is chosen:

- ``topk``: the ``ceil(keep · n)`` largest magnitudes, found anew on every call
  (an ``argpartition`` each time: exact density, O(n) selection per call).
- ``dct`` (Dynamic Communication Thresholding, Gupta et al. 2020): a threshold τ, recomputed
  as the K-th largest magnitude only every ``refresh`` calls per key (default 1000); in
  between, the mask is a cheap ``|a| ≥ τ``. ``drift`` (default 2) also recomputes τ at once
  when a call's kept density leaves ``[target/drift, target·drift]`` (error feedback makes
  the residual grow between refreshes, which the paper's fixed τ does not follow);
  ``drift=None`` is the paper's schedule alone. ``threshold=τ`` fixes τ (no refresh).

Wire, ``mode: sparse``: ``k`` int32 indices (strictly increasing), then ``k`` values as fp16
(``values="fp16"``, 48 bits per kept entry; fp32 when a kept value is out of fp16 range)
or fp32. When index+value pairs would not be smaller than the dense array, or every entry
is kept, the payload is ``mode: dense``: the masked ``a`` as float32. So ``keep=1.0`` and
``threshold=0`` send the input unchanged, bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.codecs.base import ErrorFeedback, FloatCodec
from services.common.codecs.bits import expect_nbytes, meta_choice, meta_int, numel
from services.common.errors import ConfigError, MalformedMessage

__all__ = ["DCTCodec", "TopKCodec"]

log = logging.getLogger(__name__)

MAX_INDEX = np.iinfo(np.int32).max
FP16_MAX = float(np.finfo(np.float16).max)
_VALUE_TYPES: dict[str, np.dtype[Any]] = {"fp16": np.dtype("<f2"), "fp32": np.dtype("<f4")}


def kept_count(keep: float, n: int) -> int:
    """K = ceil(keep · n), at least 1 for a non-empty array."""
    return min(n, max(1, int(np.ceil(keep * n)))) if n else 0


@dataclass(slots=True)
class _Threshold:
    tau: float | None = None
    since: int = 0
    kept: int = 0
    seen: int = 0


class _SparseCodec(FloatCodec):
    """Shared encode/decode of the index+value codecs; subclasses choose the kept indices."""

    stateful = True
    max_elements = MAX_INDEX

    def __init__(self, *, keep: float = 0.01, values: str = "fp16",
                 error_feedback: bool = True) -> None:
        super().__init__()
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise ConfigError(f"{self.name} keep must be a fraction in (0, 1], got {keep!r}")
        if values not in _VALUE_TYPES:
            raise ConfigError(f"{self.name} values must be one of {sorted(_VALUE_TYPES)}, "
                              f"got {values!r}")
        self.keep = float(keep)
        self.values = values
        self.error_feedback = bool(error_feedback)
        self.feedback = ErrorFeedback()
        self._clean: set[Any] = set()  # keys whose residual is exactly zero
        self._last_density: dict[Any, float] = {}
        self.kept_total = 0
        self.seen_total = 0

    def _select(self, a: np.ndarray, absa: np.ndarray, key: Any) -> np.ndarray:
        raise NotImplementedError

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        n = flat.size
        if self.error_feedback and key not in self._clean:
            a = self.feedback.add(key, flat)
        else:
            a = flat
        absa = np.abs(a)
        idx = self._select(a, absa, key)
        k = int(idx.size)
        self._last_density[key] = k / n if n else 1.0
        self.kept_total += k
        self.seen_total += n
        vals = a[idx]
        vname = self.values
        if vname == "fp16" and k and float(absa[idx].max()) > FP16_MAX:
            vname = "fp32"
        vtype = _VALUE_TYPES[vname]
        if k == n or k * (4 + vtype.itemsize) >= 4 * n:
            sent = a if k == n else _scatter(n, idx, vals)
            payload = np.ascontiguousarray(sent, dtype="<f4").data.cast("B")
            meta: dict[str, Any] = {"mode": "dense"}
        else:
            v = vals.astype(vtype)
            out = np.empty(k * (4 + vtype.itemsize), dtype=np.uint8)
            out[: 4 * k] = idx.astype("<i4").view(np.uint8)
            out[4 * k:] = v.view(np.uint8)
            payload = out.data
            meta = {"mode": "sparse", "k": k, "v": vname}
            if self.error_feedback:
                sent = _scatter(n, idx, v.astype(np.float32))
        if self.error_feedback:
            if k == n:
                self._clean.add(key)
                self.feedback.keep(key, a, a)
            else:
                self._clean.discard(key)
                self.feedback.keep(key, a, sent)
        return payload, meta

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        n = numel(shape)
        mode = meta_choice(meta, "mode", ("sparse", "dense"), self.name)
        if mode == "dense":
            expect_nbytes(data, 4 * n, f"{self.name} dense array of {n} elements")
            return np.frombuffer(data, dtype="<f4", count=n).astype(dtype).reshape(shape)
        k = meta_int(meta, "k", 0, n, self.name)
        vtype = _VALUE_TYPES[meta_choice(meta, "v", tuple(_VALUE_TYPES), self.name)]
        expect_nbytes(data, k * (4 + vtype.itemsize), f"{self.name} payload of {k} pairs")
        idx = np.frombuffer(data, dtype="<i4", count=k)
        if k and (idx[0] < 0 or idx[-1] >= n or (k > 1 and np.any(np.diff(idx) <= 0))):
            raise MalformedMessage(f"{self.name} indices must be increasing and in [0, {n})")
        vals = np.frombuffer(data, dtype=vtype, offset=4 * k, count=k)
        out = np.zeros(n, dtype=dtype)
        out[idx] = vals
        return out.reshape(shape)

    def density(self, key: Any = None) -> float:
        """Kept fraction of the last call for ``key`` (0 before any)."""
        return self._last_density.get(key, 0.0)

    @property
    def kept_density(self) -> float:
        """Kept fraction over every call so far."""
        return self.kept_total / self.seen_total if self.seen_total else 0.0

    def residual(self, key: Any = None) -> np.ndarray | None:
        return self.feedback.residual(key)

    def reset(self) -> None:
        """Forget residuals and thresholds (e.g. after a checkpoint restore)."""
        self.feedback.reset()
        self._clean.clear()

    def info(self) -> dict[str, float]:
        """Loggable numbers: overall kept density and the target."""
        return {"kept_density": self.kept_density, "target_density": self.keep}


def _scatter(n: int, idx: np.ndarray, vals: np.ndarray) -> np.ndarray:
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


def _kth_largest(absa: np.ndarray, k: int) -> float:
    n = absa.size
    return float(np.partition(absa, n - k)[n - k])


def _mask_at(absa: np.ndarray, tau: float) -> np.ndarray:
    """Indices with ``|a| ≥ τ``; a computed τ of 0 keeps only the non-zeros."""
    return np.flatnonzero(absa >= tau) if tau > 0 else np.flatnonzero(absa)


class TopKCodec(_SparseCodec):
    """Exact top-k by magnitude on every call (``keep`` fraction), error feedback per key."""

    name = "topk"

    def _select(self, a: np.ndarray, absa: np.ndarray, key: Any) -> np.ndarray:
        n = a.size
        k = kept_count(self.keep, n)
        if k >= n:
            return np.arange(n)
        idx = np.sort(np.argpartition(absa, n - k)[n - k:])
        return idx[absa[idx] > 0]


class DCTCodec(_SparseCodec):
    """Hard threshold τ refreshed every ``refresh`` calls per key (see the module docstring)."""

    name = "dct"

    def __init__(self, *, keep: float = 0.01, refresh: int = 1000, threshold: float | None = None,
                 drift: float | None = 2.0, values: str = "fp16",
                 error_feedback: bool = True) -> None:
        super().__init__(keep=keep, values=values, error_feedback=error_feedback)
        if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
            raise ConfigError(f"dct refresh must be a positive int, got {refresh!r}")
        if threshold is not None and not (isinstance(threshold, int | float)
                                          and np.isfinite(threshold) and threshold >= 0):
            raise ConfigError(f"dct threshold must be a finite number ≥ 0, got {threshold!r}")
        if drift is not None and not (isinstance(drift, int | float) and drift > 1):
            raise ConfigError(f"dct drift must be a number > 1 or None, got {drift!r}")
        self.refresh = refresh
        self.threshold = None if threshold is None else float(threshold)
        self.drift = None if drift is None else float(drift)
        self.refreshes = 0
        self._tau: dict[Any, _Threshold] = {}

    def _select(self, a: np.ndarray, absa: np.ndarray, key: Any) -> np.ndarray:
        n = a.size
        if self.threshold is not None:
            return np.arange(n) if self.threshold == 0 else np.flatnonzero(absa >= self.threshold)
        k = kept_count(self.keep, n)
        if k >= n:
            return np.arange(n)
        st = self._tau.setdefault(key, _Threshold())
        if st.tau is None or st.since >= self.refresh:
            self._refresh(st, absa, k, key, scheduled=True)
        idx = _mask_at(absa, st.tau or 0.0)
        if self.drift is not None and n and not k / self.drift <= idx.size <= k * self.drift:
            self._refresh(st, absa, k, key, scheduled=False)
            idx = _mask_at(absa, st.tau or 0.0)
        st.since += 1
        st.kept += idx.size
        st.seen += n
        return idx

    def _refresh(self, st: _Threshold, absa: np.ndarray, k: int, key: Any,
                 *, scheduled: bool) -> None:
        if st.seen:
            log.log(logging.INFO if scheduled else logging.DEBUG,
                    "dct key=%r: kept density %.5f over %d calls (target %.5f); new tau",
                    key, st.kept / st.seen, st.since, self.keep)
        st.tau = _kth_largest(absa, k) if k else 0.0
        st.since = st.kept = st.seen = 0
        self.refreshes += 1

    def tau(self, key: Any = None) -> float | None:
        """The threshold in use for ``key`` (None before its first call)."""
        if self.threshold is not None:
            return self.threshold
        st = self._tau.get(key)
        return None if st is None else st.tau

    def reset(self) -> None:
        super().reset()
        self._tau.clear()

    def info(self) -> dict[str, float]:
        return {**super().info(), "refreshes": float(self.refreshes)}
