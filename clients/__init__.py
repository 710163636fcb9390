"""Wire-level clients any program uses: the PS (async, blocking, in a child process), the
loader and the admin REST APIs (the ``RowsClient`` port they fit is the worker's,
:mod:`services.worker.embedding.rows`).

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
    from clients.sync_ps_client import SyncPSClient

__all__ = [
    "AdminClient",
    "LoaderClient",
    "PSClient",
    "PSClientProcess",
    "PushAck",
    "SyncLoaderClient",
    "SyncPSClient",
]

_HOME = {
    "AdminClient": "admin_client", "LoaderClient": "loader_client", "PSClient": "ps_client",
    "PSClientProcess": "ps_process", "PushAck": "ps_client", "SyncLoaderClient": "loader_client",
    "SyncPSClient": "sync_ps_client",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOME)
