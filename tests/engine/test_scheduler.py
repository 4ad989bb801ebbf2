"""Plan and build: what re-runs and why, step versions, concurrent builds, explain, the store
option."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import XL, XL_MTP, cached, in_build_order, ran

from buildkit.engine import manifest
from buildkit.engine.graph import topology
from buildkit.engine.plan import action_key
from buildkit.engine.step import kinds, library_version
from buildkit.steps.quantize import Quantize

XL4 = 'extends = "xl"\n[recipe.roles]\nrouted_expert = { bits = 4, group_size = 64 }\n'


def cli(project, capsys, *argv):
    """Run the CLI in-process; returns what ``ran``/``cached`` read (returncode, stdout, stderr)."""
    rc = project.cli(*argv)
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)


def plan(project, variant: str) -> dict[str, str]:
    """step -> its plan line without the key: 'fresh' or 'stale: <reasons>'."""
    out = project.run("plan", variant).stdout.splitlines()
    assert out[-1].startswith(f"{variant}: ")
    lines = [
        re.fullmatch(
            r"(fresh|stale) (\S+) \((\S+)\) ([0-9a-f]{12}|\(key depends on [\w, -]+\))(: .+)?", s
        )
        for s in out[:-1]
    ]
    assert all(lines), out
    return {m[2]: m[1] + (m[5] or "") for m in lines}


def popen(project, *argv) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "buildkit.cli", *project.args(*argv)],
        cwd=project.root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(*procs: subprocess.Popen) -> list[SimpleNamespace]:
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        done.append(SimpleNamespace(returncode=p.returncode, stdout=out, stderr=err))
    return done


def test_first_build_runs_everything_second_nothing(project):
    first = project.build("xl")
    order = ran(first)  # "[run]" is printed once a step's inputs are hashed: two ready at
    assert sorted(order) == sorted(XL)  # once may print in either order, so check the edges
    preds = topology(manifest.load("xl", project.manifests)).preds
    assert all(order.index(p) < order.index(n) for n in XL for p in preds[n]), order
    assert all(f"[run]    {n} ({n}): never built\n" in first.stderr for n in XL)
    assert "xl: 7 steps, 7 ran, 0 cached" in first.stderr
    second = project.build("xl")
    assert ran(second) == [] and in_build_order(cached(second), XL)
    assert "xl: 7 steps, 0 ran, 7 cached" in second.stderr
    assert plan(project, "xl") == dict.fromkeys(XL, "fresh")
    assert project.run("plan", "xl").stdout.endswith("xl: 7 steps, 0 to run\n")
    # writes are temp file + rename: nothing half-written is left behind
    assert list((project.store / "tmp").iterdir()) == []
    assert [p for p in project.root.rglob("*") if ".tmp" in p.name] == []


def imported(
    project, *argv: str, check: bool = True
) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the CLI with ``python -X importtime``: the result and the top-level packages imported."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "buildkit.cli", *project.args(*argv)],
        cwd=project.root,
        capture_output=True,
        text=True,
        check=check,
    )
    mods = {
        m[1].split(".")[0]
        for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", p.stderr, re.M)
    }
    return p, mods


def test_a_build_with_nothing_to_do_imports_no_numerics(project, seed):
    """A no-op build (and a plan) decide from the store alone: numpy, mlx, mlx_lm and tokenizers
    are never imported, not even by the scheduler's early imports, which start only for a node
    that runs or was never built."""
    project.adopt(seed)
    heavy = {"numpy", "mlx", "mlx_lm", "transformers", "tokenizers"}
    p, mods = imported(project, "build", "xl-mtp", "--out", str(project.out / "xl-mtp"))
    assert ran(p) == [] and "xl-mtp: 11 steps, 0 ran, 11 cached" in p.stderr
    assert not mods & heavy, sorted(mods & heavy)
    assert "pydantic" in mods  # the check sees the imports at all
    _, mods = imported(project, "plan", "xl-mtp")
    assert not mods & heavy, sorted(mods & heavy)
    (project.out / "xl-mtp" / "config.json").unlink()  # publish alone runs; its shards are
    p, mods = imported(project, "build", "xl-mtp", "--out", str(project.out / "xl-mtp"))
    assert ran(p) == ["publish"] and "4 of 4 shards hard-linked" in p.stderr  # linked, not copied,
    assert "load check: not run again" in p.stderr and not mods & heavy  # and the check remembered
    (project.out / "xl-mtp" / "config.json").unlink()  # a store that forgot the check: it runs
    shutil.rmtree(project.store / "memos" / "loadcheck")
    p, mods = imported(project, "build", "xl-mtp", "--out", str(project.out / "xl-mtp"))
    assert "load check: mlx_lm loaded the model" in p.stderr and {"numpy", "mlx", "mlx_lm"} <= mods


def test_a_graph_edited_after_a_build_is_worked_out_again(project, seed):
    """An edit that adds a step, or closes a cycle, is seen by the next plan."""
    project.adopt(seed)
    text = (project.manifests / "xl.toml").read_text()
    project.write_manifest(
        "xl",
        text
        + '[steps.verify2]\nkind = "verify"\ninputs = { model = ["quantize"], source = "fetch" }\n',
    )
    steps = plan(project, "xl")  # verify2's key is verify's: same step, same inputs
    assert steps == {**dict.fromkeys(XL, "fresh"), "verify2": "fresh"}
    assert list(steps).index("verify2") > list(steps).index("quantize")
    project.write_manifest(
        "xl", text.replace('inputs = { source = "fetch" }', 'inputs = { source = "quantize" }')
    )
    p = project.run("plan", "xl", check=False)
    assert p.returncode == 2 and "cycle between steps" in p.stderr, p.stderr


def test_one_param_change_reruns_exactly_its_dependents(project, seed):
    project.adopt(seed)
    project.write_manifest("xl4", XL4)
    assert plan(project, "xl4") == {
        "fetch": "fresh",
        "sanitize": "fresh",
        "quantize": "stale: params.plan.roles.routed_expert.bits changed 6→4",
        "reference": "fresh",  # xl's: the same source and text
        "verify": "stale: input quantize will be rebuilt first",
        "eval": "stale: input quantize will be rebuilt first",
        "publish": "stale: input quantize, verify, eval will be rebuilt first",
    }
    # a partial build records only what it built (not the parent's nodes it compared against)
    assert cached(project.build("xl4", "--target", "sanitize")) == ["fetch", "sanitize"]
    assert set(json.loads((project.store / "refs" / "xl4.json").read_text())["keys"]) == {
        "fetch",
        "sanitize",
    }
    b = project.build("xl4")
    assert in_build_order(ran(b), [n for n in XL[2:] if n != "reference"])
    assert sorted(cached(b)) == ["fetch", "reference", "sanitize"]
    assert (
        "[run]    quantize (quantize): params.plan.roles.routed_expert.bits changed 6→4\n"
        in b.stderr
    )
    assert "[run]    verify (verify): input quantize changed (slot model)\n" in b.stderr
    assert "[run]    eval (eval): input quantize changed (slot model)\n" in b.stderr
    assert ran(project.build("xl4")) == []

    # The same edit made to xl itself: quantize, verify and eval are already in the store (xl4 built
    # them; keys name content, not variants), only xl's own output directory is out of date.
    xl = project.manifests / "xl.toml"
    xl.write_text(
        xl.read_text().replace("routed_expert = { bits = 6,", "routed_expert = { bits = 4,")
    )
    p = plan(project, "xl")
    assert [n for n, s in p.items() if s != "fresh"] == ["publish"]
    assert p["publish"] == f"stale: output directory {project.out}/xl holds another build"
    # A value never built: the reason compares with xl's own last build.
    xl.write_text(
        xl.read_text().replace("routed_expert = { bits = 4,", "routed_expert = { bits = 5,")
    )
    assert (
        plan(project, "xl")["quantize"] == "stale: params.plan.roles.routed_expert.bits changed 6→5"
    )


def test_target_and_failed_builds_keep_what_they_built(project):
    assert ran(project.build("xl", "--target", "sanitize")) == ["fetch", "sanitize"]
    project.write_manifest("typo", 'extends = "xl"\n[recipe.rules]\n"*.no_such_module" = "keep"\n')
    p = project.run("build", "typo", check=False)
    assert p.returncode == 1
    # the dead rule is found when quantize's key resolves the rules, before it runs
    # (reference needs only sanitize: it may run before the failure stops the build)
    assert cached(p) == ["fetch", "sanitize"] and set(ran(p)) <= {"reference"}
    assert "buildkit: error: step 'quantize' (quantize) failed: " in p.stderr
    assert "'*.no_such_module'" in p.stderr and "Traceback" not in p.stderr
    assert not (project.store / "refs" / "typo.json").exists()
    assert ran(project.build("xl", "--target", "quantize")) == ["quantize"]
    assert in_build_order(ran(project.build("xl")), [n for n in XL[3:] if n not in ran(p)])


@pytest.mark.parametrize("kind", sorted(kinds()))
def test_every_kind_declares_its_own_version(kind):
    """A subclass (requantize of quantize) must not inherit its parent's version silently."""
    cls = kinds()[kind]
    assert "version" in vars(cls), f"{cls.__name__} inherits version from {cls.__mro__[1].__name__}"
    assert isinstance(cls.version, int) and cls.version >= 1


def test_step_version_bump_reruns_only_that_kind(project, seed, capsys, monkeypatch):
    project.adopt(seed)
    v = Quantize.version
    monkeypatch.setattr(Quantize, "version", v + 1)
    assert kinds()["requantize"].version == v  # requantize subclasses quantize, keeps its own
    p = cli(project, capsys, "plan", "xl-mtp")
    assert re.search(
        rf"^stale quantize \(quantize\) \w{{12}}: step version changed {v}→{v + 1}$", p.stdout, re.M
    )
    assert re.search(r"^fresh requantize ", p.stdout, re.M)
    b = cli(project, capsys, "build", "xl-mtp")
    assert b.returncode == 0
    assert f"[run]    quantize (quantize): step version changed {v}→{v + 1}\n" in b.stderr
    # The new version wrote the same bytes, so the dependents' inputs did not change: early
    # cutoff keeps verify, eval and publish cached (a changed output would re-run them, see above).
    assert ran(b) == ["quantize"]
    assert sorted(cached(b)) == sorted(set(XL_MTP) - {"quantize"})
    assert ran(cli(project, capsys, "build", "xl-mtp")) == []
    monkeypatch.undo()
    assert ran(cli(project, capsys, "build", "xl-mtp")) == []  # version 1's record is still there


def test_concurrent_builds_of_one_variant_run_each_node_once(project):
    a, b = finish(popen(project, "build", "xl"), popen(project, "build", "xl"))
    assert Counter(ran(a) + ran(b)) == Counter(XL)
    assert sorted(ran(a) + cached(a)) == sorted(XL) == sorted(ran(b) + cached(b))
    assert ran(project.build("xl")) == []


def test_concurrent_builds_of_overlapping_variants_share_nodes(project):
    a, b = finish(popen(project, "build", "xl"), popen(project, "build", "xl-mtp"))
    # xl-mtp reuses xl's trunk verify and eval
    shared = ["fetch", "sanitize", "quantize", "reference", "verify", "eval"]
    assert Counter(n for n in ran(a) + ran(b) if n in shared) == Counter(shared)
    assert set(ran(a)) >= {"publish"}
    assert set(ran(b)) >= {"graft", "requantize", "verify_head", "eval_head", "publish"}
    assert sorted(ran(b) + cached(b)) == sorted(XL_MTP)
    assert ran(project.build("xl")) == [] and ran(project.build("xl-mtp")) == []


def test_explain_prints_the_ingredients_of_the_key(project, seed, capsys):
    project.adopt(seed)
    r = cli(project, capsys, "explain", "xl", "quantize", "--json")
    assert r.returncode == 0
    d = json.loads(r.stdout)
    assert (d["node"], d["kind"], d["fresh"], d["reasons"]) == ("quantize", "quantize", True, [])
    assert d["inputs"] == {"model": ["sanitize:model"]}
    ingr = d["ingredients"]
    assert set(ingr) == {"kind", "version", "params", "inputs", "libraries", "fingerprint"}
    assert (ingr["kind"], ingr["version"]) == ("quantize", 3)
    assert ingr["params"]["plan"]["roles"]["routed_expert"]["bits"] == 6
    assert (
        ingr["params"]["plan"]["tensors"][
            "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"
        ]
        == "routed_expert"
    )
    assert ingr["libraries"] == {"mlx": library_version("mlx")}
    ref = json.loads((project.store / "refs" / "xl.json").read_text())
    assert ingr["inputs"] == {"model": [ref["nodes"]["sanitize"]["outputs"]["model"]]}
    assert d["key"] == action_key(ingr)
    fetch = json.loads(cli(project, capsys, "explain", "xl", "fetch", "--json").stdout)
    assert fetch["fresh"] and fetch["ingredients"]["libraries"] == {}
    assert "config.json" in fetch["ingredients"]["fingerprint"]


def test_buildkit_store_env_var_is_honoured(project, tmp_path):
    env_store = tmp_path / "env-store"
    base = [sys.executable, "-m", "buildkit.cli", "--manifests", str(project.manifests)]
    env = {**os.environ, "BUILDKIT_STORE": str(env_store)}
    p = subprocess.run(
        [*base, "build", "xl", "--target", "fetch"],
        cwd=project.root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert ran(p) == ["fetch"]
    assert list((env_store / "actions").glob("*/*")) and not (project.root / "cache").exists()
    # --store wins over the variable
    p = subprocess.run(
        [*base, "--store", str(project.store), "plan", "xl"],
        cwd=project.root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and "stale fetch (fetch)" in p.stdout


def test_forward_passes_run_one_at_a_time(project):
    """Steps of one resource ("forward": calibrate, reference, eval, sensitivity) never overlap
    at -j 2, while others run beside them: oq4e's calibrate and reference are ready together,
    as are its eval and eval_baseline, and two forward passes at once held twice the memory."""
    proc = project.build("oq4e-mtp-xl", "-j", "2")
    lines = proc.stderr.splitlines()
    kinds_of = {"calibrate", "reference", "eval", "sensitivity"}
    spans, starts = [], {}
    for i, line in enumerate(lines):
        parts = line.split()
        if len(parts) < 3 or parts[0] not in ("[run]", "[done]"):
            continue
        name, kind = parts[1], parts[2].strip("():")
        if kind in kinds_of and parts[0] == "[run]":
            starts[name] = i
        elif kind in kinds_of:
            spans.append((starts.pop(name), i, name))
    assert len(spans) >= 5, spans  # calibrate, reference(s), eval, eval_head, eval_baseline
    spans.sort()
    for (_, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        assert a1 < b0, f"{a} and {b} ran at once"
    # the others still run beside a forward pass: something started while calibrate ran
    c0, c1, _ = next(s for s in spans if s[2] == "calibrate")
    assert any(line.startswith("[run]") for line in lines[c0 + 1 : c1])


def test_the_longest_chain_starts_first(project):
    """Of two ready steps, the one with more steps waiting behind it runs first, whatever their
    names: ``stats`` (calibrate -> quantize -> eval -> publish) before ``reference`` (-> eval ->
    publish), which a walk by name would start first. At 35B, oq's sensitivity so goes ahead
    of its reference, and GPTQ (no forward pass) runs beside the reference."""
    project.write_manifest(
        "xl-stats",
        'extends = "xl"\n'
        "[recipe.roles]\n"
        'routed_expert = { bits = 4, group_size = 64, calibrated = true, method = "search" }\n'
        "[steps.stats]\n"
        'kind = "calibrate"\n'
        'inputs = { model = "sanitize:model" }\n'
        "[steps.quantize]\n"
        'inputs = { calibration = "stats" }\n',
    )
    top = topology(manifest.load("xl-stats", project.manifests))
    assert (top.height["stats"], top.height["reference"], top.height["publish"]) == (4, 3, 1)
    order = ran(project.build("xl-stats", "-j", "1"))
    assert order.index("stats") < order.index("reference"), order
