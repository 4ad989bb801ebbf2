"""Optional packages: whether one is importable, and the one-line error when a step needs it."""

from __future__ import annotations

import importlib.util

from buildkit.core.errors import UsageError


def importable(module: str) -> bool:
    """Whether ``import module`` would find it, without importing it (mlx_vlm takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails, or sys.modules[name] = None
        return False


def require(module: str, package: str, needed_by: str, install: str | None = None) -> None:
    """Raise a one-line UsageError naming ``package`` and its install command if ``module``
    cannot be imported: called before any work, so a build never dies hours in."""
    if not importable(module):
        how = install or f"pip install '{package}' (in buildkit's checkout: make install)"
        raise UsageError(f"{needed_by} needs the package {package}, which is not installed: {how}")
