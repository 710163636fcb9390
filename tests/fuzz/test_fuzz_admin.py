"""Schemathesis over the OpenAPI of every admin app: in process (ASGI) for the PS, the
loader and the worker, and against a live ``persimmon ps`` process. Every response must be
documented, match its schema and content type, and none may be a server error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from services.loader.admin import make_loader_admin
from services.loader.config import LoaderConfig
from services.loader.service import LoaderService
from services.ps.admin import make_ps_admin
from services.ps.config import PSConfig
from services.ps.metrics import PSMetrics
from services.ps.shard import Shard
from services.worker.admin import WorkerProgress, make_worker_admin
from tests.conftest import free_port
from tests.fuzz.cases import count_case
from tests.integration.ps.conftest import table_configs

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
EXAMPLES = int(os.environ.get("PERSIMMON_FUZZ_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def ps_schema(tmp_path_factory: pytest.TempPathFactory):
    config = PSConfig(tables=table_configs(), max_tables=64,
                      checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")))
    shard = Shard(config)
    app = make_ps_admin(shard, PSMetrics(shard), ready=lambda: True)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def loader_schema():
    config = LoaderConfig(source="synthetic:1000", grpc_port=0, admin_port=0, batch_size=100)
    loader = LoaderService(config)  # its pipeline, never started: the admin reads its state
    app = make_loader_admin(loader.pipeline, ready=lambda: True)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def worker_schema():
    progress = WorkerProgress(rank=0, world_size=2)
    progress.training()
    progress.record_step(samples=256, loss=0.69, staleness=1)
    progress.record_eval({"auc": 0.7, "logloss": 0.6})
    app = make_worker_admin(progress, config=lambda: {"mode": "hybrid"}, ready=lambda: True)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


ps_app = schemathesis.pytest.from_fixture("ps_schema")
loader_app = schemathesis.pytest.from_fixture("loader_schema")
worker_app = schemathesis.pytest.from_fixture("worker_schema")


@ps_app.parametrize()
@FUZZ
def test_ps_admin_asgi(case):
    count_case("schemathesis PS admin (ASGI)")
    case.call_and_validate(checks=CHECKS)


@loader_app.parametrize()
@FUZZ
def test_loader_admin_asgi(case):
    count_case("schemathesis loader admin (ASGI)")
    case.call_and_validate(checks=CHECKS)


@worker_app.parametrize()
@FUZZ
def test_worker_admin_asgi(case):
    count_case("schemathesis worker admin (ASGI)")
    case.call_and_validate(checks=CHECKS)


@pytest.fixture(scope="module")
def live_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``persimmon ps`` process with a token; yields its admin URL."""
    admin_port = free_port()
    env = {**os.environ, "PERSIMMON_TOKEN": "fuzz-token"}
    cmd = [sys.executable, "-m", "services.cli", "ps", "--grpc-port", str(free_port()),
           "--admin-port", str(admin_port), "--max-tables", "64",
           "--checkpoint-dir", str(tmp_path_factory.mktemp("live-ckpt"))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{admin_port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("PS did not start:\n" + (proc.stdout.read() or "")) from None
            time.sleep(0.1)
    yield url
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def live_schema(live_ps: str):
    return schemathesis.openapi.from_url(live_ps + "/openapi.json",
                                         headers={"Authorization": "Bearer fuzz-token"})


live = schemathesis.pytest.from_fixture("live_schema")


@live.parametrize()
@FUZZ
def test_ps_admin_live_with_token(case, live_ps):
    count_case("schemathesis live PS admin, token")
    case.call_and_validate(base_url=live_ps, headers={"Authorization": "Bearer fuzz-token"},
                           checks=CHECKS)


@live.parametrize()
@FUZZ
def test_ps_admin_live_without_token(case, live_ps):
    count_case("schemathesis live PS admin, no token")
    response = case.call_and_validate(base_url=live_ps, checks=CHECKS)
    if case.path not in ("/healthz", "/readyz", "/metrics"):
        assert response.status_code == 401
