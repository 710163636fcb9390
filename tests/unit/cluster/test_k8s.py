"""deploy/k8s validated against the Kubernetes OpenAPI schemas shipped in the
kubernetes-validate package (strict: unknown fields are errors), and checked for the pieces
the cluster needs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
VERSION = "1.30.0"


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in manifests() if d["kind"] == kind]


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_matches_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


@pytest.mark.parametrize("breakage", ["replicas as text", "unknown field", "no containers"])
def test_broken_manifest_is_rejected(breakage: str) -> None:
    (ps,) = by_kind("StatefulSet")
    broken = copy.deepcopy(ps)
    spec = broken["spec"]
    if breakage == "replicas as text":
        spec["replicas"] = "two"
    elif breakage == "unknown field":
        spec["template"]["spec"]["containers"][0]["comand"] = ["persimmon"]
    else:
        del spec["template"]["spec"]["containers"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_the_cluster_pieces_are_there() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests()}
    assert {("StatefulSet", "persimmon-ps"), ("Job", "persimmon-workers"),
            ("Deployment", "persimmon-loader"), ("Service", "persimmon-ps"),
            ("Service", "persimmon-loader"), ("Service", "redis"),
            ("ConfigMap", "persimmon-config")} <= kinds
    (ps,) = by_kind("StatefulSet")
    (container,) = ps["spec"]["template"]["spec"]["containers"]
    assert ps["spec"]["replicas"] == int(container["args"][container["args"].index(
        "--num-shards") + 1])
    (job,) = by_kind("Job")
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    assert worker["command"] == ["torchrun"]
    assert job["spec"]["completions"] == 2 and job["spec"]["completionMode"] == "Indexed"


def test_configmap_tables_match_deploy_ps_yaml() -> None:
    (config,) = by_kind("ConfigMap")
    shared = yaml.safe_load((REPO / "deploy" / "ps.yaml").read_text())
    assert yaml.safe_load(config["data"]["ps.yaml"]) == shared
    assert config["data"]["registry"].startswith("redis://redis:6379/")
