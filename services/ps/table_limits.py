"""The bounds a PS shard process puts on its tables (:class:`~services.ps.config.PSConfig`).

Every table of a shard process that sets no ``max_rows`` gets ``default_max_rows`` (rows past
it are evicted, least recently used first, as the store does for any ``max_rows``), so
lookups of ever new ids cannot grow a shard without bound. A table created over the admin API
is checked further before anything is allocated: ``dim`` at most ``max_table_dim``,
``initial_capacity`` at most ``max_initial_capacity``, and a disk tier's ``storage.path``
under the shard's ``data_dir`` (symlinks and ``..`` resolved). In-process shards (the
embedded mode, which nothing outside the process reaches) keep their tables as given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from services.common.config import from_dict
from services.common.errors import InvalidArgument
from services.ps.config import PSConfig
from services.ps.tables import StorageTier, TableConfig

__all__ = ["bounded", "new_table"]


def _with_default(table: TableConfig, default_max_rows: int) -> TableConfig:
    if table.max_rows is not None or default_max_rows == 0:
        return table
    return dataclasses.replace(table, max_rows=default_max_rows)


def bounded(config: PSConfig) -> PSConfig:
    """``config`` with ``default_max_rows`` given to each of its tables that sets none."""
    tables = [_with_default(t, config.default_max_rows) for t in config.tables]
    return dataclasses.replace(config, tables=tables)


def new_table(body: Any, config: PSConfig) -> TableConfig:
    """The table an admin request ``body`` asks for, checked against ``config``'s bounds
    (InvalidArgument naming the field) and given the default ``max_rows``."""
    if not isinstance(body, dict):
        raise InvalidArgument(f"a table must be a JSON object, got {type(body).__name__}")
    table = from_dict(TableConfig, body, where="table")
    if table.dim > config.max_table_dim:
        raise InvalidArgument(f"dim: {table.dim} exceeds this shard's limit of "
                              f"{config.max_table_dim} (max_table_dim)")
    if table.initial_capacity > config.max_initial_capacity:
        raise InvalidArgument(f"initial_capacity: {table.initial_capacity} rows exceed this "
                              f"shard's limit of {config.max_initial_capacity} "
                              "(max_initial_capacity); the table grows as rows come")
    if table.storage.tier is StorageTier.DISK:
        path = _under_data_dir(str(table.storage.path), config.data_dir)
        table = dataclasses.replace(table, storage=dataclasses.replace(
            table.storage, path=str(path)))
    return _with_default(table, config.default_max_rows)


def _under_data_dir(path: str, data_dir: str | None) -> Path:
    """``path`` resolved (relative: to ``data_dir``), which must lie under ``data_dir``."""
    if data_dir is None:
        raise InvalidArgument("storage.path: this shard has no data directory (data_dir), so "
                              "it creates no disk-tier tables over the admin API")
    root = Path(data_dir).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise InvalidArgument(f"storage.path: {path!r} resolves to {str(resolved)!r}, outside "
                              f"the shard's data directory {str(root)!r} (data_dir)")
    return resolved

