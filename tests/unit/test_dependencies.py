"""Declared dependencies match the imports: every third-party module that ``services/`` or
``clients/`` imports (at the top or lazily, inside a function) belongs to a distribution
pyproject.toml declares, in ``dependencies`` or in a role's extra (not ``dev``: the tests'
tools are not the code's dependencies)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = {"services", "clients"}


def imported_modules(roots: Iterable[Path]) -> dict[str, str]:
    """Top-level module → the first file importing it, over every ``.py`` under ``roots``
    (stdlib, relative imports and the project's own packages left out)."""
    found: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN | {"__future__"}:
                        found.setdefault(top, str(path.relative_to(root.parent)))
    return found


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict) -> set[str]:
    """Distributions named in ``dependencies`` and every extra but ``dev`` (canonical)."""
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    for extra, items in project.get("optional-dependencies", {}).items():
        if extra != "dev":
            reqs += items
    return {canonical(re.match(r"[A-Za-z0-9._-]+", req).group()) for req in reqs}


def undeclared(modules: dict[str, str], names: set[str],
               owners: dict[str, list[str]]) -> list[str]:
    """One line per imported module none of whose distributions is in ``names``."""
    out = []
    for module, where in sorted(modules.items()):
        dists = owners.get(module, [])
        if not {canonical(d) for d in dists} & names:
            out.append(f"{module} (imported in {where}; distribution "
                       f"{', '.join(dists) or 'not installed here'}) is not declared")
    return out


def test_every_imported_distribution_is_declared() -> None:
    modules = imported_modules([ROOT / "services", ROOT / "clients"])
    assert {"numpy", "grpc", "torch"} <= modules.keys()  # the walk sees imports, lazy ones too
    names = declared(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    problems = undeclared(modules, names, importlib.metadata.packages_distributions())
    assert not problems, "\n".join(problems)


def test_an_undeclared_import_is_named(tmp_path: Path) -> None:
    """The check fails on an import pyproject does not declare, naming module and file."""
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "mod.py").write_text(
        "import json\nfrom . import sibling\n\ndef f():\n    import yaml.loader\n"
        "    from numpy import ndarray\n")
    modules = imported_modules([tmp_path / "services"])
    assert modules == {"yaml": "services/mod.py", "numpy": "services/mod.py"}
    owners = {"yaml": ["PyYAML"], "numpy": ["numpy"]}
    assert undeclared(modules, {"numpy"}, owners) == [
        "yaml (imported in services/mod.py; distribution PyYAML) is not declared"]
    assert undeclared(modules, {"numpy", "pyyaml"}, owners) == []


def test_dev_alone_does_not_declare() -> None:
    """A distribution only the dev extra lists does not count as the code's dependency."""
    pyproject = {"project": {"dependencies": ["numpy>=1"],
                             "optional-dependencies": {"train": ["torch>=2,<3"],
                                                       "dev": ["pytest>=8"]}}}
    assert declared(pyproject) == {"numpy", "torch"}
