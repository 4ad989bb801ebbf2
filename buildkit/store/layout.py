"""Where each kind of entry lives under a store root; ``store.py``'s docstring says what each holds.

Its own module so that the up-to-date check (``uptodate.py``), which runs before anything
else is imported, can find its records without importing the store.
"""

from __future__ import annotations

from pathlib import Path

from buildkit.core import keys


class Layout:
    """Where each kind of entry lives under a store root (see the module docstring)."""

    DIRS = ("objects", "artifacts", "actions", "memos", "sources", "refs", "roots", "locks", "tmp")

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        for d in (*self.DIRS, "reports", "fixtures", "uptodate"):
            setattr(self, d, self.root / d)


def fan_key(digest: str) -> str:
    """``ab/cdef…``: a digest's place in a fanned-out directory (the store's, and a remote's)."""
    h = digest.removeprefix(keys.PREFIX)
    return f"{h[:2]}/{h[2:]}"


def fan(root: Path, digest: str) -> Path:
    return root / fan_key(digest)
