"""The README's examples are real: its DAG picture is what `buildkit graph` prints, its
complete manifest plans and its rules cover the checkpoint, and every command it lists parses."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import REPO, Project

from buildkit.cli.main import parser
from buildkit.engine import graph as graphs
from buildkit.engine import manifest

README = (REPO / "README.md").read_text()


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_dag_picture_is_what_graph_prints():
    shown = blocks("mermaid", section("A variant's DAG"))
    assert len(shown) == 1
    m = manifest.load("xl-mtp", REPO / "manifests")
    assert shown[0].strip() == graphs.render(graphs.build(m), "mermaid").strip()


def test_the_complete_manifest_plans_and_its_rules_cover_the_checkpoint(tmp_path, capsys):
    complete = [b for b in blocks("toml", section("A manifest")) if "extends" not in b]
    assert len(complete) == 1 and "[steps.publish]" in complete[0]
    p = Project(tmp_path)
    p.write_manifest("my-4bit", complete[0])
    assert p.cli("plan", "my-4bit") == 0
    assert "my-4bit: 6 steps, 6 to run" in capsys.readouterr().out
    # estimate assigns every tensor a role as quantize does: an unmatched tensor or rule fails
    assert p.cli("estimate", "my-4bit") == 0
    assert "bits per weight:" in capsys.readouterr().out


def test_the_estimate_example_runs_on_the_default_source(tmp_path, capsys):
    assert Project(tmp_path).cli("estimate", "xl-3bit") == 0
    assert "bits per weight:" in capsys.readouterr().out


def commands() -> list[list[str]]:
    (shown,) = blocks("sh", section("Commands"))
    lines = [ln.split("#", 1)[0].strip() for ln in shown.splitlines()]
    return [shlex.split(ln)[1:] for ln in lines if ln.startswith("buildkit ")]


@pytest.mark.parametrize("argv", commands(), ids=" ".join)
def test_every_listed_command_parses(argv):
    parser(fixture_options=True).parse_args(argv)


def test_the_command_list_names_every_command():
    sub = next(a for a in parser()._actions if a.dest == "cmd")
    assert set(sub.choices) - {argv[0] for argv in commands()} == set()
