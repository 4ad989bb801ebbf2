"""Every ``buildkit/…`` path the repository's text names (comments, docstrings, docs, manifests)
exists: a module that moves takes its mentions with it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", "Makefile", "run")
PATH = re.compile(r"(?<![\w./-])buildkit/(?:[\w./*-]|\{[^{}\s]*\})+")


def text_files() -> list[Path]:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    this = Path(__file__).relative_to(REPO).as_posix()  # its examples name missing paths
    return [REPO / f for f in tracked if f.endswith(TEXT) and (REPO / f).is_file() and f != this]


def missing(files: list[Path], root: Path = REPO) -> list[str]:
    """'file:line: path' for every ``buildkit/…`` path named in ``files`` that ``root`` lacks (a
    glob must match something; ``{a,b}`` names each)."""
    found = []
    for f in files:
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in PATH.finditer(line):
                for p in expand(m.group(0).rstrip("./-")):
                    if not (any(root.glob(p)) if "*" in p else (root / p).exists()):
                        found.append(f"{f.relative_to(root)}:{n}: {p}")
    return found


def expand(path: str) -> list[str]:
    """``buildkit/{a,b}.py`` -> both paths."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path.replace(m.group(0), alt, 1))]


def test_every_buildkit_path_in_the_repository_exists():
    assert missing(text_files()) == []


def test_the_check_catches_a_moved_module(tmp_path):
    (tmp_path / "buildkit" / "engine").mkdir(parents=True)
    (tmp_path / "buildkit" / "engine" / "plan.py").write_text("")
    doc = tmp_path / "notes.md"
    doc.write_text(
        "see buildkit/engine/plan.py and buildkit/estimate.py.\n`buildkit/{engine,x}/`\n"
    )
    assert missing([doc], tmp_path) == [
        "notes.md:1: buildkit/estimate.py",
        "notes.md:2: buildkit/x",
    ]
