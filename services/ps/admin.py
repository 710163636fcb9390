"""Admin REST API of a PS shard (FastAPI): tables, rows, optimizer settings, checkpoints.

Each answer is a record of :mod:`services.common.admin_replies` (the one statement of its
shape, which :class:`clients.AdminClient` decodes), served as its plain JSON.

Every handler that touches a table runs in a worker thread, so a request that waits for a
table's lock (held by a checkpoint, a restore or a big push) leaves the event loop serving
gRPC and the other routes. A table created here is bounded first
(:func:`services.ps.table_limits.new_table`); after each checkpoint the shard's oldest are
pruned down to ``keep_checkpoints`` (:mod:`services.ps.retention`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path as FilePath
from typing import Annotated, Any

import msgspec
from fastapi import Body, FastAPI, Path, Response

from services.common.admin import ErrorBody, make_admin_app
from services.common.admin_replies import Restored, TableSummary
from services.common.config import config_to_dict
from services.common.errors import InvalidArgument
from services.common.messages import OptimizerInfo
from services.ps.metrics import PSMetrics
from services.ps.retention import prune_checkpoints
from services.ps.shard import Shard
from services.ps.table_limits import new_table
from services.ps.tables import OptimizerConfig

__all__ = ["make_ps_admin"]

TableName = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
RowId = Annotated[int, Path(ge=0, le=2**64 - 1, description="uint64 embedding id")]
CheckpointId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")]

_TABLE_EXAMPLE = {"name": "user", "dim": 16, "dtype": "float32", "initializer": "uniform",
                  "init_low": -0.01, "init_high": 0.01, "seed": 0,
                  "optimizer": {"kind": "adagrad", "lr": 0.05}, "max_rows": 1000000}
_ERRORS: dict[int | str, dict[str, Any]] = {400: ErrorBody, 404: ErrorBody, 409: ErrorBody,
                                            412: ErrorBody, 413: ErrorBody}


def _summary(shard: Shard, name: str) -> TableSummary:
    table = shard.table(name)
    return TableSummary(name=name, dim=table.config.dim, dtype=table.config.dtype,
                        rows=table.num_rows, optimizer=_optimizer(table.config.optimizer))


def _optimizer(config: OptimizerConfig) -> OptimizerInfo:
    return msgspec.convert(config_to_dict(config), OptimizerInfo)


def _json(record: Any) -> Any:
    """A record (or a list of them) as the plain JSON FastAPI sends."""
    return msgspec.to_builtins(record)


def make_ps_admin(shard: Shard, metrics: PSMetrics, *, ready: Any, lifespan: Any = None) -> FastAPI:
    app = make_admin_app(title=f"Persimmon PS shard {shard.config.shard_id}",
                         registry=metrics.registry, config=lambda: config_to_dict(shard.config),
                         ready=ready, lifespan=lifespan, open_reads=shard.config.admin_open_reads)

    @app.get("/v1/tables", tags=["tables"])
    async def list_tables() -> list[dict[str, Any]]:
        """Every table of this shard with its row count."""
        return _json(await asyncio.to_thread(
            lambda: [_summary(shard, name) for name in sorted(shard.tables)]))

    @app.post("/v1/tables", tags=["tables"], status_code=201, responses=_ERRORS)
    async def create_table(body: Annotated[dict[str, Any], Body(examples=[_TABLE_EXAMPLE])]
                           ) -> dict[str, Any]:
        """Create a table; unknown keys and bad values are a 400 naming the field (so are a
        ``dim`` or ``initial_capacity`` past the shard's bounds and a ``storage.path``
        outside its ``data_dir``), an existing name a 409."""
        def create() -> TableSummary:
            table = shard.create_table(new_table(body, shard.config))
            return _summary(shard, table.config.name)
        return _json(await asyncio.to_thread(create))

    @app.get("/v1/tables/{name}", tags=["tables"], responses=_ERRORS)
    async def get_table(name: TableName) -> dict[str, Any]:
        """The table's full configuration and statistics."""
        return _json(await asyncio.to_thread(shard.describe, name))

    @app.delete("/v1/tables/{name}", tags=["tables"], status_code=204, responses=_ERRORS)
    async def delete_table(name: TableName) -> Response:
        """Drop the table and all its rows."""
        await asyncio.to_thread(shard.drop_table, name)
        return Response(status_code=204)

    @app.get("/v1/tables/{name}/stats", tags=["tables"], responses=_ERRORS)
    async def table_stats(name: TableName) -> dict[str, Any]:
        """Rows, bytes, lookups, pushes, misses, evictions, dropped gradients."""
        return _json(await asyncio.to_thread(lambda: shard.table(name).stats()))

    @app.get("/v1/tables/{name}/rows/{row_id}", tags=["tables"], responses=_ERRORS)
    async def get_row(name: TableName, row_id: RowId) -> dict[str, Any]:
        """One row without creating or touching it (absent rows show their initial value)."""
        return _json(await asyncio.to_thread(shard.peek, name, row_id))

    @app.patch("/v1/tables/{name}/optimizer", tags=["tables"], responses=_ERRORS)
    async def patch_optimizer(name: TableName, body: Annotated[
            dict[str, Any], Body(examples=[{"lr": 0.05}])]) -> dict[str, Any]:
        """Change optimizer hyper-parameters (e.g. the learning rate); state is kept."""
        return _json(_optimizer(await asyncio.to_thread(shard.set_optimizer, name, body)))

    _checkpoint_routes(app, shard)
    return app


def _checkpoint_routes(app: FastAPI, shard: Shard) -> None:
    @app.post("/v1/checkpoints", tags=["checkpoints"], status_code=201, responses=_ERRORS)
    async def create_checkpoint(body: Annotated[dict[str, Any] | None, Body(
            examples=[{"id": "step-1000", "incremental": False}])] = None) -> dict[str, Any]:
        """Write an atomic checkpoint of every table (``incremental`` chains to the last one;
        ``epoch``: only while the shard is in that epoch, else 412 StaleEpoch)."""
        body = body or {}
        unknown = set(body) - {"id", "incremental", "epoch"}
        if unknown:
            raise InvalidArgument(f"unknown keys {sorted(unknown)}; "
                                  "known: ['epoch', 'id', 'incremental']")
        checkpoint_id = body.get("id")
        incremental = body.get("incremental", False)
        epoch = body.get("epoch")
        if epoch is not None and (type(epoch) is not int or epoch < 1):
            raise InvalidArgument(f"epoch must be an int >= 1, got {epoch!r}")
        if checkpoint_id is not None and not isinstance(checkpoint_id, str):
            raise InvalidArgument("id must be a string")
        if not isinstance(incremental, bool):
            raise InvalidArgument("incremental must be true or false")
        manifest = await shard.checkpoint(checkpoint_id, incremental=incremental, epoch=epoch)
        config = shard.config
        if config.checkpoint_dir and config.keep_checkpoints:
            await asyncio.to_thread(prune_checkpoints, FilePath(config.checkpoint_dir),
                                    config.shard_id, config.num_shards, config.keep_checkpoints)
        return _json(manifest)

    @app.get("/v1/checkpoints", tags=["checkpoints"])
    async def list_checkpoints() -> list[dict[str, Any]]:
        """Manifests of the checkpoints of this shard, oldest first."""
        return _json(await asyncio.to_thread(shard.checkpoints))

    @app.post("/v1/checkpoints/{checkpoint_id}/restore", tags=["checkpoints"], responses=_ERRORS)
    async def restore_checkpoint(checkpoint_id: CheckpointId) -> dict[str, Any]:
        """Replace every table with the checkpoint's rows (resharded if the shard count changed)."""
        rows = await shard.restore(checkpoint_id)  # in a new epoch: older pushes are refused
        return _json(Restored(checkpoint_id=checkpoint_id, rows=rows, epoch=shard.epoch))
