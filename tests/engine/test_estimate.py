"""buildkit estimate: size and bits per weight from config.json and headers, equal to the
build's."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import Project

from buildkit.engine import manifest
from buildkit.engine.estimate import layouts
from buildkit.fixtures.generated import PRESETS, FixtureSpec, generate
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.tensors import read_header
from buildkit.grade.weights import DirWeights
from buildkit.quant.estimate import summary
from buildkit.store.store import Store


def published_bytes(out: Path) -> int:
    """The published model's tensor bytes: the sum of every shard's tensor payloads."""
    return sum(i.nbytes for f in out.glob("*.safetensors") for i in read_header(f).tensors.values())


def run_json(p: Project, capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert p.cli("estimate", *argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def built3(seed: Project, tmp_path_factory) -> Project:
    p = Project(tmp_path_factory.mktemp("est")).adopt(seed)
    assert p.cli("build", "xl-3bit", "-q", "--out", str(p.out / "xl-3bit")) == 0
    return p


@pytest.mark.parametrize("variant", ["xl", "xl-mtp", "xl-3bit"])
def test_estimate_equals_the_built_models_bytes(built3, capsys, variant):
    p = built3
    e = run_json(p, capsys, variant)
    actual = published_bytes(p.out / variant)
    assert abs(e["bytes"] - actual) <= 0.001 * actual  # in fact equal:
    assert e["bytes"] == actual
    # quantize's own figure counts the same tensors (trunk and vision tower)
    nodes = Store(p.store).get_ref(variant)["nodes"]
    q = Store(p.store).get_artifact(nodes["quantize"]["outputs"]["out"]).meta
    assert e["bits_per_weight"] == pytest.approx(q["bits_per_weight"], abs=1e-4)
    assert {r["role"]: r["tensors"] for r in e["roles"] if r["step"] == "quantize"} == {
        k: v["tensors"] for k, v in q["role_table"].items()
    }
    assert ("mtp" in e["parts"]) == (variant == "xl-mtp")
    assert {"bits_per_weight", "bytes", "roles"} <= set(e)


def rchar() -> int:
    """Bytes this process has read through read() so far (Linux /proc/self/io)."""
    return int(
        next(
            ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("rchar:")
        ).split()[1]
    )


def test_estimate_reads_headers_only(project, capsys, tmp_path):
    """Estimating from a directory reads its config and shard headers, not the tensors."""
    src = generate(tmp_path / "full", FixtureSpec())
    shards = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    full = run_json(project, capsys, "xl-mtp", "--source", str(src))  # imports done
    before = rchar()
    again = run_json(project, capsys, "xl-mtp", "--source", str(src))
    read = rchar() - before
    assert again == full and read < shards / 10, (read, shards)
    # the fixture: source plans from the generator without writing it, to the same figures
    fixture = run_json(project, capsys, "xl-mtp", "--source", "fixture:seed=0")
    assert fixture == {**full, "source": "fixture:seed=0"}
    shutil.rmtree(src)


def test_the_35b_sparse_fixture_estimates_as_the_published_xl(tmp_path, project, capsys):
    """The real model's shapes as a sparse file set: ~72 GB apparent, a few tens of MB on disk;
    xl on it computes to the published BaseQuant_XL figures."""
    src = tmp_path / "35b"
    generate(src, FixtureSpec(**PRESETS["qwen3.6-35b-a3b"]), sparse=True)
    try:
        files = list(src.iterdir())
        apparent = sum(f.stat().st_size for f in files)
        on_disk = sum(f.stat().st_blocks * 512 for f in files)
        assert 71.5e9 < apparent < 72.5e9 and on_disk < 100e6
        assert len([f for f in files if f.suffix == ".safetensors"]) == 26
        m = manifest.load("xl-mtp", project.manifests, source=str(src))
        e = summary(m.name, m.source, layouts(m))
        assert (
            e["parts"]["language_model"]["params"] + e["parts"]["vision_tower"]["params"]
            == 35_107_181_936
        )
        assert e["parts"]["mtp"]["params"] == 844_640_768
        xl = run_json(project, capsys, "xl", "--source", str(src))
        assert 6.81 <= xl["bits_per_weight"] <= 6.82
        assert 6.77 <= xl["bits_per_weight_text"] <= 6.79
        assert 29.8e9 <= xl["bytes"] <= 30.0e9
        assert xl["bytes"] == e["bytes_without_head"]
        assert 0.68e9 <= e["parts"]["mtp"]["bytes"] <= 0.72e9
        three = run_json(project, capsys, "xl-3bit", "--source", str(src))
        assert 4.0 <= three["bits_per_weight"] <= 4.1 and 17.5e9 <= three["bytes"] <= 18.1e9
        assert math.isclose(apparent, 2 * (35_107_181_936 + 844_640_768), rel_tol=1e-3)
        # what a forward pass's floor is counted in: the "A3B", ~3B weights a token meets
        # (every layer's matrices, 8 of 256 routed experts, the output head; no embedding)
        w = DirWeights(src)
        active, head = ckpt.active_weights(w.config, w.shapes)
        assert len(active) == 40 and 2.9e9 < sum(active) + head < 3.0e9, (sum(active), head)
        assert head == 248_320 * 2048
        assert ckpt.pass_tflop(w.config, w.shapes, 1000, heads=2) == round(
            2 * 1000 * (sum(active) + 2 * head) / 1e12, 3
        )
    finally:
        shutil.rmtree(src)


def test_estimate_refuses_what_quantize_refuses(project, capsys):
    project.write_manifest(
        "g128", 'extends = "xl"\n[recipe.roles]\nrouted_expert = { bits = 6, group_size = 128 }\n'
    )
    assert project.cli("estimate", "g128") != 0
    assert "last dimension 64 is not a multiple of group_size 128" in capsys.readouterr().err
    project.write_manifest("typo", 'extends = "xl"\n[recipe.rules]\n"*.mlp.gaet" = "router"\n')
    assert project.cli("estimate", "typo") != 0
    assert "'*.mlp.gaet' match no tensor" in capsys.readouterr().err


def test_estimate_says_a_budget_and_the_range_it_reaches(project, capsys):
    """oq-budget's experts get their bits at build time; estimate gives the range, which ends
    where every budgeted expert is at its lowest (3) and highest (8) bits."""
    e = run_json(project, capsys, "oq-budget")
    b = {x["step"]: x for x in e["budgets"]}["quantize"]
    assert b["target_bpw"] == 4.5 and b["tensors"] == 12
    for bits, end in ((3, "lowest_bpw"), (8, "highest_bpw")):
        project.write_manifest(
            f"x{bits}", f'extends = "xl"\n[recipe.roles]\nrouted_expert = {{ bits = {bits} }}\n'
        )
        assert run_json(project, capsys, f"x{bits}")["bits_per_weight"] == b[end]
    capsys.readouterr()
    assert project.cli("estimate", "oq-budget") == 0
    assert "below the lowest reachable and the build will refuse it" in capsys.readouterr().out
