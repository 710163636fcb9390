"""The docs show code that works: every ```python block of README.md and docs/*.md runs.

Each block runs as a script in a fresh interpreter (the way a user runs one), in an empty
temporary directory, with a deadline; it passes when it exits 0 and, where the text after it
says "It prints `X...`", its output holds X. A block is skipped only when
the line just before its fence is ``<!-- not-run -->`` (kept for the few that need a cluster).
Also checked, so that docs and code cannot drift apart: a ```yaml block of PS ``tables`` is
a config ``persimmon ps --check-config`` accepts; every ``persimmon``/``python -m bench``
command of a ```bash block parses; relative links, repository paths and dotted Python names
resolve; and the README's test command is ``.ci/run``'s.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not-run -->"
DEADLINE_S = 240

_FENCE = re.compile(r"^```(\w*)\s*$")
_PRINTS = re.compile(r"^It prints `([^`]+)`")


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skipped: bool
    prints: str | None = None  # "It prints `X...`" just after the block: the output holds X

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed code fence")
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        after = next((line.strip() for line in lines[end + 1:] if line.strip()), "")
        prints = _PRINTS.match(after)
        blocks.append(Block(path, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                            before == NOT_RUN, prints.group(1).rstrip(". ") if prints else None))
        i = end + 1
    return blocks


PYTHON = [b for path in DOCS for b in code_blocks(path) if b.lang == "python"]


def test_the_docs_have_examples_and_few_are_skipped() -> None:
    assert any(b.path.name == "README.md" and not b.skipped for b in PYTHON)
    skipped = [b.name for b in PYTHON if b.skipped]
    assert len(skipped) <= len(PYTHON) // 2, f"most examples are marked not-run: {skipped}"


@pytest.mark.parametrize("block", [b for b in PYTHON if not b.skipped], ids=lambda b: b.name)
def test_python_example_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{block.name}: still running after {DEADLINE_S} s\n"
                             f"{exc.stdout or ''}{exc.stderr or ''}") from exc
    assert done.returncode == 0, (f"{block.name} exited {done.returncode}\n"
                                  f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    if block.prints:
        assert block.prints in done.stdout, (f"{block.name}: the docs say it prints "
                                             f"{block.prints!r}...; it printed {done.stdout!r}")


PS_YAML = [b for path in DOCS for b in code_blocks(path)
           if b.lang == "yaml" and b.code.startswith("tables:")]


@pytest.mark.parametrize("block", PS_YAML, ids=lambda b: b.name)
def test_ps_yaml_example_is_a_valid_config(block: Block, tmp_path: Path) -> None:
    config = tmp_path / "ps.yaml"
    config.write_text(block.code)
    done = subprocess.run([sys.executable, "-m", "services.cli", "ps", "--config", str(config),
                           "--check-config"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{block.name}: {done.stderr}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    fenced = False
    out = set()
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link of the docs names a file of the repository (and a heading of it)."""
    broken = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md"
                                 and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"


_TOP = ("services/", "clients/", "bench/", "tests/", "deploy/", "docs/", ".ci/")
_PATH = re.compile(r"`([\w.\-/]+)`")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_named_repository_paths_exist(path: Path) -> None:
    """A file or folder of the repository named in backquotes (``services/ps/shard.py``) exists."""
    named = {m for m in _PATH.findall(path.read_text()) if m.startswith(_TOP)}
    missing = sorted(m for m in named if not (ROOT / m).exists())
    assert not missing, f"{path.relative_to(ROOT)} names paths that do not exist: {missing}"


_DOTTED = re.compile(r"`((?:services|clients)(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    """``a.b.c`` is a module, or an attribute path under the longest importable module."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_named_python_objects_exist(path: Path) -> None:
    """A dotted name in backquotes (``services.common.sharding.shard_of``) imports."""
    named = set(_DOTTED.findall(path.read_text()))
    missing = sorted(n for n in named if not _resolves(n))
    assert not missing, f"{path.relative_to(ROOT)} names objects that do not exist: {missing}"


def _shell_commands() -> list[tuple[str, list[str]]]:
    """``persimmon ...`` and ``python -m bench ...`` commands of the docs' ```bash blocks."""
    out = []
    for path in DOCS:
        for block in code_blocks(path):
            if block.lang not in ("bash", "sh"):
                continue
            for line in block.code.splitlines():
                for part in line.split("&&"):
                    part = part.strip()
                    if part.startswith(("persimmon ", "python -m bench ")):
                        out.append((block.name, shlex.split(part, comments=True)))
    return out


def test_shell_commands_parse() -> None:
    """Every ``persimmon`` and ``python -m bench`` command of the docs is accepted by its parser
    (flags and values; nothing runs)."""
    from bench import register_benches
    from services.cli import build_parser
    from services.common.commands import command_parser

    bench, sub = command_parser("python -m bench", "")
    register_benches(sub)
    commands = _shell_commands()
    assert any(words[0] == "persimmon" for _, words in commands)
    for where, words in commands:
        parser, argv = (build_parser(), words[1:]) if words[0] == "persimmon" else \
            (bench, words[3:])
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{where}: {' '.join(words)!r} does not parse") from exc


def _commands(line: str) -> list[list[str]]:
    """``a && b && c`` as argument lists: ``python3 -m X`` / ``python -m X`` read as ``X``, and
    pip's ``--quiet`` dropped (CI's log wants it, a reader's terminal does not)."""
    out = []
    for part in line.split("&&"):
        words = shlex.split(part)
        if words[:2] in (["python", "-m"], ["python3", "-m"]):
            words = words[2:]
        if words[:1] == ["pip"]:
            words = [w for w in words if w not in ("-q", "--quiet")]
        out.append(words)
    return out


def test_readme_test_command_is_the_ci_command() -> None:
    """The README's second set-up command installs and runs what ``.ci/run`` installs and runs."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python3 -m ")]
    ci_steps = [c for line in ci for c in _commands(line)]
    shell = [b for b in code_blocks(ROOT / "README.md") if b.lang in ("bash", "sh")]
    lines = [line.strip() for b in shell for line in b.code.splitlines()]
    test_lines = [line for line in lines if "pytest" in line and not line.startswith("#")]
    assert len(test_lines) == 1, f"README.md should have one test command, has {test_lines}"
    assert _commands(test_lines[0]) == ci_steps, (
        f"README's test command {test_lines[0]!r} differs from .ci/run's {ci_steps}")
