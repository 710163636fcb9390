"""The layering rule of DESIGN.md: services/common ← clients ← services/worker; services never
import each other; clients never import a service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("ps", "worker", "loader")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def owner(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "clients":
        return "clients"
    if parts[0] == "services" and len(parts) > 1 and parts[1] in (*SERVICES, "common"):
        return parts[1]
    return None


def allowed(layer: str) -> set[str]:
    if layer == "common":
        return {"common"}
    if layer == "clients":
        return {"common", "clients"}
    if layer == "worker":
        return {"common", "clients", "worker"}
    return {"common", layer}




def modules_of(layer: str) -> list[Path]:
    folder = ROOT / ("clients" if layer == "clients" else f"services/{layer}")
    return sorted(folder.rglob("*.py"))


@pytest.mark.parametrize("layer", ["common", "clients", *SERVICES])
def test_layer_imports_only_what_it_may(layer):
    files = modules_of(layer)
    if layer in ("common", "clients", "ps"):
        assert files, f"no modules found for {layer}"
    bad = []
    for path in files:
        for module in imports_of(path):
            other = owner(module)
            if other is not None and other not in allowed(layer):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "layering violations:\n" + "\n".join(bad)
