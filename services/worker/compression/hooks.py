"""DDP communication hooks that compress the dense gradient all-reduce, with byte counters.

``make_comm_hook(name, **params)`` returns ``(state, hook)`` for
``DistributedDataParallel.register_comm_hook(state, hook)`` (or ``AllReduceSync(comm_hook=…)``):

==========  ==============================================================================
name        what travels
==========  ==============================================================================
none        fp32 all-reduce (torch's default, counted) — the baseline
fp16        fp16 all-reduce (pre-divided by the world size against overflow)
dct         index+value pairs above a cached threshold, all-gathered; error feedback per bucket
topk        exact top-k index+value pairs, all-gathered; error feedback per bucket
qsgd        QSGD codes, all-gathered and decoded before summing
adaquant    QSGD with s from the loss (``state.report_loss(loss)`` each step)
onebit      the two-phase 1-bit all-reduce with worker and server error feedback
powersgd    torch's own ``powerSGD_hook`` (rank 1, start at iteration 2 by default)
==========  ==============================================================================

Any other registry codec name (``"int8"``, ``"dct+zstd"``) gets the all-gather hook too.
``params`` go to the codec (``keep``, ``refresh``, ``levels``, …), to :class:`PowerSGDState`
(``matrix_approximation_rank``, ``start_powerSGD_iter``, …) or, for onebit, nowhere.
Every state has ``stats`` (:class:`~.collectives.CommStats`, one step per DDP iteration)
and a cumulative ``wire_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from services.common.codecs import CODECS, get_codec, split_codec_name
from services.common.errors import InvalidArgument
from services.worker.compression.collectives import (
    CodecAverager,
    CommStats,
    OnebitReducer,
    world_of,
)

__all__ = [
    "HOOK_NAMES",
    "AllReduceHookState",
    "CodecHookState",
    "HookState",
    "OnebitHookState",
    "PowerSGDHookState",
    "allreduce_hook",
    "codec_hook",
    "make_comm_hook",
    "onebit_hook",
    "powersgd_hook",
]

HOOK_NAMES = ("none", "fp16", "dct", "topk", "qsgd", "adaquant", "onebit", "powersgd")


class HookState:
    """What every hook state has: the process group and byte counters."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self.stats = CommStats()

    @property
    def wire_bytes(self) -> int:
        """Cumulative bytes this rank handed to collectives (what sync strategies report)."""
        return self.stats.wire_bytes

    def _count(self, bucket: Any, raw: int, wire: int) -> None:
        self.stats.add(raw, wire)
        if bucket.is_last():
            self.stats.steps += 1


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class AllReduceHookState(HookState):
    """Plain all-reduce in ``dtype`` (float32: the baseline; float16: the fp16 hook)."""

    def __init__(self, process_group: Any = None, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidArgument(f"all-reduce hook dtype must be float32/16 or bfloat16, "
                                  f"got {dtype}")
        self.dtype = dtype


# DDP rejects hooks whose annotations are strings, hence no annotations on the hooks below.
def allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Average the bucket with one all-reduce in ``state.dtype``."""
    buf = bucket.buffer()
    _, world = world_of(state.process_group)
    payload = buf.to(state.dtype).div_(world)
    state._count(bucket, 4 * buf.numel(), payload.numel() * payload.element_size())
    if world == 1:
        return _done(buf.copy_(payload))
    fut = dist.all_reduce(payload, group=state.process_group, async_op=True).get_future()

    def decompress(f):  # type: ignore[no-untyped-def]
        return buf.copy_(f.value()[0])

    return fut.then(decompress)


class CodecHookState(HookState):
    """A registry codec per hook (state per bucket index), via :class:`CodecAverager`."""

    def __init__(self, codec: str, process_group: Any = None, **params: Any) -> None:
        super().__init__(process_group)
        self.averager = CodecAverager(codec, group=process_group, **params)

    @property
    def codec(self) -> Any:
        return self.averager.codec

    def report_loss(self, loss: float) -> int | None:
        """Pass the training loss to adaquant (returns its new s; None for other codecs)."""
        return self.averager.report_loss(loss)


def codec_hook(state, bucket):  # type: ignore[no-untyped-def]
    """All-gather every rank's encoded bucket, decode each, average; error feedback per bucket."""
    buf = bucket.buffer()
    before = state.averager.stats.wire_bytes
    out = state.averager.allreduce(buf, key=bucket.index())
    state._count(bucket, 4 * buf.numel(), state.averager.stats.wire_bytes - before)
    return _done(buf.copy_(out))


class OnebitHookState(HookState):
    """Worker and server error buffers per bucket for the 1-bit all-reduce."""

    def __init__(self, process_group: Any = None) -> None:
        super().__init__(process_group)
        self.reducer = OnebitReducer(group=process_group)


def onebit_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Average the bucket with :func:`~.collectives.compressed_allreduce`."""
    buf = bucket.buffer()
    before = state.reducer.stats.wire_bytes
    out = state.reducer.allreduce(buf, key=bucket.index())
    state._count(bucket, 4 * buf.numel(), state.reducer.stats.wire_bytes - before)
    return _done(buf.copy_(out))


class PowerSGDHookState(PowerSGDState):
    """torch's PowerSGD state plus byte counters (``stats``, ``wire_bytes``)."""

    def __init__(self, process_group: Any = None, **params: Any) -> None:
        params.setdefault("matrix_approximation_rank", 1)
        params.setdefault("start_powerSGD_iter", 2)
        params.setdefault("orthogonalization_epsilon", 1e-8)  # 0 turns zero columns into NaN
        super().__init__(process_group, **params)
        self.stats = CommStats()

    @property
    def wire_bytes(self) -> int:
        return self.stats.wire_bytes


def powersgd_hook(state, bucket):  # type: ignore[no-untyped-def]
    """torch's ``powerSGD_hook``, counting 4 bytes per element it all-reduces."""
    buf = bucket.buffer()
    compressing = state.iter >= state.start_powerSGD_iter
    before = state.total_numel_after_compression
    fut = powerSGD_hook(state, bucket)
    sent = (state.total_numel_after_compression - before) if compressing else buf.numel()
    state.stats.add(4 * buf.numel(), 4 * sent)
    if bucket.is_last():
        state.stats.steps += 1
    return fut


def make_comm_hook(name: str, *, process_group: Any = None,
                   **params: Any) -> tuple[Any, Any]:
    """``(state, hook)`` for a hook name (see the module docstring; parameters may be spelled
    in it, ``"dct:keep=0.005"``); bad names or params raise."""
    name, spelled = split_codec_name(name)
    params = {**spelled, **params}
    try:
        if name == "none":
            return AllReduceHookState(process_group, **params), allreduce_hook
        if name == "fp16":
            return AllReduceHookState(process_group, dtype=torch.float16, **params), allreduce_hook
        if name == "onebit":
            return OnebitHookState(process_group, **params), onebit_hook
        if name == "powersgd":
            return PowerSGDHookState(process_group, **params), powersgd_hook
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad parameters for comm hook {name!r}: {exc}") from exc
    base = str(name).split("+")[0]
    if base not in CODECS:
        raise InvalidArgument(f"unknown comm hook {name!r}; available: {list(HOOK_NAMES)} or any "
                              f"codec name ({sorted(CODECS)}, optionally +zstd/+lz4)")
    get_codec(name, **params)  # validate before building the state
    return CodecHookState(name, process_group, **params), codec_hook
