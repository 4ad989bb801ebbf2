"""The Step interface as a plugin author meets it: the docstring's example builds, and a step
that looks outside the store without saying where is refused when it registers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buildkit.engine.step import REGISTRY, Params, Slot, Step, register
from buildkit.store.artifact import Artifact


class UpperParams(Params):
    suffix: str = "!"


class Upper(Step):  # the example in engine/step.py's Step docstring
    kind, version = "upper", 1
    Params = UpperParams
    inputs = {"model": Slot()}

    def run(self, ctx, params, inputs):
        model = inputs["model"][0]
        return {"out": Artifact(tensors=model.tensors, meta={"suffix": params.suffix})}


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
[recipe.roles]
keep = { passthrough = true }
[recipe.rules]
"*" = "keep"
[steps.fetch]
kind = "fetch"
[steps.sanitize]
kind = "sanitize"
inputs = { source = "fetch" }
[steps.upper]
kind = "upper"
inputs = { model = "sanitize:model" }
params.suffix = "?"
[steps.noted]
kind = "noted"
inputs = { model = "upper" }
"""


@pytest.fixture
def plugins():
    for cls in (Upper, Noted):
        register(cls)
    yield
    for cls in (Upper, Noted):
        REGISTRY.pop(cls.kind)


def plan(project, capsys) -> dict:
    capsys.readouterr()
    assert project.cli("plan", "plugin", "--json") == 0
    return {s["step"]: s for s in json.loads(capsys.readouterr().out)["steps"]}


def test_a_plugin_step_builds_and_a_file_it_reads_reruns_it(project, plugins, capsys):
    project.write_manifest("plugin", MANIFEST)
    (project.root / "note.txt").write_text("one")
    assert project.cli("build", "plugin") == 0
    steps = plan(project, capsys)
    assert all(s["fresh"] for s in steps.values())
    (project.root / "note.txt").write_text("two")
    steps = plan(project, capsys)
    assert [n for n, s in steps.items() if not s["fresh"]] == ["noted"]
    assert steps["noted"]["reasons"] == ["source changed: note"]


def test_register_refuses_an_outside_look_without_watch():
    class Peeks(Step):
        kind, version = "peeks", 1

        def outdated(self, params, outputs, ctx):
            return None

    with pytest.raises(RuntimeError, match="override watch too"):
        register(Peeks)
    assert "peeks" not in REGISTRY
