"""Lazy public APIs: a package's names load from their modules on first use.

Usage, at the end of a package's ``__init__.py``::

    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"Trainer": "trainer"})

``package.Trainer`` then imports ``package.trainer`` once and keeps the name in the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, namespace: dict[str, Any], homes: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``homes`` maps each lazily loaded name to
    the submodule (relative to ``package``) that defines it; ``namespace`` is the package's
    ``globals()``, where a loaded name is cached."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
