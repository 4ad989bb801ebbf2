"""The Step interface as a plugin author meets it: eight members, the docstring's example
builds (in-process and as a separately installed package found by its entry point), and a step
that watches the world without saying where is refused when it registers."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Annotated

import numpy as np
import pytest

from buildkit.core.errors import ManifestError
from buildkit.engine import manifest
from buildkit.engine.step import REGISTRY, Inherit, Params, Slot, Step, WorldStep, register
from buildkit.formats.tensors import to_float32
from buildkit.store.artifact import Artifact
from buildkit.store.store import Store

REPO = Path(__file__).resolve().parents[2]


def example() -> str:
    """The code block of ``Step``'s docstring, dedented."""
    lines = Step.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("::")) + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" " * 8):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


class Noted(Step):  # reads a file outside the store: by content, in the key
    kind, version = "noted", 1
    inputs = {"model": Slot()}

    def reads(self, params, ctx) -> dict[str, Path]:
        return {"note": ctx.options.project_root / "note.txt"}

    def run(self, ctx, params, inputs):
        note = (ctx.options.project_root / "note.txt").read_text()
        return {"out": Artifact(meta={"note": note})}


MANIFEST = """
description = "a plugin step on the fixture"
source = "fixture:seed=0"
[steps.fetch]
kind = "fetch"
[steps.sanitize]
kind = "sanitize"
inputs = { source = "fetch" }
[steps.scale]
kind = "scale"
inputs = { model = "sanitize:model" }
params.label = "LABEL"
[steps.noted]
kind = "noted"
inputs = { model = "scale" }
"""


@pytest.fixture
def plugins():
    code = compile(example(), "engine/step.py:Step.__doc__", "exec", dont_inherit=True)
    exec(code, {"__name__": "scale_doc"})
    register(Noted)
    yield
    for kind in ("scale", "noted"):
        REGISTRY.pop(kind)


def plan(project, capsys) -> dict:
    capsys.readouterr()
    assert project.cli("plan", "plugin", "--json") == 0
    return {s["step"]: s for s in json.loads(capsys.readouterr().out)["steps"]}


def scaled_twice(store: Store, variant: str) -> int:
    """How many tensors scale wrote, each checked to be twice sanitize's."""
    nodes = store.get_ref(variant)["nodes"]
    model = store.get_artifact(nodes["sanitize"]["outputs"]["model"])
    out = store.get_artifact(nodes["scale"]["outputs"]["out"])
    for name, entry in out.tensors.items():
        want = 2 * to_float32(store.read_tensor(model.tensors[name]), entry["dtype"])
        assert np.array_equal(to_float32(store.read_tensor(entry), entry["dtype"]), want), name
    return len(out.tensors)


def test_step_has_eight_members():
    public = {n for n in [*dir(Step), *Step.__annotations__] if not n.startswith("_")}
    assert public == {"kind", "version", "Params", "inputs", "outputs", "run", "reads", "libraries"}


def test_the_docstring_example_builds_and_a_file_it_reads_reruns_it(project, plugins, capsys):
    project.write_manifest("plugin", MANIFEST)
    (project.root / "note.txt").write_text("one")
    assert project.cli("build", "plugin") == 0
    assert scaled_twice(Store(project.store), "plugin") > 0
    steps = plan(project, capsys)
    assert all(s["fresh"] for s in steps.values())
    # a SameBytes param changes no key; a file a step reads reruns it
    project.write_manifest("plugin", MANIFEST.replace("LABEL", "another"))
    (project.root / "note.txt").write_text("two")
    steps = plan(project, capsys)
    assert [n for n, s in steps.items() if not s["fresh"]] == ["noted"]
    assert steps["noted"]["reasons"] == ["source changed: note"]


def test_a_step_from_a_separately_installed_package_builds(project):
    """docs/develop.md's recipe: a package of one's own with a ``buildkit.steps`` entry point.
    Its dist-info is what ``pip install`` writes; putting it on the path is the install."""
    site = project.root / "site"
    (site / "scalestep").mkdir(parents=True)
    (site / "scalestep" / "__init__.py").write_text(example())
    info = site / "scalestep-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: scalestep\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[buildkit.steps]\nscale = scalestep\n")
    project.write_manifest("plugin", MANIFEST.split("[steps.noted]")[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    done = project.run("build", "plugin", env=env)
    assert "[run]    scale (scale)" in done.stderr
    assert scaled_twice(Store(project.store), "plugin") > 0
    refused = project.run("plan", "plugin", check=False, env={**env, "PYTHONPATH": str(REPO)})
    assert refused.returncode == 2 and "unknown step kind 'scale'" in refused.stderr


def test_register_refuses_a_world_step_without_watch():
    class Peeks(WorldStep):
        kind, version = "peeks", 1

        def outdated(self, params, outputs, ctx):
            return None

    with pytest.raises(RuntimeError, match="override watch"):
        register(Peeks)
    assert "peeks" not in REGISTRY


def test_params_default_is_every_field_in_the_key():
    class P(Params):
        a: int = 1
        b: str = "x"

    assert P().key_params() == {"a": 1, "b": "x"}


class Greets(Step):  # params inherited: from the manifest's top level and from an input
    kind, version = "greets", 1
    inputs = {"model": Slot(required=False)}

    class Params(Params):
        greeting: Annotated[str | None, Inherit(top="greeting")] = None
        style: Annotated[dict, Inherit(top="style")] = {}
        tone: Annotated[str | None, Inherit(slot="model", fallback="plain")] = None


def test_any_param_inherits_from_the_top_level_or_an_input(project):
    register(Greets)
    try:
        project.write_manifest(
            "greet",
            'greeting = "hello"\n[style]\ncase = "upper"\nwidth = 8\n'
            '[steps.a]\nkind = "greets"\nparams.tone = "warm"\nparams.style = { width = 4 }\n'
            '[steps.b]\nkind = "greets"\ninputs = { model = "a" }\nparams.greeting = "hi"\n'
            '[steps.c]\nkind = "greets"\n',
        )
        m = manifest.load("greet", project.manifests)
        a, b, c = (m.nodes[n].params for n in "abc")
        assert (a.greeting, a.style, a.tone) == ("hello", {"case": "upper", "width": 4}, "warm")
        assert (b.greeting, b.style, b.tone) == ("hi", {"case": "upper", "width": 8}, "warm")
        assert c.tone == "plain"  # no input to take it from: the fallback
        project.write_manifest("typo", 'greetin = "x"\n[steps.a]\nkind = "greets"\n')
        with pytest.raises(ManifestError, match="greetin: unknown key \\(did you mean 'greeting'"):
            manifest.load("typo", project.manifests)
    finally:
        REGISTRY.pop("greets")
