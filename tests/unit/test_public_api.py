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
        "AdminClient", "LoaderClient", "PSClient", "PSClientProcess", "PushAck",
        "SyncLoaderClient", "SyncPSClient",
    },
    "services.worker": {  # a script trains with these (RowsClient: a rows_client= of its own)
        "FitSummary", "LossCurve", "ModelConfig", "RowsClient", "SyncConfig", "SyncStrategy",
        "Trainer", "TrainerConfig", "make_sync", "ps_table_configs", "run_local_training",
    },
    "services.worker.embedding": {  # the worker's embedding side, for the code that builds one
        "EmbeddingLink", "EmbeddingPipeline", "Prepared", "RowsCapabilities", "RowsClient",
        "connect",
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
