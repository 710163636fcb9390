"""The prediction server's Kubernetes Deployment and Service (deploy/k8s/serve.yaml; the
schema check of every manifest is tests/unit/cluster/test_k8s.py): its args are a valid
``persimmon serve`` command, and the ports, probes and model directory agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.cli import main

REPO = Path(__file__).resolve().parents[3]


def test_serve_deployment_and_service_agree(capsys: pytest.CaptureFixture[str]) -> None:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "serve.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert main([*args, "--check-config"]) == 0, capsys.readouterr().err
    flag = {name: args[args.index(name) + 1] for name in
            ("--model-dir", "--admin-port", "--grpc-port")}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(flag["--admin-port"]), "grpc": int(flag["--grpc-port"])}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    (mount,) = container["volumeMounts"]
    assert flag["--model-dir"].startswith(mount["mountPath"] + "/")
