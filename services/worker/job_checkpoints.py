"""Job checkpoints, written by worker rank 0: periodic, on request over REST, and at SIGTERM.

A job checkpoint is every PS shard's part, then the job's own parts (dense model and optimizer
state, loader offsets), then the manifest that marks the whole complete (the on-disk format:
:mod:`services.common.checkpoints`). :meth:`JobCheckpointer.checkpoint` asks each PS shard over
its admin REST API to write its part under the shared id, writes the given job parts, then
:func:`~services.common.checkpoints.write_job_manifest` checks that everything is on disk and
marks the checkpoint complete; the manifest is published as the job state in the registry. A
crash at any step leaves an incomplete checkpoint that restore never picks.

:class:`~services.worker.job_control.JobControl` takes these checkpoints while a trainer
trains (periodic, on request over REST, at SIGTERM), each a consistent cut of the job.

Consistent cuts (:class:`ConsistentCut`, exactly once with a Kafka loader under
``--checkpoint-dir``): every rank stops at the same step, drains its in-flight pushes and
writes the source positions of the batches it trained (``root/<id>/ranks/rank-<r>.json``:
the barrier is the shared checkpoint root); rank 0 waits for all of them, merges the positions
(:mod:`services.common.checkpoints.positions`), writes the PS parts, the dense part and the
positions part, then the manifest, and asks the loader to commit the cut's offsets; the other
ranks go on only once the manifest exists, so no push after the cut reaches a PS part. A job
resumed from the cut (PS ``--restore job``, the loader at the cut's positions, the dense part)
replays exactly the records after it.

Epochs: each rank's positions file also names the epoch of every PS shard its pushes were in
(its PS client's, read after its drain), and each shard's checkpoint call carries that epoch.
A shard restored since (its rows rolled back, its epoch moved on) refuses its part
(:class:`~services.common.errors.StaleEpoch`), as it refuses the pushes of the old epoch, and
so do ranks that name different epochs for one shard. A refused cut is a failed cut: no
manifest (so no job restore picks it), a ``refused.json`` next to the parts other shards
wrote, and every rank goes on; the next cut is taken in the epochs the ranks learn when they
re-sync or restart.

Resume: :func:`resume_state` reads the dense state of the newest complete job checkpoint (the
PS shards restore theirs with ``--restore job``).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from clients.admin_client import AdminClient
from services.common.checkpoints import (
    JOB_MANIFEST,
    clean_job_temp,
    latest_complete,
    prune_job_checkpoints,
    read_job_manifest,
    read_part,
    write_job_manifest,
    write_part,
)
from services.common.checkpoints.positions import (
    POSITIONS_PART,
    advance,
    encode_positions,
    merge,
)
from services.common.errors import (
    AlreadyExists,
    Internal,
    InvalidArgument,
    PersimmonError,
    StaleEpoch,
    Unavailable,
)
from services.common.files import atomic_write
from services.common.registry import Registry, discover_shards
from services.common.retry import RetryPolicy

__all__ = ["CUT_REFUSED", "ConsistentCut", "JobCheckpointer", "dense_part", "load_dense_part",
           "loader_offsets_part", "resume_state"]

log = logging.getLogger(__name__)

PartSource = Callable[[], bytes | Awaitable[bytes]]
Epochs = Callable[[], Sequence[int]]
CUT_REFUSED = "refused.json"  # in a refused cut's directory: why (a cut never complete)


def dense_part(state: dict[str, Any]) -> bytes:
    """``state`` (e.g. ``Trainer.dense_state()``: model, optimizer, step) serialised by torch."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_dense_part(data: bytes) -> dict[str, Any]:
    """The dict :func:`dense_part` wrote."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def loader_offsets_part(admin_url: str) -> PartSource:
    """A part source reading the loader's committed offsets from its admin API."""
    async def read() -> bytes:
        offsets = await _loader_admin(admin_url, "GET", "/v1/offsets")
        return json.dumps(offsets, sort_keys=True).encode()
    return read


async def _loader_admin(admin_url: str, method: str, path: str) -> Any:
    """The JSON answer of the loader's admin API at ``admin_url`` to ``method path``, with
    the token and TLS settings of the environment (an error answer raised as its Persimmon
    error)."""
    async with AdminClient(admin_url) as admin:
        return await admin.request(method, path)


class JobCheckpointer:
    """Writes job checkpoints under ``root`` (the directory every PS shard checkpoints into).

    PS shards are reached at ``admin_urls`` or, when None, found in ``registry``. ``parts``
    maps a part name to a source of its bytes, read at each checkpoint. Periodic checkpoints:
    :meth:`due` is true every ``every_steps`` steps or ``every_s`` seconds (0: never).
    ``retry_s``: a shard that cannot be reached (restarting, e.g. from its write-ahead log)
    or cannot write its part now (an error of its own, e.g. its log's disk full) is asked
    again, with backoff, for up to that long; on a retry, a part it already wrote (its
    answer lost in its crash) counts as written. ``keep``: after each checkpoint, complete
    job checkpoints but the newest ``keep`` are removed (0: keep all). Made, it removes the
    temp files a crash of the coordinator left under ``root``. ``epochs``: each shard's epoch
    the job's pushes are in, in shard order (0: not fenced), as a list or read at each
    checkpoint from a callable (e.g. ``lambda: client.epochs`` of its
    :class:`clients.ps_client.PSClient`, which a re-sync updates): a shard restored since
    refuses its part (StaleEpoch), so no cut mixes rolled-back rows (:meth:`checkpoint`).
    """

    def __init__(self, root: Path | str, *, admin_urls: Sequence[str] | None = None,
                 registry: Registry | None = None, parts: Mapping[str, PartSource] | None = None,
                 every_steps: int = 0, every_s: float = 0.0, retry_s: float = 0.0,
                 keep: int = 0, epochs: Sequence[int] | Epochs | None = None) -> None:
        if admin_urls is None and registry is None:
            raise InvalidArgument("a JobCheckpointer needs PS admin URLs or a registry")
        if every_steps < 0 or every_s < 0 or retry_s < 0 or keep < 0:
            raise InvalidArgument("every_steps, every_s, retry_s and keep must be >= 0")
        self.keep = keep
        self.root = Path(root)
        self.admin_urls = list(admin_urls) if admin_urls is not None else None
        self._epochs = epochs if epochs is None or callable(epochs) else list(epochs)
        self.registry = registry
        self.parts = dict(parts or {})
        self.every_steps = every_steps
        self.every_s = every_s
        self.retry_s = retry_s
        self._last_step = 0
        self._last_time = time.monotonic()
        self._lock = asyncio.Lock()
        clean_job_temp(self.root)

    def due(self, step: int) -> bool:
        """True when a periodic checkpoint is due at ``step``."""
        by_steps = self.every_steps and step - self._last_step >= self.every_steps
        by_time = self.every_s and time.monotonic() - self._last_time >= self.every_s
        return bool(by_steps or by_time)

    async def _ps_admin_urls(self) -> list[str]:
        if self.admin_urls is not None:
            return self.admin_urls
        assert self.registry is not None
        shards = await discover_shards(self.registry)
        urls = [m.admin_url for m in shards]
        if None in urls:
            raise InvalidArgument("a registered PS shard has no admin URL")
        return [u for u in urls if u is not None]

    def epochs(self) -> list[int] | None:
        """Each shard's epoch the job's pushes are in now (None: not fenced)."""
        if self._epochs is None:
            return None
        return list(self._epochs() if callable(self._epochs) else self._epochs)

    async def checkpoint(self, step: int, checkpoint_id: str | None = None,
                         parts: Mapping[str, bytes] | None = None,
                         epochs: Sequence[int] | None = None) -> dict[str, Any]:
        """Write a complete job checkpoint of ``step``; returns its manifest.

        ``parts`` are bytes captured by the caller (e.g. the dense state at ``step``); they
        are written along with the configured part sources. ``epochs`` (default
        :meth:`epochs`): each shard's epoch the pushes up to ``step`` were in; a shard in
        another one refuses its part and this raises its :class:`StaleEpoch` once every
        shard's call has ended: a failed checkpoint, no manifest written (the parts other
        shards wrote make no complete checkpoint).
        """
        checkpoint_id = checkpoint_id or f"step-{step:010d}-{uuid.uuid4().hex[:6]}"
        async with self._lock:
            urls = await self._ps_admin_urls()
            epochs = list(epochs) if epochs is not None else self.epochs() or [0] * len(urls)
            if len(epochs) != len(urls):
                raise InvalidArgument(f"{len(epochs)} epochs for {len(urls)} PS shards")
            await self._ps_parts(urls, checkpoint_id, epochs)
            data = dict(parts or {})
            for name, source in self.parts.items():
                got = source()
                data[name] = await got if isinstance(got, Awaitable) else got
            entries = {}
            for name, blob in data.items():
                entries[name] = await asyncio.to_thread(write_part, self.root, checkpoint_id,
                                                        name, blob)
            manifest = await asyncio.to_thread(
                write_job_manifest, self.root, checkpoint_id, step=step, num_shards=len(urls),
                parts=entries, extra={"ps_admin_urls": urls})
            if self.registry is not None:
                await self.registry.update_state(step=step, checkpoint=manifest,
                                                 dense_version=step)
            await asyncio.to_thread(prune_job_checkpoints, self.root, self.keep)
            self._last_step, self._last_time = step, time.monotonic()
        return manifest

    async def _ps_parts(self, urls: list[str], checkpoint_id: str, epochs: list[int]) -> None:
        """Every shard's part; a failure raises once every call has ended (a refusal,
        StaleEpoch, first), so no part is still being written when the checkpoint fails."""
        ended = await asyncio.gather(*(self._ps_part(u, checkpoint_id, e)
                                       for u, e in zip(urls, epochs, strict=True)),
                                     return_exceptions=True)
        errors = [e for e in ended if isinstance(e, BaseException)]
        refused = [e for e in errors if isinstance(e, StaleEpoch)]
        if errors:
            raise (refused or errors)[0]

    async def _ps_part(self, url: str, checkpoint_id: str, epoch: int) -> None:
        retrying = RetryPolicy(deadline_s=self.retry_s).begin(
            what=f"checkpoint {checkpoint_id} on PS shard {url}")
        while True:
            try:
                async with AdminClient(url) as client:
                    await client.checkpoint(checkpoint_id, epoch=epoch or None)
                return
            except AlreadyExists:
                if not retrying.failures:
                    raise
                return  # written before the shard died, its answer lost
            except (httpx.TransportError, Unavailable, Internal) as exc:
                # down, or unable to write now (e.g. its log's disk full): asked again
                error = exc
            try:
                await retrying.wait(error)
            except (httpx.TransportError, Unavailable, Internal) as exc:
                raise Unavailable(f"PS shard {url} did not take checkpoint "
                                  f"{checkpoint_id}: {exc}") from exc


class ConsistentCut:
    """One rank's side of the job's consistent cuts (see the module docstring).

    ``run`` names this incarnation of the job (the same on every rank, new at each restart),
    so a cut left half-done by a crash is never mistaken for a new one. ``positions``: where
    this incarnation started (the cut it resumed from). Rank 0 needs the ``checkpointer``.
    ``epochs``: this rank's PS client's epochs (e.g. ``lambda: client.epochs``), read after
    each drain; None: the cut carries the checkpointer's own.
    """

    def __init__(self, root: Path | str, *, rank: int, world: int, run: str,
                 checkpointer: JobCheckpointer | None = None,
                 positions: Mapping[str, int] | None = None,
                 loader_admin_url: str | None = None, timeout_s: float = 120.0,
                 epochs: Epochs | None = None) -> None:
        if not 0 <= rank < world:
            raise InvalidArgument(f"rank must be in [0, {world}), got {rank}")
        if rank == 0 and checkpointer is None:
            raise InvalidArgument("rank 0 writes the cuts: it needs a checkpointer")
        self.root = Path(root)
        self.rank, self.world, self.run = rank, world, run
        self.checkpointer = checkpointer
        self.positions = dict(positions or {})
        self.loader_admin_url = loader_admin_url
        self.timeout_s = timeout_s
        self.epochs = epochs

    def trained(self, positions: Mapping[str, tuple[int, int]]) -> None:
        """Count a trained batch's ``Batch.positions`` into this rank's positions."""
        advance(self.positions, positions)

    async def cut(self, step: int, *, drain: Callable[[], Awaitable[Any]],
                  dense: bytes | None = None) -> dict[str, Any] | None:
        """Cut the job at ``step`` (every rank at the same step, between two steps): drain
        this rank's pushes, meet the other ranks, and return the complete cut's manifest, or
        None where the cut was refused (a shard in another epoch than the ranks' pushes: see
        the module docstring); the caller goes on either way."""
        checkpoint_id = f"cut-{self.run}-{step:010d}"
        await drain()
        cut_dir = self.root / checkpoint_id
        ranks = cut_dir / "ranks"
        report: dict[str, Any] = {"positions": self.positions}
        if self.epochs is not None:
            report["epochs"] = list(self.epochs())
        body = json.dumps(report).encode()

        def publish() -> None:
            ranks.mkdir(parents=True, exist_ok=True)
            atomic_write(ranks / f"rank-{self.rank}.json", body)

        await asyncio.to_thread(publish)
        if self.rank != 0:
            await self._wait(lambda: any((cut_dir / name).is_file()
                                         for name in (JOB_MANIFEST, CUT_REFUSED)),
                             f"cut {checkpoint_id}: rank 0's manifest")
            if (cut_dir / CUT_REFUSED).is_file():
                return None
            return await asyncio.to_thread(read_job_manifest, self.root, checkpoint_id)
        files = [ranks / f"rank-{r}.json" for r in range(self.world)]
        await self._wait(lambda: all(f.is_file() for f in files),
                         f"cut {checkpoint_id}: every rank's positions")
        reports = [json.loads(f.read_bytes()) for f in files]
        assert self.checkpointer is not None
        parts = {POSITIONS_PART: encode_positions(merge(r["positions"] for r in reports))}
        if dense is not None:
            parts["dense"] = dense
        try:
            epochs = _agreed_epochs(checkpoint_id, reports)
            manifest = await self.checkpointer.checkpoint(step, checkpoint_id, parts=parts,
                                                          epochs=epochs)
        except StaleEpoch as exc:  # a failed cut: the ranks go on
            log.warning("%s", exc)
            refusal = json.dumps({"step": step, "error": str(exc)}).encode()
            await asyncio.to_thread(atomic_write, cut_dir / CUT_REFUSED, refusal)
            return None
        if self.loader_admin_url is not None:
            await self._commit_loader(checkpoint_id)
        return manifest

    async def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not await asyncio.to_thread(done):
            if time.monotonic() > deadline:
                raise Unavailable(f"{what} did not come within {self.timeout_s:.0f} s")
            await asyncio.sleep(0.005)

    async def _commit_loader(self, checkpoint_id: str) -> None:
        """Ask the loader to commit the cut's offsets (a failure is logged: the next cut
        commits later offsets, and a resume reads the cut, not the commits)."""
        try:
            await _loader_admin(str(self.loader_admin_url), "POST",
                                f"/v1/cuts/{checkpoint_id}/commit")
        except (httpx.HTTPError, PersimmonError) as exc:
            log.warning("committing cut %s to the loader failed: %s", checkpoint_id, exc)


def _agreed_epochs(checkpoint_id: str, reports: Sequence[Mapping[str, Any]]
                   ) -> list[int] | None:
    """Each shard's epoch every rank that names epochs pushed in (None: no rank names
    any); ranks that name different epochs for a shard refuse the cut (StaleEpoch)."""
    named = {rank: r["epochs"] for rank, r in enumerate(reports) if "epochs" in r}
    if not named:
        return None
    first = next(iter(named.values()))
    for k in range(max(len(e) for e in named.values())):
        seen = {rank: e[k] if k < len(e) else None for rank, e in named.items()}
        if len(set(seen.values())) > 1:
            each = ", ".join(f"rank {rank} in {epoch}" for rank, epoch in seen.items())
            raise StaleEpoch(f"cut {checkpoint_id} refused: the ranks pushed to PS shard {k} "
                             f"in different epochs ({each}); nothing written")
    return list(first)


def resume_state(root: Path | str) -> dict[str, Any] | None:
    """The dense state (model, optimizer, step) of the newest complete job checkpoint."""
    manifest = latest_complete(root)
    if manifest is None:
        return None
    return load_dense_part(read_part(root, manifest, "dense"))
