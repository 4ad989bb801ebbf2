"""A build whose every file is as its last success left it does nothing
(buildkit/store/uptodate.py); any change to a file it depends on takes the full path, which
decides by content digests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import XL, Project, cached, in_build_order, ran

from buildkit.fixtures.generated import generate
from buildkit.store.artifact import objects as artifact_objects
from buildkit.store.store import Store

UP_TO_DATE = "(up to date: "


def age(*roots: Path) -> None:
    """Give these trees an mtime a minute old (a new one each call), as files not just edited."""
    t = time.time_ns() - 60_000_000_000
    for root in roots:
        for p in [root, *root.rglob("*")]:
            os.utime(p, ns=(t, t))


@pytest.fixture
def built(tmp_path) -> tuple[Project, Path]:
    """xl built from a local source directory, its inputs old enough to be vouched for."""
    project = Project(tmp_path / "p")
    src = generate(tmp_path / "src")
    age(project.manifests, src)
    first = project.build("xl", "--source", str(src))
    assert in_build_order(ran(first), XL) and UP_TO_DATE not in first.stderr
    return project, src


def build(project: Project, src: Path, *extra: str) -> subprocess.CompletedProcess:
    return project.build("xl", "--source", str(src), *extra)


def test_a_build_with_nothing_to_do_reads_only_stats_and_imports_neither_pydantic_nor_numpy(built):
    project, src = built
    code = (
        "import sys; from buildkit.cli.main import main; rc = main(sys.argv[1:]); "
        "print(rc, sorted(m for m in ('pydantic', 'numpy', 'mlx', 'networkx') if m in sys.modules))"
    )
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            *project.args("build", "xl", "--source", str(src), "--out", str(project.out / "xl")),
        ],
        cwd=project.root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert p.stdout.split(None, 1) == ["0", "[]\n"]
    assert in_build_order(cached(p), XL) and ran(p) == []
    assert "xl: 7 steps, 0 ran, 7 cached in " in p.stderr and UP_TO_DATE in p.stderr
    # The record lists the manifest, every source file and directory, the published files, the
    # store's records and objects of every node, and buildkit's own modules.
    rec = json.loads(next((project.store / "uptodate").glob("*.json")).read_text())
    files = set(rec["files"])
    for p in [project.manifests / "xl.toml", src, *src.iterdir(), *(project.out / "xl").iterdir()]:
        assert str(p.absolute()) in files, p
    store = Store(project.store)
    refs = json.loads((project.store / "refs" / "xl.json").read_text())["nodes"]

    def objects(node: str) -> set[str]:
        arts = [store.get_artifact(d) for d in refs[node]["outputs"].values()]
        return {str(store.object_path(d)) for art in arts for d in artifact_objects(art)}

    # The quantized weights, and eval's too: its report and the trunk's hidden states it keeps.
    for node in ("quantize", "eval"):
        assert objects(node) and objects(node) <= files, node
    assert str(Path(sys.modules["buildkit.cli"].__file__).resolve()) in files


def test_every_kind_of_change_takes_the_full_path_and_the_next_build_is_up_to_date_again(built):
    project, src = built
    out = project.out / "xl"
    store = Store(project.store)
    refs = lambda: json.loads((project.store / "refs" / "xl.json").read_text())["nodes"]  # noqa: E731

    def quantized_object() -> Path:
        art = store.get_artifact(refs()["quantize"]["outputs"]["out"])
        return store.object_path(next(iter(artifact_objects(art))))

    def shard() -> Path:
        return next(out.glob("*.safetensors"))

    def edit_manifest():
        path = project.manifests / "xl.toml"
        path.write_text(path.read_text() + "\n# edited\n")
        age(path)  # an old mtime again, but not the recorded one

    def add_source_file():
        (src / "notes.txt").write_text("hello")
        age(src)

    changes = {  # what changes: (how, the steps the full path then runs)
        "a manifest's text": (edit_manifest, []),
        "a source file's mtime (same bytes)": (lambda: age(next(src.glob("*.safetensors"))), []),
        "a new file in the source": (add_source_file, XL),
        "a published shard removed": (lambda: shard().unlink(), ["publish"]),
        "a store object removed": (lambda: quantized_object().unlink(), ["quantize"]),
    }
    for what, (change, runs) in changes.items():
        assert UP_TO_DATE in build(project, src).stderr, what
        change()
        full = build(project, src)
        assert UP_TO_DATE not in full.stderr, what
        assert in_build_order(ran(full), runs), (what, full.stderr)
    assert UP_TO_DATE in build(project, src).stderr

    # A re-hash, a target or a full check always plans, and leaves the record as it was.
    for extra in (["--rehash"], ["--target", "verify"], ["--full-check"]):
        assert UP_TO_DATE not in build(project, src, *extra).stderr, extra
        assert UP_TO_DATE in build(project, src).stderr, extra
    # Another output directory is another request: it publishes there.
    other = project.run(
        "build", "xl", "--source", str(src), "--out", str(project.out / "elsewhere")
    )
    assert UP_TO_DATE not in other.stderr and ran(other) == ["publish"]


def test_an_input_modified_just_before_the_build_leaves_no_record(built):
    """Its mtime could be the same after another edit within the same timestamp tick."""
    project, src = built
    assert UP_TO_DATE in build(project, src).stderr
    manifest = project.manifests / "xl.toml"
    manifest.write_text(manifest.read_text() + "\n")
    for _ in range(2):
        now = time.time_ns()
        os.utime(manifest, ns=(now, now))  # as if edited right now, however long a build takes
        p = build(project, src)
        assert UP_TO_DATE not in p.stderr and ran(p) == []
    assert not list((project.store / "uptodate").glob("*.json"))


def test_a_damaged_record_is_ignored_and_replaced(built):
    project, src = built
    assert UP_TO_DATE in build(project, src).stderr
    record = next((project.store / "uptodate").glob("*.json"))
    record.write_text('{"request": ')
    p = build(project, src)
    assert UP_TO_DATE not in p.stderr and ran(p) == [] and in_build_order(cached(p), XL)
    assert UP_TO_DATE in build(project, src).stderr
