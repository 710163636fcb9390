"""Wire-level clients any program uses: the PS (async, blocking, in a child process), the
loader, the admin REST APIs, and the :class:`RowsClient` protocol a training step talks to.

Usage::

    from clients import PSClient

    async with PSClient(["127.0.0.1:50051"]) as ps:
        rows = await ps.lookup("C1", ids)

Names load on first use (no client module is imported before it is needed; none imports
torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy import lazy_exports

if TYPE_CHECKING:
    from clients.admin_client import AdminClient
    from clients.loader_client import LoaderClient, SyncLoaderClient
    from clients.ps_client import PSClient, PushAck
    from clients.ps_process import PSClientProcess
    from clients.rows import (
        DirectRows,
        ProcessCPU,
        PushCounts,
        RowsClient,
        RowsReplica,
        RowsSnapshots,
        StatefulRows,
        WarmRows,
    )
    from clients.sync_ps_client import SyncPSClient

__all__ = [
    "AdminClient",
    "DirectRows",
    "LoaderClient",
    "PSClient",
    "PSClientProcess",
    "ProcessCPU",
    "PushAck",
    "PushCounts",
    "RowsClient",
    "RowsReplica",
    "RowsSnapshots",
    "StatefulRows",
    "SyncLoaderClient",
    "SyncPSClient",
    "WarmRows",
]

_HOME = {
    "AdminClient": "admin_client", "DirectRows": "rows", "LoaderClient": "loader_client", "PSClient": "ps_client",
    "PSClientProcess": "ps_process", "ProcessCPU": "rows", "PushAck": "ps_client",
    "PushCounts": "rows", "RowsClient": "rows", "RowsReplica": "rows", "RowsSnapshots": "rows",
    "StatefulRows": "rows",
    "SyncLoaderClient": "loader_client",
    "SyncPSClient": "sync_ps_client",
    "WarmRows": "rows",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOME)
