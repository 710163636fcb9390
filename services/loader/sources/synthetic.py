"""``synthetic:ROWS``: the planted data set generated in memory, chunk by chunk.

``?profile=toy|criteo`` picks the data set (``&max_vocab=N&zipf=X`` shape the criteo one;
see :func:`services.loader.planted.synthetic_profile`), ``?split=train|test|validation`` the split.

Positions are row numbers of the split; a partition is one split in one epoch
(``synthetic:e0:train``). Chunks are split among loader replicas (chunk k goes to replica
``k % replicas``), and with a ``state_file`` committed chunks are skipped after a restart.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import ConfigError
from services.loader.batching import Settled
from services.loader.config import LoaderConfig, SourceSpec
from services.loader.planted import (
    CHUNK_ROWS,
    SyntheticConfig,
    SyntheticDataset,
    synthetic_profile,
)
from services.loader.sources.base import SourceBlock, StateFile

__all__ = ["SyntheticSource", "synthetic_config_of"]


def synthetic_config_of(spec: SourceSpec, seed: int) -> SyntheticConfig:
    """The planted data set a ``synthetic:`` spec names (its profile, max_vocab, zipf)."""
    zipf = spec.params.get("zipf")
    try:
        exponent = float(zipf) if zipf else None
    except ValueError as exc:
        raise ConfigError(f"source parameter zipf={zipf!r} must be a number") from exc
    return synthetic_profile(spec.params.get("profile") or "toy", seed=seed,
                             max_vocab=spec.int_param("max_vocab", 1_000_000), zipf=exponent)


class SyntheticSource:
    def __init__(self, spec: SourceSpec, config: LoaderConfig,
                 synthetic: SyntheticConfig | None = None) -> None:
        self.spec = spec
        self.config = config
        self.rows = spec.rows()
        self.split = spec.params.get("split", "train")
        if self.split not in ("train", "test", "validation"):
            raise ConfigError(f"synthetic split must be train, test or validation, got "
                              f"{self.split!r}")
        self.dataset = SyntheticDataset(synthetic or synthetic_config_of(spec, config.seed))
        self.dataset.transform = config.dense_transform()
        self.schema = self.dataset.layout.schema
        self.state = StateFile(config.state_file, spec.text)
        self.records = 0
        self._read: dict[str, int] = {}

    async def start(self) -> None:
        """Nothing to open."""

    def _block(self, partition: str, k: int) -> SourceBlock:
        rows = self.dataset.rows(self.split, k)
        take = min(CHUNK_ROWS, self.rows - k * CHUNK_ROWS)
        if take < rows.size:
            rows = rows.slice(0, take)
        first = k * CHUNK_ROWS
        return SourceBlock(partition=partition, first=first, last=first + take - 1,
                           labels=rows.labels, dense=rows.dense, sparse=rows.sparse,
                           positions=rows.positions,
                           meta={"line": first + take, "done": False})

    async def blocks(self) -> AsyncIterator[SourceBlock]:
        chunks = range(self.config.replica, math.ceil(self.rows / CHUNK_ROWS),
                       self.config.replicas)
        for epoch in range(self.config.epochs):
            partition = f"synthetic:e{epoch}:{self.split}"
            saved = self.state.get(partition) or {}
            if saved.get("done"):
                continue
            todo = [k for k in chunks if (k + 1) * CHUNK_ROWS > int(saved.get("line", 0))]
            for i, k in enumerate(todo):
                block = await asyncio.to_thread(self._block, partition, k)
                block.meta["done"] = i == len(todo) - 1
                self.records += block.size
                self._read[partition] = block.last + 1
                yield block

    async def commit(self, settled: Settled) -> None:
        if not settled.advanced:
            return
        for partition, chunk in settled.advanced.items():
            self.state.update(partition, **chunk.meta)
        await self.state.save()

    async def dead_letter(self, block: SourceBlock) -> None:
        """Generated data has no malformed records."""

    def offsets(self) -> dict[str, dict[str, Any]]:
        out = {}
        for partition in {*self.state.partitions, *self._read}:
            saved = self.state.get(partition) or {}
            out[partition] = {"committed": saved.get("line", 0),
                              "read": self._read.get(partition, saved.get("line", 0)),
                              "done": bool(saved.get("done")), "lag": None}
        return out

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec.text, "kind": "synthetic", "rows": self.rows,
                "split": self.split, "records": self.records, "malformed": 0,
                "oracle_hint": "persimmon synth writes the oracle AUC/logloss",
                **self.schema.describe()}

    async def close(self) -> None:
        """Nothing to release."""
