"""Release locks and concurrent builds.

``build --release`` writes ``manifests/VARIANT.lock``; ``verify --against`` rebuilds from an
empty store and compares node by node. The committed locks of the default variants are
checked here (CI). Several processes building overlapping variants on one store run each
shared node once and produce exactly what clean builds do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import REPO, Project

from buildkit.core import keys
from buildkit.engine.release import machine, tool_versions
from buildkit.store.store import Store

DEFAULTS = ("xl", "xl-mtp", "oq4e-mtp-xl")
ZERO = keys.PREFIX + "0" * 32


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Project:
    """The default variants built with --release into one store (locks in the project's
    manifests/)."""
    p = Project(tmp_path_factory.mktemp("release"))
    for v in DEFAULTS:  # each build a process of its own, as a user's: what a lock must pin
        p.run("build", v, "--release", "-q", "--out", str(p.out / v))
    return p


def lock_of(p: Project, variant: str) -> dict:
    return json.loads((p.manifests / f"{variant}.lock").read_text())


def nodes(table: dict) -> dict:
    return {n: (x["key"], x["outputs"]) for n, x in table.items()}


def verify(
    cwd: Path, variant: str, lock: Path, manifests: Path = REPO / "manifests"
) -> tuple[int, str]:
    """`buildkit verify VARIANT --against LOCK` as CI and users run it: a process of its own."""
    argv = ["--manifests", str(manifests), "verify", variant, "--against", str(lock)]
    p = subprocess.run(
        [sys.executable, "-m", "buildkit.cli", *argv], cwd=cwd, capture_output=True, text=True
    )
    return p.returncode, p.stdout + p.stderr


def tampered(p: Project, variant: str, edit) -> Path:
    d = lock_of(p, variant)
    edit(d)
    path = p.root / f"{variant}.tampered.lock"
    path.write_text(json.dumps(d))
    return path


# ---- locks ------------------------------------------------------------------------------


def test_release_writes_a_lock_with_every_node_source_and_tool(released):
    for v in DEFAULTS:
        lock = lock_of(released, v)
        assert lock["variant"] == v
        assert nodes(lock["nodes"]) == nodes(Store(released.store).get_ref(v)["nodes"])
        assert lock["tools"] == tool_versions() and lock["platform"] == machine()
        assert lock["nodes"]["quantize"]["libraries"] == {"mlx": version("mlx")}
        fetch = lock["sources"]["fetch"]
        assert fetch["source"] == {"type": "trained"}
        assert "config.json" in fetch["files"] and all(map(keys.is_digest, fetch["files"].values()))
    assert lock_of(released, "oq4e-mtp-xl")["sources"]["donor_fetch"]["source"]["spec"]["seed"] == 1


@pytest.mark.parametrize("variant", DEFAULTS)
def test_committed_lock_reproduces_from_an_empty_store(tmp_path, variant):
    """CI: `buildkit verify V --against manifests/V.lock` for each default variant."""
    lock = REPO / "manifests" / f"{variant}.lock"
    code, out = verify(tmp_path, variant, lock)
    assert code == 0, out[-4000:]
    assert f"{variant}: {len(json.loads(lock.read_text())['nodes'])} nodes reproduce" in out
    assert "tool versions differ" not in out


def test_release_pins_are_the_versions_of_the_committed_locks():
    """constraints.txt (what `make` installs) and manifests/*.lock move together."""
    pins = dict(
        line.split("#")[0].strip().split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and "(not in the locks)" not in line  # a client: it changes no bytes
    )
    assert {"mlx", "mlx-lm", "numpy"} <= set(pins)
    for v in DEFAULTS:
        tools = json.loads((REPO / "manifests" / f"{v}.lock").read_text())["tools"]
        assert {k: tools[k] for k in pins} == pins, (
            f"manifests/{v}.lock was made with other versions; run make release"
        )


def test_verify_names_the_first_differing_node_and_library_versions(released):
    def other_mlx(d):
        d["tools"]["mlx"] = "0.0.1"
        for n in ("quantize", "verify", "publish"):  # what a lock made with another mlx looks like
            d["nodes"][n]["libraries"]["mlx"] = "0.0.1"
            d["nodes"][n]["key"] = ZERO

    code, out = verify(
        released.root,
        "xl",
        tampered(released, "xl", other_mlx),
        released.manifests,
    )
    here = version("mlx")
    assert code == 1
    assert f"tool versions differ from the lock's: mlx 0.0.1 (lock) vs {here} (here)" in out
    assert "differs at node 'quantize' (quantize), the first in build order" in out
    assert (
        f"its key includes library versions that differ: mlx 0.0.1 (lock) vs {here} (here)" in out
    )
    assert "pip install -c constraints.txt" in out


def test_verify_names_changed_source_files(released):
    def other_shard(d):
        d["sources"]["fetch"]["files"]["model-00002-of-00002.safetensors"] = ZERO
        d["nodes"]["fetch"]["key"] = ZERO

    code, out = verify(
        released.root,
        "xl",
        tampered(released, "xl", other_shard),
        released.manifests,
    )
    assert code == 1 and "differs at node 'fetch' (fetch)" in out
    assert "source files differ: model-00002-of-00002.safetensors" in out
    assert "tool versions differ" not in out


def test_verify_refuses_a_bad_lock_before_building(released):
    bad = released.root / "bad.lock"
    cases = {
        "{not json": "cannot read lock file",
        json.dumps({"variant": "xl"}): "not a buildkit lock file",
        json.dumps({"variant": "xl", "nodes": {"fetch": 1}}): "not a buildkit lock file",
        json.dumps(lock_of(released, "xl-mtp")): "is the lock of variant 'xl-mtp', not 'xl'",
    }
    for text, message in cases.items():
        bad.write_text(text)
        code, out = verify(released.root, "xl", bad, released.manifests)
        assert code == 2 and message in out and "[run]" not in out, out
    code, out = verify(released.root, "xl", released.root / "none.lock", released.manifests)
    assert code == 2 and "cannot read lock file" in out


def test_release_of_part_of_a_variant_is_refused(project, capsys):
    assert project.cli("build", "xl", "--release", "--target", "sanitize") == 2
    assert "drop --target" in capsys.readouterr().err
    assert not (project.manifests / "xl.lock").exists() and not project.store.exists()


# ---- concurrency ------------------------------------------------------------------------


def test_concurrent_builds_run_each_shared_node_once(released, tmp_path):
    """Four processes at once on one store: xl, xl-mtp twice (two --out dirs) and oq4e-mtp-xl."""
    p = Project(tmp_path)
    jobs = [
        ("xl", "xl"),
        ("xl-mtp", "xl-mtp"),
        ("xl-mtp", "xl-mtp-again"),
        ("oq4e-mtp-xl", "oq4e-mtp-xl"),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "buildkit.cli", *p.args("build", v, "--out", str(p.out / o))],
            cwd=p.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for v, o in jobs
    ]
    errs = [proc.communicate(timeout=600)[1] for proc in procs]
    for proc, err in zip(procs, errs):
        assert proc.returncode == 0, err
    # "[done]   name (kind) <key> in ...": every key but a publish (one per --out) ran once
    done = Counter(
        (line.split()[1], line.split()[3])
        for err in errs
        for line in err.splitlines()
        if line.startswith("[done]") and "(publish)" not in line
    )
    want = {
        (n, keys.short(x["key"]))
        for v in DEFAULTS
        for n, x in Store(released.store).get_ref(v)["nodes"].items()
        if n != "publish"
    }
    assert set(done) == want and set(done.values()) == {1}, done
    assert sum(line.startswith("[cached] fetch ") for err in errs for line in err.splitlines()) == 3
    store = Store(p.store)
    assert store.check() == []
    for v in DEFAULTS:
        assert nodes(store.get_ref(v)["nodes"]) == nodes(
            Store(released.store).get_ref(v)["nodes"]
        ), v
    for v, o in jobs:
        want, got = released.out / v, p.out / o
        files = sorted(
            str(x.relative_to(want)) for x in want.rglob("*") if x.is_file()
        )  # with mtp/
        assert sorted(str(x.relative_to(got)) for x in got.rglob("*") if x.is_file()) == files
        for f in files:
            assert (got / f).read_bytes() == (want / f).read_bytes(), (o, f)
