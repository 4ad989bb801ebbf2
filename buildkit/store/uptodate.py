"""Up to date: a build whose every file is as its last success left it has nothing to do.

A build with nothing to do still plans: it loads the manifests (pydantic), hashes the
sources (by stat), looks up every node's key and checks its outputs. Most of that time is
Python importing pydantic and the steps. So a successful build leaves a record in the store,
under the request that made it (variant, manifests, source, out, store, working directory,
Python, ``BUILDKIT_*`` / ``HF_*`` environment): the stat (device, inode, size, mtime) of
every file it depended on, and its nodes (name, kind, key) to report as ``[cached]``:

- inputs: the manifest chain, what the steps read outside the store (``Step.watch``: the
  source's files and directories, a calibration text), buildkit's own modules and the
  site-packages directories (an install or upgrade changes their mtime);
- outputs: the published files and directories (``Step.watch``), and the store records and
  objects the nodes' outputs name (``Store.record_files``).

The next identical request stats those files; if none changed, the build is done without
importing the rest of buildkit. Anything else (a changed, added or removed file; ``--rehash``,
``--target``, ``--release``, ``--full-check``) takes the full path, which decides by content
digests as always.
Trusting a stat is what the source hash records already do; an input modified less than
two timestamp ticks before the build started (``store.RACY_TICK_NS``) could change again unseen,
so such a build leaves no record.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from buildkit.core import keys
from buildkit.store.layout import Layout

FORMAT = 1


def ident(path: str | Path) -> list[int] | None:
    """A source hash record's stat identity without the ctime: a publish that hard-links
    another variant's shard changes that file's ctime, not its content."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def environment_files() -> list[Path]:
    """buildkit's own modules and the directories packages are installed in."""
    pkg = Path(__file__).resolve().parents[1]  # the whole buildkit package
    libs = {
        Path(p)
        for p in sys.path
        if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)
    }
    return sorted(pkg.rglob("*.py")) + sorted(libs)


def record_path(store_root: Path, request: dict) -> Path:
    return (
        Layout(store_root).uptodate
        / f"{keys.short(keys.digest_json('uptodate', [FORMAT, request]), 32)}.json"
    )


def check(store_root: Path, request: dict) -> dict | None:
    """The record of the last success of ``request`` if every file it lists is unchanged."""
    try:
        rec = json.loads(record_path(store_root, request).read_bytes())
        if rec["request"] != request:
            return None
        files = rec["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for path, want in files.items():
        if ident(path) != want:
            return None
    return rec


def record(
    store_root: Path,
    request: dict,
    inputs: list[Path],
    outputs: list[Path],
    report: dict,
    started_ns: int,
) -> bool:
    """Remember a success of ``request``; False (and the old record removed) if an input is
    missing or too recent to vouch for its content."""
    from buildkit.store.fsio import RACY_TICK_NS, atomic_write

    path = record_path(store_root, request)
    inputs = [*environment_files(), *inputs]
    files = {str(p): ident(p) for p in [*inputs, *outputs]}
    racy = any(started_ns - files[str(p)][3] <= RACY_TICK_NS for p in inputs if files[str(p)])
    if racy or None in files.values():
        path.unlink(missing_ok=True)
        return False
    rec = {"request": request, "files": files, **report}
    atomic_write(
        path,
        json.dumps(rec, separators=(",", ":")).encode(),
        Layout(store_root).tmp,
        sync_dir=False,
    )
    return True
