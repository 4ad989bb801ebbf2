"""Import heavy modules on first use, so a no-op build does not pay for numpy; or ahead of
use on a spare thread (publish's load check imports mlx_lm while it writes the shards).

``np = lazy("numpy", __name__)`` binds a stand-in that imports numpy the first
time one of its attributes is read and then replaces itself in the module's
globals, so later lookups cost nothing extra.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from concurrent.futures import Future

from buildkit.core import allocator, workers


class _Lazy:
    def __init__(self, name: str, owner: str, alias: str):
        self._name, self._owner, self._alias = name, owner, alias

    def __getattr__(self, attr: str):
        mod = importlib.import_module(self._name)
        setattr(sys.modules[self._owner], self._alias, mod)
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy(name: str, owner: str, alias: str = "np") -> object:
    """A stand-in for module ``name``, bound as ``alias`` in module ``owner``."""
    if name in sys.modules:
        return sys.modules[name]
    return _Lazy(name, owner, alias)


def import_ahead(modules: list[str]) -> Future:
    """Import ``modules`` in order on the one thread of the "imports" pool; done when all are."""
    return workers.pool("imports").submit(_import_all, list(modules), workers=1)


def _import_all(modules: list[str]) -> None:
    for m in modules:
        with contextlib.suppress(Exception):  # whoever needs it reports the failure itself
            importlib.import_module(m)
        allocator.tune_imported()  # mlx's buffer cache off as soon as mlx is in
