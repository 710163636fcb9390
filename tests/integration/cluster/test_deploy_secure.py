"""The shipped deployments start secure: compose.yaml needs a token (`up` fails clearly
without one) and gives it to every Persimmon service, publishes nothing but on loopback and
no PS or loader admin port, and runs each shard with a write-ahead log on its own volume; the
Kubernetes manifests take the token from a Secret in every pod, keep admin ports off
NodePort/LoadBalancer services, and run each shard with a write-ahead log on its own claim."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.cluster.test_compose import PERSIMMON_SERVICES, TOKEN, compose

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
ADMIN_PORTS = {8071, 8075, 8081, 8090, 8091}


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    import json

    done = compose("config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compose_without_a_token_fails_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = compose("config", "--quiet", token=None, env_file=empty)
    assert done.returncode != 0
    assert "PERSIMMON_TOKEN" in done.stderr and "persimmon token --env-file .env" in done.stderr


def test_compose_takes_the_token_from_an_env_file(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("PERSIMMON_TOKEN=from-the-env-file\n")
    done = compose("config", "--format", "json", token=None, env_file=env)
    assert done.returncode == 0, done.stderr
    assert '"PERSIMMON_TOKEN": "from-the-env-file"' in done.stdout


def test_every_persimmon_service_gets_the_token(model: dict[str, Any]) -> None:
    for name in PERSIMMON_SERVICES:
        assert model["services"][name]["environment"]["PERSIMMON_TOKEN"] == TOKEN, name


def test_compose_publishes_on_loopback_only_and_no_shard_or_loader_admin(
        model: dict[str, Any]) -> None:
    for name, service in model["services"].items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", (name, port)
    for name in ("ps-0", "ps-1", "loader", "redis", "kafka"):
        assert not model["services"][name].get("ports"), name


def test_compose_shards_keep_a_write_ahead_log_on_their_own_volume(
        model: dict[str, Any]) -> None:
    volumes = set()
    for name in ("ps-0", "ps-1"):
        service = model["services"][name]
        command = service["command"]
        wal = command[command.index("--wal-dir") + 1]
        (mount,) = [v for v in service["volumes"] if v["target"] == wal]
        assert mount["type"] == "volume"
        volumes.add(mount["source"])
        assert "--restore" not in command  # a restart recovers from the log, not a rollback
    assert len(volumes) == 2
    worker = model["services"]["worker-0"]["command"]
    assert int(worker[worker.index("--keep-checkpoints") + 1]) > 0


def _k8s() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _pod_specs() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in _k8s()
            if d["kind"] in ("StatefulSet", "Deployment", "Job")
            and d["metadata"]["labels"].get("app.kubernetes.io/part-of") == "persimmon"
            and d["metadata"]["name"].startswith("persimmon-")}


def test_every_k8s_pod_takes_the_token_from_the_secret() -> None:
    pods = _pod_specs()
    assert {"persimmon-ps", "persimmon-loader", "persimmon-workers", "persimmon-serve"} <= set(pods)
    for name, spec in pods.items():
        for container in spec["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            ref = env["PERSIMMON_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "persimmon-token", "key": "token"}, (name, ref)
            assert ref.get("optional") is not True


def test_k8s_admin_ports_stay_on_the_pod_network() -> None:
    for doc in _k8s():
        if doc["kind"] != "Service":
            continue
        kind = doc["spec"].get("type", "ClusterIP")
        ports = {p["port"] for p in doc["spec"]["ports"]}
        if kind in ("NodePort", "LoadBalancer"):
            assert not ports & ADMIN_PORTS, doc["metadata"]["name"]
        assert not doc["spec"].get("externalIPs"), doc["metadata"]["name"]


def test_k8s_shards_keep_a_write_ahead_log_on_their_own_claim() -> None:
    (ps,) = [d for d in _k8s() if d["kind"] == "StatefulSet"]
    (container,) = ps["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    wal = args[args.index("--wal-dir") + 1]
    assert "--restore" not in args
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == wal]
    claims = {c["metadata"]["name"] for c in ps["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims  # one claim per pod: each shard its own log
