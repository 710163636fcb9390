"""The core install (no extra) runs a PS shard and a loader: in a subprocess where torch,
rich and matplotlib cannot be imported (a ``sys.meta_path`` finder refuses them), the PS
and loader services start on port 0, answer ``/healthz`` and close, and their CLI entries
(``persimmon ps``/``loader --check-config``) run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

BLOCKER = """
import sys

EXTRAS = {"torch", "rich", "matplotlib"}


class RefuseExtras:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in EXTRAS:
            raise ImportError(f"{name} belongs to an extra, not the core install")
        return None


sys.meta_path.insert(0, RefuseExtras())
"""

ROLES = """
import asyncio

import httpx

from services.cli import main
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from services.ps.config import PSConfig
from services.ps.tables import TableConfig
from services.ps.service import PSService


async def run_roles():
    ps = PSService(PSConfig(grpc_port=0, admin_port=0, tables=[TableConfig(name="t", dim=4)]))
    await ps.start()
    loader = LoaderService(LoaderConfig(source="synthetic:200", grpc_port=0, admin_port=0))
    await loader.start()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            for url in (ps.admin_url, loader.admin_url):
                (await http.get(f"{url}/healthz")).raise_for_status()
    finally:
        await loader.close()
        await ps.close()


asyncio.run(run_roles())
assert main(["ps", "--check-config"]) == 0
assert main(["loader", "--source", "synthetic:10", "--check-config"]) == 0
print("loaded extras:", sorted({m.partition(".")[0] for m in sys.modules} & EXTRAS))
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_the_blocker_refuses_an_extra() -> None:
    """The finder works: importing torch under it fails (else the test below proves nothing)."""
    out = _run(BLOCKER + "import torch\n")
    assert out.returncode != 0
    assert "torch belongs to an extra" in out.stderr


def test_ps_and_loader_run_without_torch_rich_or_matplotlib() -> None:
    out = _run(BLOCKER + ROLES)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "loaded extras: []" in out.stdout
