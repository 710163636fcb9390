"""How many signatures each numba kernel of some modules holds: compiled now or loaded from
numba's disk cache (a test that counts only compile events would pass with a warm cache)."""

from __future__ import annotations

from types import ModuleType

from numba.core.registry import CPUDispatcher


def signatures(*modules: ModuleType) -> dict[str, int]:
    """``{module.kernel: number of signatures}`` over every numba kernel of ``modules``."""
    return {f"{module.__name__}.{name}": len(value.signatures)
            for module in modules for name, value in vars(module).items()
            if isinstance(value, CPUDispatcher)}
