"""Compressed collectives for the dense replicas (gloo or any backend with all_to_all).

- :func:`compressed_allreduce`: the 1-bit two-phase average of 1-bit Adam / 1-bit LAMB
  (DeepSpeed's scheme, with our own numpy bit packing) with worker and server error feedback.
- :class:`OnebitReducer`: keeps those error buffers per key and counts bytes.
- :class:`CodecAverager`: any registry codec (dct, topk, qsgd, adaquant, int8, …): every rank
  all-gathers every other rank's encoded payload (wire format of
  :mod:`services.common.wire`) and decodes them before summing, in rank order, so every rank
  gets the same result bit for bit.

Both are :class:`~services.worker.sync.base.Averager` callables (``averager(flat, group,
size)``) with a cumulative ``wire_bytes``; both are ``lossy`` (except CodecAverager over none,
fp16 or bf16) and then average parameters as changes with error feedback
(``average_change``, see :mod:`services.worker.sync.base`). Byte accounting (:class:`CommStats`): ``raw_bytes``
is what an fp32 all-reduce would hand to the collective (4 bytes per element), ``wire_bytes``
what this rank hands to the collectives instead. Gather-based schemes deliver every rank's
payload to every rank, so their per-link traffic grows with the world size; all-reduce-based
ones (fp16, onebit, PowerSGD) do not.

Tensors may live on any device; compression runs on CPU copies (gloo's home).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from services.common.codecs import Codec, decode_array, get_codec
from services.common.codecs.bits import pack_signs, unpack_signs
from services.common.codecs.qsgd import QSGDCodec
from services.common.errors import InvalidArgument
from services.common.wire import decode_message, encode_message
from services.worker.distributed import joined

__all__ = [
    "NEAR_LOSSLESS",
    "CodecAverager",
    "CommStats",
    "OnebitReducer",
    "allgather_bytes",
    "compressed_allreduce",
    "lossy_codec",
    "padded_size",
    "world_of",
]


@dataclass(slots=True)
class CommStats:
    """Bytes an fp32 all-reduce would send (raw) and bytes actually handed to collectives."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    calls: int = 0
    steps: int = 0

    def add(self, raw: int, wire: int) -> None:
        self.raw_bytes += int(raw)
        self.wire_bytes += int(wire)
        self.calls += 1

    @property
    def ratio(self) -> float:
        """raw / wire (1.0 before anything was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    @property
    def bytes_per_step(self) -> float:
        """Wire bytes per finished step (per call when no step was marked)."""
        return self.wire_bytes / (self.steps or self.calls or 1)

    def as_dict(self) -> dict[str, float]:
        return {"raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes, "calls": self.calls,
                "steps": self.steps, "ratio": self.ratio, "bytes_per_step": self.bytes_per_step}


def world_of(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without an initialised process group."""
    if not joined():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def padded_size(numel: int, world: int) -> int:
    """The flat length 1-bit buffers use: a multiple of ``8 · world`` (whole bytes per chunk)."""
    unit = 8 * world
    return max(unit, -(-numel // unit) * unit)


def _gather(tensor: Tensor, group: Any, world: int) -> list[Tensor]:
    if world == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor, group=group)
    return out


def _sign(x: np.ndarray) -> np.ndarray:
    """±1 (float32) with sign(0) = +1."""
    return np.where(x < 0, np.float32(-1.0), np.float32(1.0))


def _rms(x: np.ndarray) -> np.float32:
    return np.float32(np.sqrt(np.dot(x.astype(np.float64), x) / max(x.size, 1)))


def _with_scale(scale: np.float32, bits: np.ndarray) -> np.ndarray:
    """One row per destination: 4 bytes of float32 scale, then that row's sign bytes."""
    rows = bits.reshape(-1, bits.shape[-1]) if bits.ndim > 1 else bits.reshape(1, -1)
    out = np.empty((rows.shape[0], 4 + rows.shape[1]), dtype=np.uint8)
    out[:, :4] = np.frombuffer(np.float32(scale).astype("<f4").tobytes(), dtype=np.uint8)
    out[:, 4:] = rows
    return out


def _split_scales(rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 scale per row, ±1 signs per row) of rows built by :func:`_with_scale`."""
    scales = np.ascontiguousarray(rows[:, :4]).view("<f4").reshape(-1).astype(np.float32)
    signs = unpack_signs(np.ascontiguousarray(rows[:, 4:]).reshape(-1), rows.shape[0] * count)
    return scales, signs.reshape(rows.shape[0], count)


@torch.no_grad()
def compressed_allreduce(x: Tensor, worker_error: Tensor, server_error: Tensor, *,
                         group: Any = None) -> Tensor:
    """The mean of ``x`` over the ranks of ``group``, sent as ~1 bit per element each way.

    ``worker_error`` (length :func:`padded_size`) and ``server_error`` (that over the world
    size) are float32 CPU tensors updated in place; every rank gets the same result::

        b = x + e_w;  s = ||b||/sqrt(D);  e_w = b − s·sign(b)
        phase 1: all_to_all (s, sign bits of chunk j) to rank j
        rank j:  y = mean_i s_i·sign_i[j] + e_s;  s' = ||y||/sqrt(D/n);  e_s = y − s'·sign(y)
        phase 2: all_gather (s', sign(y) bits);  result = concat_j s'_j·sign_j

    Two collectives per call; each carries its scale in front of the bits.
    """
    _, world = world_of(group)
    n = x.numel()
    size = padded_size(n, world)
    chunk = size // world
    if (worker_error.numel() != size or server_error.numel() != chunk
            or worker_error.dtype != torch.float32 or server_error.dtype != torch.float32):
        raise InvalidArgument(f"1-bit all-reduce of {n} elements over {world} ranks needs float32 "
                              f"error buffers of {size} and {chunk} elements, got "
                              f"{worker_error.numel()} and {server_error.numel()}")
    ew, es = worker_error.numpy(), server_error.numpy()
    buf = np.zeros(size, dtype=np.float32)
    buf[:n] = x.detach().reshape(-1).to("cpu", torch.float32).numpy()
    buf += ew
    scale = _rms(buf)
    ew[:] = buf - scale * _sign(buf)
    send = _with_scale(scale, pack_signs(buf).reshape(world, chunk // 8))
    received = _exchange(send, group, world, all_to_all=True)
    scales, signs = _split_scales(received, chunk)
    y = (scales[:, None] * signs).sum(axis=0) / np.float32(world) + es
    scale2 = _rms(y)
    es[:] = y - scale2 * _sign(y)
    gathered = _exchange(_with_scale(scale2, pack_signs(y)), group, world, all_to_all=False)
    scales2, signs2 = _split_scales(gathered, chunk)
    out = (signs2 * scales2[:, None]).reshape(-1)[:n]
    return torch.from_numpy(out).reshape(x.shape).to(x.device, x.dtype)


def _exchange(rows: np.ndarray, group: Any, world: int, *, all_to_all: bool) -> np.ndarray:
    """all_to_all (row j to rank j) or all_gather (the one row to everyone) of uint8 rows."""
    if world == 1:
        return rows
    send = torch.from_numpy(rows)
    if all_to_all:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.numpy()
    return torch.cat(_gather(send, group, world)).numpy()


def onebit_wire_bytes(numel: int, world: int) -> int:
    """Bytes one rank hands to the collectives in one :func:`compressed_allreduce`."""
    size = padded_size(numel, world)
    return size // 8 + 4 * world + size // world // 8 + 4


class OnebitReducer:
    """:func:`compressed_allreduce` with its error buffers kept per key; an Averager.

    A key whose tensor changes size starts over with zero errors. :meth:`reset` drops every
    buffer (as after a checkpoint restore: errors are per rank and are not saved).
    """

    def __init__(self, *, group: Any = None) -> None:
        self.group = group
        self.stats = CommStats()
        self._errors: dict[Any, tuple[Tensor, Tensor]] = {}

    @property
    def wire_bytes(self) -> int:
        return self.stats.wire_bytes

    def errors(self, key: Any = None) -> tuple[Tensor, Tensor] | None:
        """(worker error, server error) of ``key``."""
        return self._errors.get(key)

    def allreduce(self, x: Tensor, key: Any = None, *, group: Any = None) -> Tensor:
        group = self.group if group is None else group
        _, world = world_of(group)
        size = padded_size(x.numel(), world)
        errs = self._errors.get(key)
        if errs is None or errs[0].numel() != size:
            errs = (torch.zeros(size), torch.zeros(size // world))
            self._errors[key] = errs
        out = compressed_allreduce(x, errs[0], errs[1], group=group)
        self.stats.add(4 * x.numel(), onebit_wire_bytes(x.numel(), world))
        return out

    lossy = True

    def __call__(self, flat: Tensor, group: Any, size: int) -> Tensor:
        return self.allreduce(flat, key=("flat", id(group), flat.numel()), group=group)

    def average_change(self, change: Tensor, group: Any, size: int) -> Tensor:
        """The mean of each rank's ``change`` (its worker and server errors are the error
        feedback on it)."""
        return self.allreduce(change, key=("change", id(group), change.numel()), group=group)

    def reset(self) -> None:
        self._errors.clear()


def allgather_bytes(payload: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``payload`` (lengths may differ), in rank order."""
    _, world = world_of(group)
    if world == 1:
        return [payload]
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [int(t.item()) for t in _gather(length, group, world)]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return [bytes(t[:m].numpy()) for t, m in zip(_gather(buf, group, world), lengths, strict=True)]


# codecs whose round trip is exact or within half-precision rounding: averaging the
# parameters themselves through them is fine; any other codec must send changes
NEAR_LOSSLESS = ("none", "fp16", "bf16")


def lossy_codec(spec: str | Codec) -> bool:
    """Whether codec ``spec`` (a name such as ``"dct:keep=0.05+zstd"``, or an instance) loses
    more than half-precision rounding (lossless wrappers do not count)."""
    name = spec.name if isinstance(spec, Codec) else str(spec)
    return name.split("+")[0].partition(":")[0] not in NEAR_LOSSLESS


def _keeps_residual(codec: Codec) -> bool:
    """Whether ``codec`` keeps its own error-feedback residual per key (dct, topk, onebit)."""
    return bool(getattr(getattr(codec, "inner", codec), "error_feedback", False))


def _unbiased(codec: Codec) -> bool:
    """Whether ``codec`` is a stochastic unbiased quantizer (qsgd, adaquant)."""
    return isinstance(getattr(codec, "inner", codec), QSGDCodec)


class CodecAverager:
    """Mean over ranks through any codec: all-gather the encoded arrays, decode, then sum.

    ``codec`` is a registry name (``"dct"``, ``"qsgd+zstd"``) with ``params``, or an instance;
    its state (error feedback, thresholds) is kept per ``key``. Codes from different ranks are
    never summed in compressed form (QSGD/AdaQuant levels cannot be added).

    ``averager(flat, group, size)`` averages ``flat`` as it is; :meth:`average_change` averages
    each rank's change since the last sync with error feedback (what parameter averaging
    sends through a :attr:`lossy` codec).
    """

    def __init__(self, codec: str | Codec = "dct", *, group: Any = None, **params: Any) -> None:
        self.codec = codec if isinstance(codec, Codec) else get_codec(codec, **params)
        if isinstance(codec, Codec) and params:
            raise InvalidArgument("pass params with a codec name, not with a codec instance")
        self.group = group
        self.stats = CommStats()
        self._residuals: dict[Any, Tensor] = {}

    @property
    def wire_bytes(self) -> int:
        return self.stats.wire_bytes

    @property
    def lossy(self) -> bool:
        """True unless the codec is none, fp16 or bf16 (see :func:`lossy_codec`)."""
        return lossy_codec(self.codec)

    @torch.no_grad()
    def _exchange(self, x: Tensor, key: Any, group: Any) -> tuple[Tensor, Tensor]:
        """(mean over the ranks, this rank's own decoded payload) of ``x``, as float32 CPU."""
        rank, world = world_of(group)
        local = x.detach().reshape(-1).to("cpu", torch.float32).numpy()
        payload = encode_message({"a": self.codec.to_wire(local, key=key)})
        parts = allgather_bytes(payload, group)
        total = np.zeros(local.size, dtype=np.float64)
        own = total
        for i, part in enumerate(parts):
            decoded = decode_array(decode_message(part)["a"])
            total += decoded
            if i == rank:
                own = decoded
        # every rank hands the longest payload (all_gather pads) plus its 8-byte length
        self.stats.add(4 * x.numel(), max(len(p) for p in parts) + (8 if world > 1 else 0))
        mean = torch.from_numpy((total / world).astype(np.float32))
        return mean, torch.from_numpy(np.asarray(own, dtype=np.float32).reshape(-1))

    def allreduce(self, x: Tensor, key: Any = None, *, group: Any = None) -> Tensor:
        group = self.group if group is None else group
        mean, _ = self._exchange(x, key, group)
        return mean.reshape(x.shape).to(x.device, x.dtype)

    def __call__(self, flat: Tensor, group: Any, size: int) -> Tensor:
        return self.allreduce(flat, key=("flat", id(group), flat.numel()), group=group)

    @torch.no_grad()
    def average_change(self, change: Tensor, group: Any, size: int) -> Tensor:
        """The mean over ``group`` of each rank's ``change``, with error feedback on it.

        What a rank's codec did not send stays in a residual kept on this rank and goes out
        with its next change, so Σ sent = Σ change − residual: the codec's own residual where
        it keeps one (dct, topk, onebit), else one kept here (int8, uniform, fp16, …). The
        unbiased quantizers (qsgd, adaquant) send the change as it is: E[sent] = change, and
        error feedback would grow without bound wherever their variance factor
        ω = min(b/s², √b/s) exceeds 1 (ω = 8 at s = 2, bucket 256).
        """
        key = ("change", id(group), change.numel())
        if _keeps_residual(self.codec) or _unbiased(self.codec):
            return self.allreduce(change, key=key, group=group)
        corrected = change.detach().reshape(-1).to("cpu", torch.float32)
        residual = self._residuals.get(key)
        if residual is not None:
            corrected = corrected + residual
        mean, own = self._exchange(corrected, key, group)
        self._residuals[key] = corrected - own
        return mean.reshape(change.shape).to(change.device, change.dtype)

    def residual(self, group: Any, numel: int) -> Tensor | None:
        """What :meth:`average_change` still owes for ``group`` and length ``numel`` (None
        before the first call and for the unbiased quantizers, which keep none)."""
        key = ("change", id(group), numel)
        if _keeps_residual(self.codec):
            owed = getattr(getattr(self.codec, "inner", self.codec), "residual")(key)  # noqa: B009
            return None if owed is None else torch.from_numpy(np.asarray(owed).reshape(-1))
        return self._residuals.get(key)

    def report_loss(self, loss: float) -> int | None:
        """Forward the training loss to an adaptive codec (adaquant); returns its new s."""
        report = getattr(self.codec, "report_loss", None)
        return report(loss) if callable(report) else None

    def reset(self) -> None:
        self._residuals.clear()
        reset = getattr(self.codec, "reset", None)
        if callable(reset):
            reset()
