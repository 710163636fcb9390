"""torch.distributed process groups for the dense replicas: set-up, tear-down, local ranks.

:func:`init_distributed` joins the group described by explicit arguments (Persimmon's local
launcher) or, for each one not given, by torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The backend is NCCL when CUDA is available
and gloo otherwise. With no world size anywhere it returns a single-process :class:`DistInfo`
without creating a group; every sync strategy is then a no-op.

:func:`joined` says whether this process is in a group, :func:`several_ranks` whether in one of
more than one rank; the collectives every rank meets in step live here too: does every rank still have a
batch (:func:`every_rank_has_a_batch`, :func:`every_rank_has_a_first_batch`), the step's mean
loss (:func:`mean_over_ranks`).

:func:`run_local_ranks` runs a function on N local ranks joined through a TCP rendezvous on a
free 127.0.0.1 port and returns their results (used by tests and by small local runs).
"""

from __future__ import annotations

import os
import queue as queue_mod
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.commands import debug_enabled
from services.common.errors import ConfigError, Internal, InvalidArgument, PersimmonError
from services.common.ports import free_port

__all__ = [
    "BACKENDS",
    "DistInfo",
    "default_backend",
    "destroy_distributed",
    "every_rank_has_a_batch",
    "every_rank_has_a_first_batch",
    "init_distributed",
    "joined",
    "mean_over_ranks",
    "run_local_ranks",
    "several_ranks",
]

BACKENDS = ("gloo", "nccl")
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class DistInfo:
    """Where this process stands: its rank, the world size, backend and compute device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    initialized: bool  # False for a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def joined() -> bool:
    """Whether this process is in a torch.distributed process group (of any size)."""
    return dist.is_available() and dist.is_initialized()


def several_ranks() -> bool:
    """Whether a torch.distributed group of more than one rank is initialised."""
    return joined() and dist.get_world_size() > 1


def every_rank_has_a_batch(has_batch: bool, group: Any = None) -> bool:
    """Collective (of ``group``, default the world): True while every rank still has a batch
    (ranks may get uneven counts from a loader; DDP needs all of them to stop at the same
    step)."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([1 if has_batch else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def every_rank_has_a_first_batch() -> None:
    """Collective, before a rank builds its model from its first batch (the build's
    collectives): InvalidArgument where another rank has no batch at all. That rank's compute
    thread meets this call with :func:`every_rank_has_a_batch` False (the same collective) and
    ends its run, instead of both waiting forever in different collectives."""
    if several_ranks() and not every_rank_has_a_batch(True):
        raise InvalidArgument("another rank got no batch: the training data holds fewer "
                              "batches than ranks (use fewer workers or smaller batches)")


def mean_over_ranks(loss: torch.Tensor) -> float:
    """A step's loss averaged over the ranks (collective with more than one rank): what the
    adaquant codecs' s follows, the same value on every rank."""
    value = loss.detach().to("cpu", torch.float64).reshape(1)
    if several_ranks():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value.item())


def default_backend() -> str:
    """``nccl`` when CUDA and NCCL are available, else ``gloo``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer") from exc


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        idx = local_rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _info_of_current_group() -> DistInfo:
    backend = str(dist.get_backend())
    local_rank = _env_int(os.environ, "LOCAL_RANK") or 0
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=local_rank, backend=backend, device=device, initialized=True)


def init_distributed(*, rank: int | None = None, world_size: int | None = None,
                     master_addr: str | None = None, master_port: int | None = None,
                     local_rank: int | None = None, backend: str | None = None,
                     timeout_s: float = 300.0,
                     environ: Mapping[str, str] | None = None) -> DistInfo:
    """Join (or describe, if already joined) the default process group.

    Arguments left None are read from torchrun's environment; ``master_addr`` defaults to
    127.0.0.1. Bad or missing values are a :class:`ConfigError`.
    """
    if joined():
        return _info_of_current_group()
    env = os.environ if environ is None else environ
    world_size = world_size if world_size is not None else _env_int(env, "WORLD_SIZE")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
    if world_size is None:
        return DistInfo(rank=0, world_size=1, local_rank=0, backend=backend,
                        device=_device_for(backend, 0), initialized=False)
    rank = rank if rank is not None else _env_int(env, "RANK")
    local_rank = local_rank if local_rank is not None else (_env_int(env, "LOCAL_RANK") or 0)
    master_addr = master_addr or env.get("MASTER_ADDR") or "127.0.0.1"
    master_port = master_port if master_port is not None else _env_int(env, "MASTER_PORT")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if rank is None or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank} "
                          "(pass rank= or set RANK)")
    if master_port is None or not 0 < master_port < 65536:
        raise ConfigError(f"master_port must be in 1..65535, got {master_port} "
                          "(pass master_port= or set MASTER_PORT)")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    device = _device_for(backend, local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
                    device=device, initialized=True)


def destroy_distributed() -> None:
    """Leave the default process group (and every subgroup); a no-op when there is none."""
    if joined():
        dist.destroy_process_group()


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               args: tuple[Any, ...], results: Any, threads: int, timeout_s: float) -> None:
    torch.set_num_threads(threads)
    try:
        init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                         master_port=port, local_rank=rank, backend=backend,
                         timeout_s=timeout_s)
        value = fn(rank, world_size, *args)
        dist.barrier()  # rank 0 hosts the store: nobody leaves while others still need it
        results.put((rank, True, value))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        ours = exc if isinstance(exc, PersimmonError) else None
        results.put((rank, False, (ours, traceback.format_exc())))
    finally:
        destroy_distributed()


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _rank_error(rank: int, error: PersimmonError | None, trace: str) -> PersimmonError:
    """The error the parent raises for a rank that failed with ``error`` (``trace``)."""
    if error is None:
        return Internal(f"local rank {rank} failed:\n{trace}")
    if debug_enabled():
        sys.stderr.write(trace)
    return type(error)(f"local rank {rank}: {error.message}")


def run_local_ranks(fn: Callable[..., T], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 120.0, start_method: str = "forkserver",
                    threads_per_rank: int = 1) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; results by rank.

    Each process joins a fresh process group (TCP rendezvous on a free 127.0.0.1 port) before
    calling ``fn`` and leaves it afterwards. Ranks are forked from a forkserver (a clean
    process that has imported torch and the worker once), never from the caller: a caller
    that ran gRPC, CUDA or other threads must not be forked. ``fn`` and ``args`` must
    pickle (``fn`` a module-level function). A failing rank stops the others and raises its
    error (a :class:`PersimmonError` of the same class naming the rank; any other error as
    :class:`Internal` with its traceback); a rank that dies silently or the whole run
    passing ``timeout_s`` is an :class:`Internal` too.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "services.worker.trainer"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, port, backend, args, results,
                               threads_per_rank, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, T] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise Internal(f"local rank(s) {dead} died without a result "
                                   f"(exit codes {[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise Internal(f"local ranks did not finish within {timeout_s}s; "
                                   f"done: {sorted(out)}") from None
                continue
            if not ok:
                raise _rank_error(rank, *value)
            out[rank] = value
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        _stop(procs)
        results.close()
    return [out[r] for r in range(world_size)]
