"""Release locks (``manifests/VARIANT.lock``), checking a rebuild against one, and uploads."""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from . import keys
from .errors import UsageError

TOOLS = ("buildkit", "mlx", "mlx-lm", "safetensors", "numpy")


def lock_path(sched) -> Path:
    return sched.m.file.with_suffix(".lock")


def lock_data(sched, states) -> dict:
    nodes = {
        s.name: {"kind": s.kind, "key": s.key, "outputs": dict(sorted(s.outputs.items()))} for s in states
    }
    sources = {
        s.name: {"source": s.ingredients["params"], "files": s.ingredients["fingerprint"]}
        for s in states
        if s.kind == "fetch"
    }
    return {
        "variant": sched.m.name,
        "sources": sources,
        "nodes": nodes,
        "tools": {t: version(t) for t in TOOLS},
        "python": platform.python_version(),
    }


def write_lock(sched, states) -> Path:
    path = lock_path(sched)
    path.write_text(json.dumps(lock_data(sched, states), indent=2, sort_keys=True) + "\n")
    return path


def verify_against(args, manifest) -> int:
    """Rebuild the variant in an empty store and compare node by node with a lock file."""
    from .scheduler import Scheduler
    from .steps.base import BuildOptions
    from .store import Store

    try:
        lock = json.loads(Path(args.against).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{args.against}: cannot read lock file: {e}") from None
    with tempfile.TemporaryDirectory(prefix="buildkit-verify-") as tmp:
        opts = BuildOptions(project_root=Path.cwd(), out_dir=Path(tmp) / "out", release=True)
        sched = Scheduler(manifest, Store(Path(tmp) / "store"), opts)
        states = sched.build(jobs=args.jobs)
        got = lock_data(sched, states)
    for name in sched.order:
        want = lock["nodes"].get(name)
        have = got["nodes"].get(name)
        if want != have:
            print(f"differs at node {name!r}:", file=sys.stderr)
            for field in ("kind", "key", "outputs"):
                if (want or {}).get(field) != (have or {}).get(field):
                    print(f"  {field}: lock {json.dumps((want or {}).get(field))} vs rebuild {json.dumps((have or {}).get(field))}", file=sys.stderr)
            tools = {t: (lock.get("tools", {}).get(t), got["tools"][t]) for t in TOOLS if lock.get("tools", {}).get(t) != got["tools"][t]}
            if tools:
                print(f"  tool versions differ: {tools}", file=sys.stderr)
            return 1
    extra = sorted(set(lock["nodes"]) - set(got["nodes"]))
    if extra:
        print(f"lock names nodes the manifest no longer has: {', '.join(extra)}", file=sys.stderr)
        return 1
    print(f"{manifest.name}: {len(got['nodes'])} nodes reproduce {args.against} digest for digest")
    return 0


def push(sched, states, repo_id: str, dry_run: bool = False) -> None:
    """Upload every published directory of the build to ``repo_id`` with huggingface_hub."""
    from .steps.publish import out_dir

    for st in states:
        if st.kind != "publish":
            continue
        node = sched.m.nodes[st.name]
        path = out_dir(node.params, sched._ctx(st.name))
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        if dry_run:
            print(f"would upload {len(files)} files from {path} to {repo_id}:")
            for p in files:
                print(f"  {p.name} ({p.stat().st_size:,} bytes)")
            continue
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=path, ignore_patterns=[".*"],
                                 commit_message=f"buildkit {sched.m.name} {keys.short(st.key)}")
        print(f"uploaded {path} to {info}")
