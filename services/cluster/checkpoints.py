"""The job checkpoint coordinator: every PS shard's part, then the job's own parts (dense model
and optimizer state, loader offsets), then the manifest that marks the whole complete.

One process coordinates (rank 0 of the workers): :meth:`JobCheckpointer.checkpoint` asks each
PS shard over its admin REST API to write its part under the shared id, writes the given job
parts, then :func:`services.common.jobs.write_job_manifest` checks that everything is on disk
and marks the checkpoint complete; the manifest is published as the job state in the registry.
A crash at any step leaves an incomplete checkpoint that restore never picks.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from clients.admin_client import AdminClient
from services.common.errors import InvalidArgument, error_from_http
from services.common.jobs import write_job_manifest, write_part
from services.common.registry import Registry, discover_shards

__all__ = ["JobCheckpointer", "dense_part", "load_dense_part", "loader_offsets_part"]

PartSource = Callable[[], bytes | Awaitable[bytes]]


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
        async with httpx.AsyncClient(base_url=admin_url, timeout=30.0) as http:
            response = await http.get("/v1/offsets")
        if response.status_code != 200:
            raise error_from_http(response.status_code, response.json())
        return json.dumps(response.json(), sort_keys=True).encode()
    return read


class JobCheckpointer:
    """Writes job checkpoints under ``root`` (the directory every PS shard checkpoints into).

    PS shards are reached at ``admin_urls`` or, when None, found in ``registry``. ``parts``
    maps a part name to a source of its bytes, read at each checkpoint. Periodic checkpoints:
    :meth:`due` is true every ``every_steps`` steps or ``every_s`` seconds (0: never).
    """

    def __init__(self, root: Path | str, *, admin_urls: Sequence[str] | None = None,
                 registry: Registry | None = None, parts: Mapping[str, PartSource] | None = None,
                 every_steps: int = 0, every_s: float = 0.0) -> None:
        if admin_urls is None and registry is None:
            raise InvalidArgument("a JobCheckpointer needs PS admin URLs or a registry")
        if every_steps < 0 or every_s < 0:
            raise InvalidArgument("every_steps and every_s must be >= 0")
        self.root = Path(root)
        self.admin_urls = list(admin_urls) if admin_urls is not None else None
        self.registry = registry
        self.parts = dict(parts or {})
        self.every_steps = every_steps
        self.every_s = every_s
        self._last_step = 0
        self._last_time = time.monotonic()
        self._lock = asyncio.Lock()

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

    async def checkpoint(self, step: int, checkpoint_id: str | None = None,
                         parts: Mapping[str, bytes] | None = None) -> dict[str, Any]:
        """Write a complete job checkpoint of ``step``; returns its manifest.

        ``parts`` are bytes captured by the caller (e.g. the dense state at ``step``); they
        are written along with the configured part sources.
        """
        checkpoint_id = checkpoint_id or f"step-{step:010d}-{uuid.uuid4().hex[:6]}"
        async with self._lock:
            urls = await self._ps_admin_urls()

            async def ps_part(url: str) -> dict[str, Any]:
                async with AdminClient(url) as client:
                    return await client.checkpoint(checkpoint_id)

            await asyncio.gather(*(ps_part(u) for u in urls))
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
            self._last_step, self._last_time = step, time.monotonic()
        return manifest
