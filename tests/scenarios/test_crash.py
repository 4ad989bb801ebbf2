"""Crash safety: builds killed at many points, publishes read while swapped, full disks.

A child ``buildkit build`` is SIGKILLed (by its own pid) at points chosen from outside the
product, with no hook in it: delays spread over a measured clean build, the n-th temp file
appearing in the store (an object, listing or record being written), the progress lines
between nodes, and a publish in flight. The next build resumes from whatever the killed one
left, and each round ends with a build that finishes. After every kill the published
directory is the old complete one or the new complete one and the store holds nothing
corrupt; after every round each node's outputs equal a clean build's, the published bytes
too, and nothing temporary is left beside the output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Project

from buildkit.cli.main import main
from buildkit.core import keys
from buildkit.steps.publish import STAMP
from buildkit.store.store import Store

VARIANT, OLD = "xl-mtp", "xl"  # each round publishes VARIANT over a directory holding OLD
INDEX = "model.safetensors.index.json"


def snapshot(d: Path) -> dict[str, str]:
    """File name -> content digest of a published directory."""
    return {p.name: keys.blob_digest(p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()}


def outputs(store: Path, variant: str) -> dict:
    return {n: v["outputs"] for n, v in Store(store).get_ref(variant)["nodes"].items()}


def leftovers(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


@dataclass
class Clean:
    project: Project
    seconds: float  # wall time of a clean build of VARIANT, child process start to exit
    outputs: dict
    new: dict
    old: dict


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Clean:
    p = Project(tmp_path_factory.mktemp("clean"))
    t = time.monotonic()
    p.build(VARIANT)
    seconds = time.monotonic() - t
    p.build(OLD)
    return Clean(
        p, seconds, outputs(p.store, VARIANT), snapshot(p.out / VARIANT), snapshot(p.out / OLD)
    )


class Child:
    """A ``buildkit build`` child whose progress lines are collected as they arrive."""

    def __init__(self, project: Project, variant: str, out: Path):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "buildkit.cli",
                *project.args("build", variant, "--out", str(out)),
            ],
            cwd=project.root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(x.rstrip("\n") for x in self.proc.stderr)
        )
        self.reader.start()

    def kill_when(self, trigger) -> bool:
        """SIGKILL the child as soon as ``trigger(self)`` holds; False if it exited first."""
        while self.proc.poll() is None:
            if trigger(self):
                self.proc.send_signal(signal.SIGKILL)  # a no-op once the child is reaped
                break
            time.sleep(0.0005)
        return self.finish() == -signal.SIGKILL

    def finish(self) -> int:
        self.proc.wait(timeout=300)
        self.reader.join(timeout=30)
        return self.proc.returncode


# ---- kill points: each makes a fresh trigger for one child -------------------------------


def after(seconds: float):
    return lambda p, out: lambda c: time.monotonic() - c.t0 >= seconds


def on_line(prefix: str, then: float = 0.0):
    def make(p, out):
        seen: list[float] = []

        def trigger(c):
            if not seen and any(x.startswith(prefix) for x in c.lines):
                seen.append(time.monotonic())
            return bool(seen) and time.monotonic() - seen[0] >= then

        return trigger

    return make


def temp_files(n: int):
    """Once the child has had n temp files in the store's tmp/ (objects and records being
    written)."""

    def make(p, out):
        seen: set[str] = set()

        def trigger(c):
            mine = (
                f".{c.proc.pid}."  # temp names carry the writer's pid; killed builds leave theirs
            )
            with contextlib.suppress(FileNotFoundError):
                seen.update(x for x in os.listdir(p.store / "tmp") if mine in x)
            return len(seen) >= n

        return trigger

    return make


def publishing(then: float):
    """``then`` seconds after the child's publish directory appears beside the output."""

    def make(p, out):
        seen: list[float] = []

        def trigger(c):
            if not seen and (out.parent / f".{out.name}.tmp-{c.proc.pid}").exists():
                seen.append(time.monotonic())
            return bool(seen) and time.monotonic() - seen[0] >= then

        return trigger

    return make


def rounds(seconds: float) -> dict[str, list]:
    return {
        "delay sweep": [
            after(f * seconds) for f in (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)
        ],
        "delay sweep, shifted": [
            after(f * seconds) for f in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
        ],
        "store writes": [temp_files(n) for n in (1, 2, 4, 8, 16, 32, 64, 128)],
        "node boundaries and publish": [
            on_line("[done]   fetch"),
            on_line("[done]   sanitize"),
            on_line("[done]   quantize"),
            on_line("[done]   verify"),
            publishing(0.0),
            publishing(0.3),
            publishing(0.6),
            on_line("  publish: published"),
        ],
    }


def kill_round(root: Path, clean: Clean, triggers: list) -> list[str]:
    """Kill successive builds at ``triggers``, then finish; returns the last line seen at each
    kill."""
    p = Project(root)
    out = p.out / "model"
    shutil.copytree(clean.project.out / OLD, out)
    kills = []
    for make in [*triggers, None]:
        child = Child(p, VARIANT, out)
        if make is None or not child.kill_when(make(p, out)):
            assert child.finish() == 0, "\n".join(child.lines)
            break
        kills.append(child.lines[-1] if child.lines else "(starting up)")
        state = snapshot(out)
        assert state in (clean.old, clean.new), f"after a kill at {kills[-1]!r} the output is a mix"
        assert Store(p.store).check() == [], f"corrupt store after a kill at {kills[-1]!r}"
    assert outputs(p.store, VARIANT) == clean.outputs
    assert snapshot(out) == clean.new
    assert leftovers(p.out) == []
    assert main(p.args("store", "check")) == 0
    return kills


def test_killed_builds_resume_to_a_clean_builds_digests(clean, tmp_path, capsys):
    kills: dict[str, list[str]] = {}
    for i, (name, triggers) in enumerate(rounds(clean.seconds).items()):
        kills[name] = kill_round(tmp_path / f"round{i}", clean, triggers)
    with capsys.disabled():
        total = sum(map(len, kills.values()))
        print(
            f"\n{total} kills ({', '.join(f'{k}: {len(v)}' for k, v in kills.items())}); "
            f"clean build {clean.seconds:.1f}s"
        )
    every = [line for v in kills.values() for line in v]
    assert len(every) >= 20, kills
    assert any(line.startswith(("[run]    publish", "  publish:")) for line in every), (
        kills
    )  # mid-publish
    assert len(kills["store writes"]) >= 4, kills


def test_a_kill_while_a_source_file_is_remembered_leaves_it_resolvable(tmp_path):
    """A source file's digest is kept in two records (the file's own, and the list of files with
    that digest). A process killed after any number of them is in place leaves a store where the
    file still resolves by its digest: the kill comes from an audit hook on the renames that put
    the records in place, so every point between them is hit, not just those a timer finds."""
    src = tmp_path / "weights.safetensors"
    src.write_bytes(os.urandom(1 << 16))
    old = time.time() - 60  # older than the racy-timestamp window: a record of it is trusted
    os.utime(src, (old, old))
    digest = keys.blob_digest(src.read_bytes())
    for done in (0, 1, 2):  # records in place when the process dies
        root = tmp_path / f"store{done}"
        hook = (
            "import os, signal, sys\n"
            "from buildkit.store.store import Store\n"
            f"store, n = Store({str(root)!r}), 0\n"
            "def hook(event, args):\n"
            "    global n\n"
            "    if event == 'os.rename' and os.sep + 'sources' + os.sep in str(args[1]):\n"
            "        n += 1\n"
            f"        if n > {done}:\n"
            "            os.kill(os.getpid(), signal.SIGKILL)\n"
            "sys.addaudithook(hook)\n"
            f"store.sources.digest_files([{str(src)!r}])\n"
        )
        p = subprocess.run([sys.executable, "-c", hook], capture_output=True, text=True)
        assert p.returncode == (0 if done == 2 else -signal.SIGKILL), p.stderr
        store = Store(root)
        assert store.sources.digest_file(src) == digest
        assert store.sources.resolve(digest) == src, f"killed with {done} record(s) in place"


def test_two_processes_remembering_copies_of_one_file_both_keep_theirs(tmp_path):
    """Two builds that hash two copies of the same bytes at once both stay listed under the
    digest: the first is held, by an audit hook, just before it puts the list in place, while
    the second remembers its copy; then the first goes on. Without a lock across processes the
    first would write back the list it read, without the second's path."""
    data = os.urandom(1 << 16)
    copies = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    old = time.time() - 60
    for c in copies:
        c.write_bytes(data)
        os.utime(c, (old, old))
    digest, root, held = keys.blob_digest(data), tmp_path / "store", tmp_path / "held"
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, sys, time\n"
                "from buildkit.store.store import Store\n"
                f"store = Store({str(root)!r})\n"
                "def hook(event, args):\n"
                "    if event == 'os.rename' and "
                f"str(args[1]).endswith({digest.split(':')[-1][2:]!r}):\n"
                f"        open({str(held)!r}, 'w').close()\n"
                "        time.sleep(2)\n"
                "sys.addaudithook(hook)\n"
                f"store.sources.digest_files([{str(copies[0])!r}])\n"
            ),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not held.exists():
        assert first.poll() is None and time.monotonic() < deadline, (
            first.stderr.read() if first.poll() else "not held"
        )
        time.sleep(0.01)
    Store(root).sources.digest_files([copies[1]])  # waits for the first's list while it is held
    assert first.wait(timeout=60) == 0, first.stderr.read()
    store = Store(root)
    copies[0].unlink()  # the other copy must still be found by the digest alone
    assert store.sources.resolve(digest) == copies[1]
    copies[0].write_bytes(data)
    copies[1].unlink()
    assert Store(root).sources.resolve(digest) == copies[0]


# ---- atomic publish ---------------------------------------------------------------------


def read_through_one_handle(out: Path) -> dict[str, str] | None:
    """Stamp, index and shards read through one directory handle (name -> digest), or None if
    the directory was swapped out and removed while being read."""
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None

    def read(name: str) -> bytes:
        with open(name, "rb", opener=lambda path, flags: os.open(path, flags, dir_fd=fd)) as f:
            return f.read()

    try:
        files = {INDEX: read(INDEX), STAMP: read(STAMP)}
        for shard in sorted(set(json.loads(files[INDEX])["weight_map"].values())):
            files[shard] = read(shard)
        return {k: keys.blob_digest(v) for k, v in files.items()}
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)


def read_by_path(out: Path) -> dict[str, str]:
    """The index and the shards it names, each opened by its path (name -> digest). The two
    builds name their shards differently (xl-mtp has one more), so a shard the index names may
    be gone when a swap comes between the reads: each file read must still be whole."""
    got = {INDEX: keys.blob_digest(index := (out / INDEX).read_bytes())}
    for shard in sorted(set(json.loads(index)["weight_map"].values())):
        with contextlib.suppress(FileNotFoundError):
            got[shard] = keys.blob_digest((out / shard).read_bytes())
    return got


def test_readers_never_see_a_mix_of_two_publishes(clean, tmp_path):
    p = Project(tmp_path)
    shutil.copytree(clean.project.store, p.store)  # every node cached: each build only publishes
    out = p.out / "model"
    p.run("build", OLD, "--out", str(out))
    versions = (clean.old, clean.new)
    seen = {"reads": 0, "retired": 0, "old": 0, "new": 0, "mixed": []}
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                got = read_through_one_handle(out)
                by_path = read_by_path(out)
            except Exception as e:  # noqa: BLE001 (any failure to read is a finding)
                seen["mixed"].append(repr(e))
                continue
            seen["reads"] += 1
            if not all(any(v.get(n) == d for v in versions) for n, d in by_path.items()):
                seen["mixed"].append(("a file read by path is not whole", by_path))
            if got is None:
                seen["retired"] += 1
            elif all(clean.old.get(k) == d for k, d in got.items()):
                seen["old"] += 1
            elif all(clean.new.get(k) == d for k, d in got.items()):
                seen["new"] += 1
            else:
                seen["mixed"].append(got)
            time.sleep(0.002)  # leave the publishers most of the CPU

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(4):
            p.run("build", (VARIANT, OLD)[i % 2], "--out", str(out))
    finally:
        stop.set()
        t.join()
    assert seen["mixed"] == [], seen["mixed"][:2]
    assert seen["old"] > 10 and seen["new"] > 10, seen
    assert snapshot(out) == clean.old and leftovers(p.out) == []


# ---- full disks -------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A size-limited tmpfs at ``path``; yields a function that resizes it. Skips if mounting is
    not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield lambda size: subprocess.run(
            ["mount", "-o", f"remount,size={size}", str(path)], check=True
        )
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def assert_disk_full_message(r: subprocess.CompletedProcess, step: str) -> None:
    assert r.returncode == 1, r.stderr
    assert f"step {step!r} ({step}) failed: [Errno 28] No space left on device" in r.stderr, (
        r.stderr
    )
    assert "free space" in r.stderr and "Traceback" not in r.stderr


def test_full_store_disk_fails_cleanly_and_a_later_build_succeeds(clean, tmp_path):
    fixture = sum(
        f.stat().st_size for f in (clean.project.store / "fixtures").rglob("*") if f.is_file()
    )
    p = Project(tmp_path)
    with tmpfs(
        p.store, f"{fixture // 1024 + 1024}k"
    ) as resize:  # room for the source, not the objects
        r = p.run("build", OLD, "--out", str(p.out / OLD), check=False)
        assert_disk_full_message(r, r.stderr.split("step '")[1].split("'")[0])
        assert not (p.out / OLD).exists() and leftovers(p.root) == []
        assert Store(p.store).check() == [] and not list((p.store / "tmp").iterdir())
        resize("64m")
        p.run("build", OLD, "--out", str(p.out / OLD))
        assert outputs(p.store, OLD) == outputs(clean.project.store, OLD)
        assert snapshot(p.out / OLD) == clean.old and Store(p.store).check() == []


def test_full_output_disk_keeps_the_old_publish_and_a_later_build_succeeds(clean, tmp_path):
    p = Project(tmp_path)
    shutil.copytree(clean.project.store, p.store)
    disk = tmp_path / "disk"
    with tmpfs(disk, "3m") as resize:  # the old publish fits, a second one beside it does not
        out = disk / "model"
        shutil.copytree(clean.project.out / OLD, out)
        r = p.run("build", VARIANT, "--out", str(out), check=False)
        assert_disk_full_message(r, "publish")
        assert snapshot(out) == clean.old and os.listdir(disk) == ["model"]
        resize("16m")
        p.run("build", VARIANT, "--out", str(out))
        assert snapshot(out) == clean.new and os.listdir(disk) == ["model"]
