"""The RowsClient port of the worker's embedding side: every implementation matches it by shape,
and :class:`RowsCapabilities` reads once what each can do beyond it."""

from __future__ import annotations

from clients import PSClient, PSClientProcess
from services.ps.inprocess import InProcessShards
from services.ps.replica import HeadReplica
from services.worker.embedding.rows import (
    DirectRows,
    ProcessCPU,
    RowsCapabilities,
    RowsClient,
    RowsReplica,
    RowsSnapshots,
    StatefulRows,
    WarmRows,
)


def test_every_rows_client_implementation_is_one() -> None:
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
    assert isinstance(HeadReplica(), RowsReplica) and not isinstance(in_process, RowsReplica)


def test_capabilities_are_read_once_into_one_record() -> None:
    in_process = InProcessShards([{"name": "t", "dim": 4}])
    local = RowsCapabilities.of(in_process)
    assert local.direct is in_process and local.warm is in_process
    assert local.snapshots is in_process and local.stateful is in_process
    assert local.process_cpu is None
    process = PSClientProcess(["127.0.0.1:1"])
    remote = RowsCapabilities.of(process)
    assert remote.process_cpu is process and remote.stateful is process
    assert remote.direct is remote.warm is remote.snapshots is None
