"""Release locks (``manifests/VARIANT.lock``), checking a rebuild against one, and uploads."""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from buildkit.core import keys
from buildkit.core.errors import StepError, UsageError
from buildkit.engine.step import Publishes, ReleaseGate, WorldStep
from buildkit.store.fsio import atomic_write

TOOLS = (
    "buildkit",
    "llvmlite",
    "mlx",
    "mlx-lm",
    "numba",
    "numpy",
    "safetensors",
    "scipy",
    "tokenizers",
)
PINS = "constraints.txt"  # the exact versions release locks are made with (see README)


def lock_path(sched) -> Path:
    return sched.m.file.with_suffix(".lock")


def tool_versions() -> dict[str, str]:
    return {t: version(t) for t in TOOLS}


def machine() -> str:
    return f"{platform.system()}-{platform.machine()}"


def check_gates(sched, states) -> None:
    """Every node's release gate (``ReleaseGate``) on its outputs, cached or run: a release
    whose figures miss a gate fails here, before any lock is written."""
    failed = []
    for st in states:
        step = sched.m.nodes[st.name].step
        if isinstance(step, ReleaseGate) and st.outputs:
            bad = step.release_gate(sched.m.nodes[st.name].params, sched.artifacts(st.outputs))
            failed += [f"{'; '.join(bad)} (params of step {st.name!r})"] if bad else []
    if failed:
        raise StepError(
            "release gate failed: " + " | ".join(failed) + "; the figures are the build's own "
            "(cached or run): loosen the gate or improve the variant, then release again"
        )


def sources_of(sched, states) -> dict:
    """What each node that watches the world fingerprinted (fetch: its source's files)."""
    return {
        s.name: {"source": s.ingredients["params"], "files": s.ingredients["fingerprint"]}
        for s in states
        if isinstance(sched.m.nodes[s.name].step, WorldStep)
        and s.ingredients["fingerprint"] is not None
    }


def lock_data(sched, states) -> dict:
    nodes = {
        s.name: {
            "kind": s.kind,
            "key": s.key,
            "libraries": s.ingredients["libraries"],
            "outputs": dict(sorted(s.outputs.items())),
        }
        for s in states
    }
    return {
        "variant": sched.m.name,
        "sources": sources_of(sched, states),
        "nodes": nodes,
        "tools": tool_versions(),
        "python": platform.python_version(),
        "platform": machine(),
    }


def write_lock(sched, states) -> Path:
    path = lock_path(sched)
    atomic_write(
        path, (json.dumps(lock_data(sched, states), indent=2, sort_keys=True) + "\n").encode()
    )
    return path


def read_lock(path: str | Path, variant: str) -> dict:
    """A lock file, checked to be one (for ``variant``) before anything is built against it."""
    try:
        lock = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: cannot read lock file: {e}") from None
    nodes = lock.get("nodes") if isinstance(lock, dict) else None
    if not (
        isinstance(nodes, dict)
        and all(isinstance(v, dict) for v in nodes.values())
        and isinstance(lock.get("sources", {}), dict)
    ):
        raise UsageError(
            f"{path}: not a buildkit lock file (no nodes table); "
            "write one with `buildkit build VARIANT --release`"
        )
    if lock.get("variant") != variant:
        raise UsageError(f"{path} is the lock of variant {lock.get('variant')!r}, not {variant!r}")
    return lock


def _differ(a: dict, b: dict) -> str:
    """'name A (lock) vs B (here)' for each entry that differs between two version tables."""
    a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
    return ", ".join(
        f"{k} {a.get(k)} (lock) vs {b.get(k)} (here)"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    )


def verify_against(manifest, against: str | Path, jobs: int = 2, remote=None) -> int:
    """Rebuild the variant in an empty store and compare node by node with a lock file (with
    ``remote``, what the remote cache holds is taken instead of rebuilt: it checks the cache)."""
    from buildkit.engine.scheduler import Scheduler
    from buildkit.engine.step import BuildOptions
    from buildkit.store.store import Store

    lock = read_lock(against, manifest.name)
    tools = _warn_versions(lock)
    with tempfile.TemporaryDirectory(prefix="buildkit-verify-") as tmp:
        opts = BuildOptions(
            project_root=Path.cwd(), out_dir=Path(tmp) / "out", release=True, remote=remote
        )
        sched = Scheduler(manifest, Store(Path(tmp) / "store"), opts)
        states = sched.build(jobs=jobs)
        check_gates(sched, states)
        got = lock_data(sched, states)
    for name in sched.order:
        want = lock["nodes"].get(name)
        have = got["nodes"][name]
        if want is None:
            print(
                f"differs at node {name!r}: the lock has no such node (the manifest changed since)",
                file=sys.stderr,
            )
            return 1
        if any(want.get(f) != have[f] for f in ("kind", "key", "outputs")):
            _explain_difference(name, want, have, lock, got, tools)
            return 1
    extra = sorted(set(lock["nodes"]) - set(got["nodes"]))
    if extra:
        print(f"lock names nodes the manifest no longer has: {', '.join(extra)}", file=sys.stderr)
        return 1
    print(f"{manifest.name}: {len(got['nodes'])} nodes reproduce {against} digest for digest")
    return 0


def _warn_versions(lock: dict) -> dict:
    """Warns where this machine's tools or platform are not the lock's; returns the tool
    versions that differ."""
    tools = _differ(lock.get("tools"), tool_versions())
    if tools:
        print(
            f"buildkit: warning: tool versions differ from the lock's: {tools}. "
            "Cache keys include the versions of libraries that change bytes, "
            "so the nodes that use them cannot reproduce "
            f"the lock; install the release pins (pip install -c {PINS} -e .) and verify again",
            file=sys.stderr,
        )
    if lock.get("platform", machine()) != machine():
        print(
            f"buildkit: note: the lock was made on {lock['platform']}, this is {machine()}",
            file=sys.stderr,
        )
    return tools


def _explain_difference(name: str, want: dict, have: dict, lock: dict, got: dict, tools) -> None:
    """What differs at the first node that does not reproduce the lock, and the likely why."""
    print(f"differs at node {name!r} ({have['kind']}), the first in build order:", file=sys.stderr)
    for f in ("kind", "key", "outputs"):
        if want.get(f) != have[f]:
            print(
                f"  {f}: lock {json.dumps(want.get(f))} vs rebuild {json.dumps(have[f])}",
                file=sys.stderr,
            )
    libs = _differ(want.get("libraries"), have["libraries"])
    if libs:
        print(
            f"  its key includes library versions that differ: {libs}; "
            f"install the release pins (pip install -c {PINS} -e .)",
            file=sys.stderr,
        )
    if name in got["sources"]:
        old = (lock.get("sources", {}).get(name) or {}).get("files") or {}
        new = got["sources"][name]["files"] or {}
        files = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if files:
            print(f"  source files differ: {', '.join(files)}", file=sys.stderr)
    elif tools and not libs:
        print(
            "  (an input of this node differs, or a tool version above changed its bytes)",
            file=sys.stderr,
        )


def push(sched, states, repo_id: str) -> None:
    """Upload every published directory of the build to ``repo_id`` with huggingface_hub."""
    from buildkit.store.hub import upload

    for st in states:
        node = sched.m.nodes[st.name]
        if not isinstance(node.step, Publishes):
            continue
        path = node.step.destination(node.params, sched.context(st.name))

        url = upload(path, repo_id, f"buildkit {sched.m.name} {keys.short(st.key)}")
        print(f"uploaded {path} to {url}")
