"""A directory replaced in one rename: readers see the old one or the new one, never a mix."""

from __future__ import annotations

import glob
import os
import re
import shutil
from pathlib import Path

from buildkit.core.allocator import libc
from buildkit.store.fsio import DirectFile


def exchange(src: Path, dst: Path) -> None:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE), else rename aside."""
    fn = getattr(libc(), "renameat2", None)
    if fn is not None:
        AT_FDCWD, RENAME_EXCHANGE = -100, 2
        if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_EXCHANGE) == 0:
            return
    aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    os.rename(dst, aside)
    os.rename(src, dst)
    os.rename(aside, src)


LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)")


def clear_leftovers(dest: Path) -> None:
    """Remove the temp and set-aside directories that killed publishes left beside ``dest``."""
    for p in dest.parent.glob(f".{glob.escape(dest.name)}.*-*"):
        m = LEFTOVER.fullmatch(p.name)
        if m and m["name"] == dest.name and not _alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        pass
    return True


def write_synced(path: Path, data: bytes) -> None:
    """A small file, through the page cache, fsynced before it is closed."""
    with DirectFile(path, direct=False) as f:
        f.write(data)
