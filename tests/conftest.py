"""Shared test helpers: a throwaway project (manifests + store + out) and CLI runners."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from buildkit.cli.main import main
from buildkit.engine import manifest
from buildkit.engine.graph import topology
from buildkit.formats.checkpoint import model_part
from buildkit.formats.tensors import read_header

REPO = Path(__file__).resolve().parents[1]


class Project:
    """A temporary project: a copy of manifests/, its own store and output directory."""

    def __init__(self, root: Path):
        self.root = root
        self.manifests = root / "manifests"
        self.store = root / "cache"
        self.out = root / "out"
        shutil.copytree(REPO / "manifests", self.manifests, ignore=shutil.ignore_patterns("*.lock"))

    def write_manifest(self, name: str, text: str) -> Path:
        p = self.manifests / f"{name}.toml"
        p.write_text(text)
        return p

    def args(self, *argv: str) -> list[str]:
        return ["--store", str(self.store), "--manifests", str(self.manifests), *argv]

    def cli(self, *argv: str, capsys=None) -> int:
        """Run the CLI in-process; returns the exit code."""
        cwd = os.getcwd()
        os.chdir(self.root)
        try:
            return main(self.args(*argv))
        finally:
            os.chdir(cwd)

    def run(self, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run the CLI in a child process (for exit codes, concurrency and kills)."""
        p = subprocess.run(
            [sys.executable, "-m", "buildkit.cli", *self.args(*argv)],
            cwd=self.root,
            capture_output=True,
            text=True,
            **kw,
        )
        if check and p.returncode != 0:
            raise AssertionError(f"buildkit {' '.join(argv)} exited {p.returncode}:\n{p.stderr}")
        return p

    def build(self, variant: str, *extra: str) -> subprocess.CompletedProcess:
        return self.run("build", variant, "--out", str(self.out / variant), *extra)

    def adopt(self, other: Project) -> Project:
        """Start from a copy of another project's store and outputs (instead of rebuilding)."""
        shutil.copytree(other.store, self.store, dirs_exist_ok=True)
        if other.out.exists():
            shutil.copytree(other.out, self.out, dirs_exist_ok=True)
        return self


@pytest.fixture
def project(tmp_path) -> Project:
    return Project(tmp_path)


@pytest.fixture(scope="session")
def seed(tmp_path_factory) -> Project:
    """xl then xl-mtp built once per session; tests ``project.adopt(seed)`` rather than rebuild."""
    p = Project(tmp_path_factory.mktemp("seed"))
    for variant in ("xl", "xl-mtp"):
        assert p.cli("build", variant, "-q") == 0
    return p


# xl's steps in plan order (topological, ties by name), and each one's dependency wave: verify
# and eval both need only quantize (and reference, sanitize's), so with -j 2 they run, and are
# reported, in either order.
XL = ["fetch", "sanitize", "quantize", "reference", "eval", "verify", "publish"]
XL_MTP = [
    "fetch",
    "sanitize",
    "graft",
    "quantize",
    "reference",
    "eval",
    "requantize",
    "eval_head",
    "verify",
    "verify_head",
    "publish",
]
# The MTP head's norms, under its own names (language_model.mtp.<name>.weight)
HEAD_NORMS = (
    "pre_fc_norm_embedding",
    "pre_fc_norm_hidden",
    "norm",
    "layers.0.input_layernorm",
    "layers.0.post_attention_layernorm",
    "layers.0.self_attn.q_norm",
    "layers.0.self_attn.k_norm",
)


def in_build_order(steps: list[str], expected: list[str], variant: str = "xl") -> bool:
    """``steps`` are ``expected`` (as many times each) in an order the manifest's edges allow:
    two steps ready at once may be reported either way, so only the edges are checked."""
    if sorted(steps) != sorted(expected):
        return False
    preds = topology(manifest.load(variant, REPO / "manifests")).preds
    at = {n: i for i, n in enumerate(steps)}
    return all(at[p] < at[n] for n in at for p in preds[n] if p in at)


def ran(proc: subprocess.CompletedProcess) -> list[str]:
    """Names of the steps a build executed, read from its progress lines."""
    return [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("[run]")]


def cached(proc: subprocess.CompletedProcess) -> list[str]:
    return [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("[cached]")]


def acceptance_is_depth_one(e: dict) -> None:
    """Both heads' acceptance in an eval report is depth 1's rate: the same drafts (one pass
    of the output head for both)."""
    for suffix in ("", "_source"):
        a, n = e["drafts_by_depth" + suffix][0]
        assert e["acceptance" + suffix] == a / n, suffix


def shard_parts(out: Path) -> dict[str, Path]:
    """The model part each shard of a published directory holds (one per shard) -> its path."""
    parts = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        kinds = {model_part(n) for n in read_header(shard).tensors}
        assert len(kinds) == 1, (shard.name, kinds)
        parts[kinds.pop()] = shard
    return parts
