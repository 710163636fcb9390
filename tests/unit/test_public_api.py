"""The public API of ``clients`` and ``services.worker`` (what a user's script imports): each
package exports exactly the listed names, each resolves, and each comes from inside the
package (the model: httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

EXPORTED = {
    "clients": {
        "AdminClient", "DirectRows", "LoaderClient", "PSClient", "PSClientProcess", "ProcessCPU", "PushAck",
        "PushCounts", "RowsClient", "RowsReplica", "RowsSnapshots", "StatefulRows", "SyncLoaderClient",
        "SyncPSClient", "WarmRows",
    },
    "services.worker": {
        "BatchPlan", "EmbeddingPipeline", "FitSummary", "LossCurve", "ModelConfig", "Prepared",
        "SyncConfig", "SyncStrategy", "Trainer", "TrainerConfig", "make_sync", "plan_batch",
        "pool_batch", "ps_table_configs", "run_local_training",
    },
}


@pytest.mark.parametrize("package", sorted(EXPORTED))
def test_exported_members(package: str) -> None:
    module = importlib.import_module(package)
    exported = set(module.__all__)
    assert exported == EXPORTED[package]
    assert len(module.__all__) == len(exported) and module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        member = getattr(module, name)
        home = getattr(member, "__module__", None)
        assert home == package or (home or "").startswith(package + "."), (name, home)
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        module.Nope  # noqa: B018


def test_the_clients_do_not_import_torch() -> None:
    code = ("import sys, clients; [getattr(clients, n) for n in clients.__all__]; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_rows_client_implementation_is_one() -> None:
    from clients import (
        DirectRows,
        ProcessCPU,
        PSClient,
        PSClientProcess,
        RowsClient,
        RowsReplica,
        RowsSnapshots,
        StatefulRows,
        WarmRows,
    )
    from services.ps.inprocess import InProcessShards

    in_process = InProcessShards([{"name": "t", "dim": 4}])
    remote = (PSClient(["127.0.0.1:1"]), PSClientProcess(["127.0.0.1:1"]))
    for client in (*remote, in_process):
        assert isinstance(client, RowsClient), type(client)
    assert isinstance(PSClientProcess(["127.0.0.1:1"]), ProcessCPU)
    assert not isinstance(in_process, ProcessCPU) and not isinstance(object(), RowsClient)
    assert isinstance(in_process, DirectRows) and in_process.direct  # rows in this process
    assert not any(isinstance(client, DirectRows) for client in remote)
    assert isinstance(in_process, WarmRows)  # its kernels run in this process
    assert not any(isinstance(client, WarmRows) for client in remote)
    assert isinstance(in_process, RowsSnapshots)  # keep_best's snapshots of the rows
    assert not any(isinstance(client, RowsSnapshots) for client in remote)
    for client in (*remote, in_process):  # a replica of the head rows can start from each
        assert isinstance(client, StatefulRows), type(client)
    assert not isinstance(object(), StatefulRows)
    from services.ps.replica import HeadReplica
    assert isinstance(HeadReplica(), RowsReplica) and not isinstance(in_process, RowsReplica)
