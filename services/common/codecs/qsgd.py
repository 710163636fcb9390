"""Stochastic quantizers: ``qsgd`` (s levels, unbiased) and ``adaquant`` (s adapted from the loss).

QSGD (Alistarh et al. 2017) per bucket of ``bucket`` elements with norm ``‖v‖``:
``r = |v_i| · s / ‖v‖``, ``l = floor(r)`` rounded up with probability ``r − l``, decoded as
``sign · l · ‖v‖ / s`` — so ``E[decode] = v`` (unbiased) and each element is off by less
than ``‖v‖ / s``. Wire: one float32 norm per bucket, then one ``(level << 1) | negative``
code of ``ceil(log2(s + 1)) + 1`` bits per element, packed back to back (:mod:`.bits`).
``s`` and the bucket size travel in meta, so decoding never needs the sender's state and
codes from different senders must be decoded before they are summed.

AdaQuantFL (Jhunjhunwala et al. 2021): ``s_k = ceil(sqrt(F_0 / F_k) · s_0)`` clipped to
``[s_min, s_max]``, where ``F_0`` is the mean of the first ``f0_steps`` (8) reported training
losses (the mean of those so far until then; the paper's one initial loss would let an
outlying first minibatch pin s at a bound for the whole run) and ``F_k`` the mean of the last
``window`` reports (:meth:`AdaQuantCodec.report_loss`): few levels early, more as the loss
falls. The Trainer reports the mean of each step's loss over every rank to
every adaquant codec it drives (dense hook, averager, PS pushes), so all ranks use the same s.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from services.common.codecs.base import FloatCodec
from services.common.codecs.bits import expect_nbytes, meta_int, numel, pack_uint, unpack_uint
from services.common.errors import ConfigError, InvalidArgument, MalformedMessage

__all__ = ["MAX_LEVELS", "AdaQuantCodec", "QSGDCodec", "adapts_to_loss", "code_width"]

MAX_LEVELS = (1 << 15) - 1
MAX_BUCKET = 1 << 30


def code_width(levels: int) -> int:
    """Bits per element: ``ceil(log2(s + 1))`` level bits plus one sign bit."""
    return int(levels).bit_length() + 1


def adapts_to_loss(spec: str) -> bool:
    """Whether codec ``spec`` (``"adaquant:s0=4+zstd"``) is adaquant, whose s needs the loss."""
    return str(spec).split("+")[0].partition(":")[0] == AdaQuantCodec.name


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _bucket_of(bucket: int, n: int) -> int:
    return min(bucket, n) if bucket else n


class QSGDCodec(FloatCodec):
    """``levels`` (s) quantization levels per sign, one norm per ``bucket`` elements (0 = one norm)."""

    name = "qsgd"

    def __init__(self, *, levels: int = 15, bucket: int = 256, seed: int | None = None) -> None:
        super().__init__()
        self._levels = _check_int(f"{self.name} levels", levels, 1, MAX_LEVELS)
        self.bucket = _check_int(f"{self.name} bucket", bucket, 0, MAX_BUCKET)
        self.rng = np.random.default_rng(seed)

    @property
    def levels(self) -> int:
        """The s used by the next :meth:`encode`."""
        return self._levels

    def encode_float(self, flat: np.ndarray, shape: tuple[int, ...],
                     key: Any) -> tuple[Any, dict[str, Any]]:
        s, n = self.levels, flat.size
        b = _bucket_of(self.bucket, n)
        if n == 0:
            return b"", {"s": s, "b": 0}
        nb = -(-n // b)
        padded = np.zeros(nb * b, dtype=np.float32)
        padded[:n] = flat
        blocks = padded.reshape(nb, b)
        norms = np.sqrt(np.einsum("ij,ij->i", blocks, blocks, dtype=np.float64)).astype(np.float32)
        safe = np.where(norms > 0, norms, np.float32(1.0))
        r = (np.abs(blocks) * (np.float32(s) / safe)[:, None]).reshape(-1)[:n]
        level = np.floor(r)
        level += self.rng.random(n, dtype=np.float32) < (r - level)
        np.clip(level, 0, s, out=level)
        codes = (level.astype(np.uint32) << 1) | (flat < 0)
        packed = pack_uint(codes, code_width(s))
        out = np.empty(4 * nb + packed.size, dtype=np.uint8)
        out[: 4 * nb] = norms.astype("<f4").view(np.uint8)
        out[4 * nb:] = packed
        return out.data, {"s": s, "b": b}

    def decode_float(self, data: Any, meta: dict[str, Any], dtype: np.dtype,
                     shape: tuple[int, ...]) -> np.ndarray:
        n = numel(shape)
        s = meta_int(meta, "s", 1, MAX_LEVELS, self.name)
        b = meta_int(meta, "b", 1 if n else 0, max(n, 1), self.name)
        if n == 0:
            expect_nbytes(data, 0, f"{self.name} empty array")
            return np.zeros(shape, dtype=dtype)
        nb, width = -(-n // b), code_width(s)
        expect_nbytes(data, 4 * nb + -(-n * width // 8), f"{self.name} array of {n} elements")
        norms = np.frombuffer(data, dtype="<f4", count=nb)
        codes = unpack_uint(np.frombuffer(data, dtype=np.uint8, offset=4 * nb), n, width)
        level = (codes >> 1).astype(np.float32)
        if level.max() > s:
            raise MalformedMessage(f"{self.name} level above s={s}")
        sign = 1.0 - 2.0 * (codes & 1).astype(np.float32)
        values = sign * level * np.repeat(norms / np.float32(s), b)[:n]
        return values.astype(dtype).reshape(shape)


class AdaQuantCodec(QSGDCodec):
    """QSGD whose s follows the training loss: ``s_k = ceil(sqrt(F_0/F_k) · s_0)`` in [s_min, s_max].

    Call :meth:`report_loss` once per step with the (ideally all-worker mean) training loss.
    ``F_0`` is the mean of the first ``f0_steps`` losses (of those so far before then);
    ``F_k`` the mean of the last ``window``.
    """

    name = "adaquant"
    stateful = True

    def __init__(self, *, s0: int = 2, s_min: int = 2, s_max: int = 255, window: int = 10,
                 f0_steps: int = 8, bucket: int = 256, seed: int | None = None) -> None:
        self.s_min = _check_int("adaquant s_min", s_min, 1, MAX_LEVELS)
        self.s_max = _check_int("adaquant s_max", s_max, self.s_min, MAX_LEVELS)
        self.s0 = _check_int("adaquant s0", s0, 1, MAX_LEVELS)
        self.window = _check_int("adaquant window", window, 1, 1 << 20)
        self.f0_steps = _check_int("adaquant f0_steps", f0_steps, 1, 1 << 20)
        super().__init__(levels=min(max(self.s0, self.s_min), self.s_max), bucket=bucket,
                         seed=seed)
        self.initial_loss: float | None = None   # F_0: the mean of the first f0_steps losses
        self._initial_sum = 0.0
        self._initial_count = 0
        self._recent: deque[float] = deque(maxlen=self.window)

    def report_loss(self, loss: float) -> int:
        """Record a training loss and return the s the next encode will use."""
        try:
            value = float(loss)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"adaquant loss must be a number, got {loss!r}") from exc
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"adaquant loss must be finite and ≥ 0, got {loss!r}")
        if self._initial_count < self.f0_steps:
            self._initial_sum += value
            self._initial_count += 1
            self.initial_loss = self._initial_sum / self._initial_count
        self._recent.append(value)
        current = sum(self._recent) / len(self._recent)
        initial = self._initial_sum / self._initial_count
        if current <= 0:
            s = self.s_max
        elif initial == 0:
            s = self.s_min
        else:
            s = math.ceil(math.sqrt(initial / current) * self.s0)
        self._levels = min(max(s, self.s_min), self.s_max)
        return self._levels
