"""The core install (no extra) runs a PS shard, a loader and the prediction server: in a
subprocess where torch, rich and matplotlib cannot be imported (a ``sys.meta_path`` finder
refuses them), the PS and loader services start on port 0, answer ``/healthz`` and close,
and their CLI entries (``persimmon ps``/``loader --check-config``) run; the server answers
predictions of a model version (written here, with torch) as the same version answers in
this process, and ``export`` (which reads torch weights) names the extra it needs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from services.loader import FeatureSpec
from services.ps.tables import TableConfig, initial_rows
from services.serve.export import write_version
from services.serve.predictor import Predictor
from services.serve.rows import TableRows
from services.worker.models import ModelConfig

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


SERVE = """
import asyncio
import json

import httpx

from services.common.errors import ConfigError
from services.ps.tables import TableConfig, initial_rows
from services.cli import main
from services.serve.__main__ import export_from_flags
from services.serve.config import ExportConfig, ServeConfig
from services.serve.service import ServeService


def rows(config, ids):
    return initial_rows(TableConfig(**config), ids)


async def serve():
    service = ServeService(ServeConfig(model_dir=MODELS, admin_port=0, grpc_port=0),
                           initial_rows=rows)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            reply = await http.post("/v1/predict", json={"records": RECORDS})
            reply.raise_for_status()
            print("answer:", json.dumps(reply.json()["probabilities"]))
    finally:
        await service.close()


asyncio.run(serve())
assert main(["serve", "--model-dir", MODELS, "--check-config"]) == 0
try:
    export_from_flags(ExportConfig(job_checkpoint="latest", checkpoint_dir=MODELS, out=MODELS,
                                   features="synthetic:10"), lambda root, ckpt: {})
except ConfigError as exc:
    print("export:", exc)
print("loaded extras:", sorted({m.partition(".")[0] for m in sys.modules} & EXTRAS))
"""


def test_the_server_answers_without_torch_rich_or_matplotlib(tmp_path: Path) -> None:
    spec = FeatureSpec(layout="json", dense=["x"], sparse=["b", "a"])
    config = ModelConfig(name="deepfm", deep_mlp=[8], id_weights=True, dense_norm=True)
    rng = np.random.default_rng(0)
    records = [{"x": float(rng.integers(0, 50)), "b": f"b{rng.integers(0, 9)}",
                "a": [f"a{k}" for k in rng.integers(0, 9, int(rng.integers(0, 3)))]}
               for _ in range(12)]
    features = spec.records(records)
    torch.manual_seed(0)
    model = config.build(sparse_dims={"b": 5, "a": 5}, num_dense=1)
    model({n: torch.ones(12, 5) for n in ("a", "b")}, torch.from_numpy(features.dense))
    tables = {}  # half the ids trained, half with their initial rows
    for n in ("a", "b"):
        ids = np.unique(features.sparse[n].values)[::2]
        tables[n] = TableRows(name=n, ids=ids, rows=rng.normal(size=(ids.size, 5)).astype(
            np.float32), config={"name": n, "dim": 5, "seed": 3})
    manifest = write_version(tmp_path, step=1, model=config, state=model.state_dict(),
                             features={"b": "b", "a": "a"}, num_dense=1, tables=tables,
                             spec=spec)
    here = Predictor.load(tmp_path / manifest["version_id"],
                          initial_rows=lambda c, ids: initial_rows(TableConfig(**c), ids))
    want = here.predict(here.featurize({"records": records}))
    out = _run(f"{BLOCKER}\nMODELS = {str(tmp_path)!r}\nRECORDS = {records!r}\n{SERVE}")
    assert out.returncode == 0, out.stderr[-4000:]
    answer = next(line for line in out.stdout.splitlines() if line.startswith("answer:"))
    np.testing.assert_allclose(json.loads(answer.partition(":")[2]), want, rtol=0, atol=1e-6)
    assert "install the train extra (pip install 'persimmon[train]')" in out.stdout
    assert "loaded extras: []" in out.stdout
