"""The layering rule of docs/design.md, over every module of ``services/`` and ``clients/``.

``services/common`` ← ``clients`` ← ``services/worker``, ``services/serve``; ``services/ps`` and
``services/loader`` stand on ``services/common``; services never import each other (the one
exception: ``services/serve`` uses the worker's and the loader's public API); ``services/local``
(one-machine orchestration) and the CLI (``services/cli.py``) sit on top. Nothing under
``services/`` or ``clients/`` imports the CLI but the CLI itself, nor the benchmarks
(``bench/`` is not packaged). Every module has an owner layer: a new folder needs a rule here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("ps", "loader", "worker", "serve")

# layer -> the layers its modules may import
RULES: dict[str, set[str]] = {
    "common": {"common"},
    "clients": {"common", "clients"},
    "ps": {"common", "ps"},
    "loader": {"common", "loader"},
    "worker": {"common", "clients", "worker"},
    "serve": {"common", "clients", "serve", "worker", "loader"},
    "local": {"common", "clients", "ps", "loader", "worker", "serve", "local"},
    "cli": {"common", "clients", "ps", "loader", "worker", "serve", "local", "cli"},
}


def layer_of_module(module: str) -> str | None:
    """The layer that owns dotted ``module``; None outside the project (numpy, torch ...)."""
    parts = module.split(".")
    if parts[0] == "clients":
        return "clients"
    if parts[0] == "bench":
        return "bench"
    if parts[0] != "services":
        return None
    if len(parts) == 1 or parts[1] in ("cli", "__main__"):
        return "cli"
    if parts[1] in (*SERVICES, "common", "local"):
        return parts[1]
    return "unowned"


def layer_of_file(path: Path) -> str | None:
    rel = path.relative_to(ROOT).with_suffix("")
    module = ".".join(p for p in rel.parts if p != "__init__") or rel.parts[0]
    layer = layer_of_module(module)
    return None if layer == "unowned" else layer


def module_files() -> list[Path]:
    return sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "clients").rglob("*.py")])


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(ROOT).parent.parts
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                found.add(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module:
                found.add(node.module)
    return found


def test_every_module_has_an_owner_layer() -> None:
    files = module_files()
    assert len(files) > 50, "the services and clients folders were not found"
    orphans = [str(p.relative_to(ROOT)) for p in files if layer_of_file(p) not in RULES]
    assert not orphans, ("modules with no owner layer (add their folder to the rules of "
                         "tests/unit/test_layering.py and docs/design.md):\n" + "\n".join(orphans))


def test_every_layer_has_modules() -> None:
    present = {layer_of_file(p) for p in module_files()}
    missing = {"common", "clients", "ps", "loader", "worker", "local", "cli"} - present
    assert not missing, f"no modules found for {sorted(missing)}"


@pytest.mark.parametrize("layer", list(RULES))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    bad = []
    for path in module_files():
        if layer_of_file(path) != layer:
            continue
        for module in sorted(imports_of(path)):
            other = layer_of_module(module)
            if other is not None and other not in RULES[layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {module} ({other})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_rules_themselves() -> None:
    """Services never import each other (serve excepted), nor the CLI, local or bench."""
    for service in ("ps", "loader", "worker"):
        assert RULES[service] & {*SERVICES, "local", "cli"} == {service}
    for layer, allowed in RULES.items():
        assert "bench" not in allowed
        if layer != "cli":
            assert "cli" not in allowed
        if layer not in ("local", "cli"):
            assert "local" not in allowed


def test_owner_of_a_module() -> None:
    assert layer_of_module("services.common.checkpoints.jobs") == "common"
    assert layer_of_module("services.cli") == "cli"
    assert layer_of_module("services.local.processes") == "local"
    assert layer_of_module("services.worker.__main__") == "worker"
    assert layer_of_module("services.cluster.job") == "unowned"
    assert layer_of_module("bench.train") == "bench"
    assert layer_of_module("numpy") is None


def test_benchmarks_use_public_names_only() -> None:
    """``bench/`` imports no private module or name of ``services`` and ``clients``."""
    bad = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules, names = [node.module], [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names], []
            else:
                continue
            for module in modules:
                if layer_of_module(module) in (None, "bench"):
                    continue
                private = [p for p in [*module.split("."), *names]
                           if p.startswith("_") and not p.endswith("__")]
                if private:
                    bad.append(f"{path.relative_to(ROOT)}: {module} {private}")
    assert not bad, "benchmarks using private names:\n" + "\n".join(bad)


def test_tests_use_no_private_bench_helpers() -> None:
    """Tests may smoke-run a benchmark, through its public names only."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == "bench":
                bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
    assert not bad, "tests importing private bench helpers:\n" + "\n".join(bad)
