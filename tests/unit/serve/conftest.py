"""Fixtures of the serving unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_versions import MakeVersion, version_factory


@pytest.fixture
def make_version(tmp_path: Path) -> MakeVersion:
    """``make_version(step=..., seed=..., row_dtype=...)``: see serve_versions."""
    return version_factory(tmp_path)
