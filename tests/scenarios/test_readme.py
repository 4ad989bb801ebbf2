"""The README's examples are real: its set-up is what CI runs, its DAG picture is what
`buildkit graph` prints, its complete manifest plans and its rules cover the checkpoint, every
command it lists parses and runs in order, and its "Using the output" snippets run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

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
    assert "my-4bit: 7 steps, 7 to run" in capsys.readouterr().out
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


# ---- The README runs as written: its set-up is CI's, and its examples run in a shell.


def shell_lines(block: str) -> list[str]:
    """A sh block's commands, comments and continuation comments dropped."""
    lines = [ln.split("  #", 1)[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_ci_runs_the_readme_setup_as_written_in_order():
    (setup,) = blocks("sh", section("Set-up").split("The default manifests", 1)[0])
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    ran = [ln for ln in ci if ln and not ln.startswith(("#", "set ", "cd "))]
    assert shell_lines(setup) == ["make xl-mtp", "make test"]
    assert ran == shell_lines(setup)


def bash(line: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run one README line as a user would, with this interpreter's venv first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, **(env or {})}
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def commands_run(tmp_path_factory) -> tuple[Path, list[tuple[str, subprocess.CompletedProcess]]]:
    """The Commands block run top to bottom in a copy of the repository's manifests (locks
    included: verify --against reads one), the store its default ./cache, HOME a tmp dir."""
    root = tmp_path_factory.mktemp("readme-commands")
    shutil.copytree(REPO / "manifests", root / "manifests")
    (shown,) = blocks("sh", section("Commands"))
    runs = []
    for line in shell_lines(shown):
        runs.append((line, bash(line, root, {"HOME": str(root), "BUILDKIT_STORE": ""})))
        if runs[-1][1].returncode != 0:
            break  # later lines build on earlier ones
    return root, runs


def test_every_readme_command_runs_in_order_and_exits_0(commands_run):
    _, runs = commands_run
    (shown,) = blocks("sh", section("Commands"))
    assert [line for line, _ in runs] == shell_lines(shown)
    for line, p in runs:
        assert p.returncode == 0, f"README: `{line}` exited {p.returncode}:\n{p.stderr[-3000:]}"


@pytest.fixture(scope="module")
def made(commands_run, tmp_path_factory) -> Path:
    """A working directory whose out/xl-mtp is what `make xl-mtp` built: the checkout's own
    (CI runs `make xl-mtp` first), else the Commands block's `buildkit build xl-mtp`."""
    cwd = tmp_path_factory.mktemp("readme-use")
    repo_made = REPO / "out" / "xl-mtp" / "config.json"
    (cwd / "out").symlink_to(REPO / "out" if repo_made.exists() else commands_run[0] / "out")
    assert (cwd / "out" / "xl-mtp" / "config.json").exists()
    return cwd


def test_the_mlx_lm_snippet_runs(made):
    (snippet,) = blocks("python", section("Using the output"))
    (made / "snippet.py").write_text(snippet)
    p = subprocess.run(
        [sys.executable, "snippet.py"], cwd=made, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip(), "generate printed nothing"


def vlm_lines() -> list[str]:
    (shown,) = blocks("sh", section("Using the output"))
    return shell_lines(shown)


def test_using_the_output_shows_text_drafter_and_image_runs():
    lines = vlm_lines()
    assert len(lines) == 3 and all("mlx_vlm.generate" in ln for ln in lines)
    assert "--draft-kind mtp" in lines[1] and "--image" in lines[2]


@pytest.mark.parametrize("line", vlm_lines(), ids=["text", "drafter", "image"])
def test_every_mlx_vlm_command_runs(made, line):
    if "--image" in line:
        assert (made / "out" / "xl-mtp" / "preprocessor_config.json").exists()
        from PIL import Image

        image = shlex.split(line)[shlex.split(line).index("--image") + 1]
        Image.new("RGB", (64, 64), (200, 120, 40)).save(made / image)
    p = bash(line, made)
    assert p.returncode == 0, f"README: `{line}` exited {p.returncode}:\n{p.stderr[-3000:]}"
    assert p.stdout.strip(), "mlx_vlm generated no text"  # it prints the generated text alone
    if "--draft-model" in line:  # the drafter really drafted
        assert "Speculative decoding:" in p.stdout + p.stderr
