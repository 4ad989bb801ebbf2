"""A cache hit is the bytes a clean build would make; gc keeps what users built; plan predicts
build. Each test here failed before the fix it names (issue: cache truth)."""

from __future__ import annotations

import json
import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from conftest import REPO, ran
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buildkit.engine import manifest
from buildkit.engine.plan import Planner
from buildkit.engine.step import BuildOptions
from buildkit.store.store import Store

XL = (REPO / "manifests" / "xl.toml").read_text()


def with_rules_first(text: str, rules: list[tuple[str, str]]) -> str:
    """xl.toml with ``rules`` put before its own, in the given order."""
    head = "[recipe.rules]\n"
    lines = "".join(f'"{p}" = "{r}"\n' for p, r in rules)
    return text.replace(head, head + lines, 1)


def bits(out: Path, module: str) -> int:
    """The bits mlx_lm reads for a module: its per-path entry, else the default."""
    q = json.loads((out / "config.json").read_text())["quantization"]
    return q.get(module, q)["bits"]


LAYER0_GATE = "language_model.model.layers.0.mlp.switch_mlp.gate_proj"
SPECIFIC = ("*.layers.0.mlp.switch_mlp.*", "routed_expert")  # 6-bit
GATES = ("*.mlp.switch_mlp.gate_proj", "attention")  # 8-bit


def test_rule_order_is_in_the_key(project, seed):
    """Defect 1: two manifests that differ only in rule order resolve layer 0's gate_proj to
    different bits; the second must not reuse the first one's weights."""
    project.adopt(seed)
    project.write_manifest("order-a", with_rules_first(XL, [SPECIFIC, GATES]))
    project.write_manifest("order-b", with_rules_first(XL, [GATES, SPECIFIC]))
    project.build("order-a")
    b = project.build("order-b")
    assert "quantize" in ran(b)
    assert (
        bits(project.out / "order-a", LAYER0_GATE) == 6
        and bits(project.out / "order-b", LAYER0_GATE) == 8
    )
    fresh = project.__class__(project.root / "empty")  # an empty store makes the same bytes
    fresh.write_manifest("order-b", with_rules_first(XL, [GATES, SPECIFIC]))
    fresh.build("order-b")
    assert (fresh.out / "order-b" / "model.safetensors.index.json").read_bytes() == (
        project.out / "order-b" / "model.safetensors.index.json"
    ).read_bytes()
    shards = sorted((project.out / "order-b").glob("*.safetensors"))
    assert [p.read_bytes() for p in shards] == [
        (fresh.out / "order-b" / p.name).read_bytes() for p in shards
    ]


def test_a_child_rule_overrides_its_parent(project, seed):
    """Defect 2: a child's rules are tried before its parent's; explain lists them in that order."""
    project.adopt(seed)
    project.write_manifest(
        "xl-l0", 'extends = "xl"\n[recipe.rules]\n"*.layers.0.mlp.switch_mlp.*" = "attention"\n'
    )
    project.build("xl-l0")
    assert bits(project.out / "xl-l0", LAYER0_GATE) == 8
    assert (
        bits(project.out / "xl-l0", "language_model.model.layers.1.mlp.switch_mlp.gate_proj") == 6
    )
    text = project.run("explain", "xl-l0", "quantize").stdout
    rules = re.findall(r"^\s*\d+\. '([^']+)'", text, re.M)
    assert rules[0] == "*.layers.0.mlp.switch_mlp.*" and rules[1:] == list(dict(XL_RULES))


def test_gc_keeps_every_build_request_until_forgotten(project, seed, tmp_path, capsys):
    """Defect 3: a build with another source and out does not let gc free the default build's
    nodes; forget and --keep-last release them; a missing node says so, not "input changed"."""
    project.adopt(seed)
    other = tmp_path / "other-src"
    project.run("fixture", str(other), "--seed", "7")
    project.run("build", "xl", "--source", str(other), "--out", str(project.out / "xl-other"))
    assert project.cli("gc", "--dry-run") == 0
    assert "would free 0.0 MB" in capsys.readouterr().out.splitlines()[-1]
    assert project.cli("gc") == 0
    plan = project.run("plan", "xl").stdout
    assert plan.count("fresh") == 7, plan  # the default build is whole

    assert project.cli("forget", "xl", "--out", str(project.out / "xl-other")) == 0
    capsys.readouterr()
    assert project.cli("gc", "--dry-run") == 0
    dry = capsys.readouterr().out
    assert "xl:\n" in dry and "  quantize: 1 action(s)" in dry and "  fetch: 1 action(s)" in dry
    assert project.cli("gc") == 0
    capsys.readouterr()
    plan = project.run(
        "plan", "xl", "--source", str(other), "--out", str(project.out / "xl-other")
    ).stdout
    assert "stale quantize (quantize)" in plan and "output missing from the store" in plan
    assert "input" not in plan.split("stale fetch")[1].splitlines()[0]
    assert project.run("plan", "xl").stdout.count("fresh") == 7

    project.run("build", "xl", "--source", str(other), "--out", str(project.out / "xl-other"))
    assert project.cli("gc", "--keep-last", "1", "--dry-run") == 0
    assert "would forget build xl" in capsys.readouterr().out
    assert project.cli("gc", "--keep-last", "1") == 0
    capsys.readouterr()
    assert (
        project.run(
            "plan", "xl", "--source", str(other), "--out", str(project.out / "xl-other")
        ).stdout.count("fresh")
        == 7
    )


def test_plan_takes_builds_flags_and_predicts_it(project, seed, tmp_path):
    """Defect 4: plan --out says what build --out would do; build --dry-run runs nothing."""
    project.adopt(seed)
    elsewhere = tmp_path / "elsewhere"
    plan = project.run("plan", "xl", "--out", str(elsewhere), "--json").stdout
    predicted = {s["step"]: s["fresh"] for s in json.loads(plan)["steps"]}
    b = project.run("build", "xl", "--out", str(elsewhere))
    assert [n for n, fresh in predicted.items() if not fresh] == ran(b) == ["publish"]
    plan = json.loads(project.run("plan", "xl", "--out", str(elsewhere), "--json").stdout)
    assert plan["to_run"] == 0 and all(s["fresh"] for s in plan["steps"])
    dry = project.run("build", "xl", "--out", str(tmp_path / "third"), "--dry-run")
    assert "stale publish" in dry.stdout and not (tmp_path / "third").exists() and not ran(dry)


def test_bad_output_paths_fail_before_any_step(project, tmp_path):
    """Defect 5: --out under a file, or a foreign directory, exits 2 before quantize runs."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for out, says in ((a_file / "xl", "is a file"), (a_file, "is a file")):
        r = project.run("build", "xl", "--out", str(out), check=False)
        assert r.returncode == 2 and says in r.stderr and "[run]" not in r.stderr, r.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r = project.run("build", "xl", "--out", str(foreign), check=False)
    assert (
        r.returncode == 2 and "was not written by buildkit" in r.stderr and "[run]" not in r.stderr
    )
    assert not list((project.store / "actions").glob("*/*"))  # nothing ran
    assert project.run("plan", "xl", "--out", str(foreign), check=False).returncode == 2


# ---- the systematic defence: manifests and their mutations -------------------------------

XL_ROLES = __import__("tomllib").loads(XL)["recipe"]["roles"]
ROLE_BITS = {r: v["bits"] for r, v in XL_ROLES.items() if "bits" in v}  # the quantized roles
PASSTHROUGH = [r for r, v in XL_ROLES.items() if v.get("passthrough")]


def effective(text: str, names: list[str]) -> dict[str, tuple]:
    """What each tensor becomes under a manifest's recipe, worked out here by first-match-wins
    over the rules as the file orders them (child first) — independently of buildkit's code."""
    import tomllib

    chain, doc = [], tomllib.loads(text)
    while True:
        chain.append(doc)
        if not doc.get("extends"):
            break
        doc = tomllib.loads((REPO / "manifests" / f"{doc['extends']}.toml").read_text())
    rules, roles = [], {}
    for d in chain:  # child first
        rules += [
            (p, r) for p, r in d.get("recipe", {}).get("rules", {}).items() if p not in dict(rules)
        ]
    for d in reversed(chain):
        for k, v in d.get("recipe", {}).get("roles", {}).items():
            roles[k] = {**roles.get(k, {}), **v}
    out = {}
    for n in names:
        module = n.removesuffix(".weight")
        role = next(r for p, r in rules if fnmatchcase(n, p) or fnmatchcase(module, p))
        spec = roles[role]
        out[n] = (
            ("passthrough",)
            if spec.get("passthrough")
            else (spec["bits"], spec.get("group_size", 64))
        )
    return out


@pytest.fixture(scope="module")
def planned(seed, tmp_path_factory):
    """Quantize's key for a manifest text, planned against the seed's store (nothing built)."""
    root = tmp_path_factory.mktemp("mutations")
    store = Store(seed.store)
    cache: dict[str, str] = {}

    def key(text: str) -> tuple[str, list[str]]:
        if text not in cache:
            (root / "m.toml").write_text(text)
            for f in ("xl.toml", "xl-mtp.toml"):
                (root / f).write_text((REPO / "manifests" / f).read_text())
            m = manifest.load(str(root / "m.toml"), root)
            st = {
                s.name: s
                for s in Planner(m, store, BuildOptions(project_root=seed.root)).plan(["quantize"])
            }
            cache[text] = st["quantize"].key
        return cache[text]

    names = sorted(
        Store(seed.store)
        .get_artifact(store.get_ref("xl")["nodes"]["sanitize"]["outputs"]["model"])
        .tensors
    )
    return key, names


XL_RULES = list(__import__("tomllib").loads(XL)["recipe"]["rules"].items())
EXTRA = [
    ("*.layers.0.mlp.switch_mlp.*", "attention"),
    ("*.layers.1.*_proj", "embedding"),
    ("*.mlp.switch_mlp.down_proj", "router"),
    ("*.self_attn.q_proj", "routed_expert"),
]


def render(rules, bits: dict[str, int], description: str, comment: str, child: list | None) -> str:
    lines = [
        f"# {comment}",
        f'description = "{description}"',
        'source = "fixture:trained"',  # the seed's source: planned against its store
        "",
        "[recipe.roles]",
    ]
    lines += [f"{r} = {{ bits = {b}, group_size = 64 }}" for r, b in bits.items()]
    lines += [f"{r} = {{ passthrough = true }}" for r in PASSTHROUGH]
    lines += ["", "[recipe.rules]"]
    lines += [f'"{p}" = "{r}"' for p, r in rules]
    lines.append(XL[XL.index("[steps.fetch]") :])
    text = "\n".join(lines)
    if child:  # the same as a child manifest overriding a parent written out above
        return (
            text + "\n"
            if not child
            else text.replace(
                "[recipe.rules]\n",
                "[recipe.rules]\n" + "".join(f'"{p}" = "{r}"\n' for p, r in child),
                1,
            )
        )
    return text


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    swap=st.integers(-1, len(XL_RULES) - 2),
    bits=st.one_of(
        st.just(ROLE_BITS),
        st.fixed_dictionaries({r: st.sampled_from([4, 6, 8]) for r in ROLE_BITS}),
    ),
    child=st.lists(st.sampled_from(EXTRA), max_size=2, unique=True),
    description=st.sampled_from(["a", "b"]),
    comment=st.sampled_from(["x", "y"]),
)
def test_keys_change_exactly_when_what_a_tensor_becomes_changes(
    planned, swap, bits, child, description, comment
):
    """Reorder rules, change a role's bits, add an override tried first, edit the description or
    a comment: quantize's key changes if and only if some tensor would become something else."""
    key, names = planned
    base = render(XL_RULES, ROLE_BITS, "a", "x", None)
    rules = XL_RULES[:]
    if swap >= 0:  # two neighbouring rules change places
        rules[swap], rules[swap + 1] = rules[swap + 1], rules[swap]
    mutant = render(rules, bits, description, comment, child)
    try:
        want = effective(mutant, names) != effective(base, names)
    except StopIteration:
        return  # a shuffle that leaves a tensor to no rule: not a manifest buildkit would take
    try:
        got = key(mutant) != key(base)
    except Exception as e:  # a rule the order made dead: refused by name, never a silent reuse
        assert "match no tensor" in str(e)
        return
    assert got == want
    OUTCOMES.add(got)


OUTCOMES: set[bool] = set()


def test_the_mutations_reached_both_outcomes():
    """The property above saw keys that changed and keys that did not (it runs first)."""
    assert OUTCOMES == {True, False}


def test_cosmetic_edits_change_no_key(planned):
    key, _ = planned
    base = render(XL_RULES, ROLE_BITS, "a", "x", None)
    assert key(render(XL_RULES, ROLE_BITS, "another description", "another comment", None)) == key(
        base
    )
    assert key(
        base.replace(
            "keep = { passthrough = true }", "keep = { passthrough = true }\nunused = { bits = 2 }"
        )
    ) == key(base)


def test_status_shows_every_variant_with_its_last_build(project, seed):
    """status: every manifest, its last build request (source, out, when), fresh or stale and the
    first reason; --json for scripts."""
    project.adopt(seed)
    rows = {r["variant"]: r for r in json.loads(project.run("status", "--json").stdout)}
    assert set(rows) == {p.stem for p in project.manifests.glob("*.toml")}
    assert (
        rows["xl"]["built"]
        and rows["xl"]["state"] == "fresh"
        and rows["xl"]["source"] == "fixture:trained"
    )
    # oq4e-mtp-xl shares xl's fetch and sanitize: stale, not "never built"
    assert rows["oq4e-mtp-xl"]["state"] == "stale" and not rows["oq4e-mtp-xl"]["built"]
    assert rows["oq4e-mtp-xl"]["reason"].endswith("steps in the store, shared with xl, xl-mtp)")
    xl = project.manifests / "xl.toml"
    xl.write_text(
        xl.read_text().replace("embedding     = { bits = 8,", "embedding     = { bits = 4,")
    )
    rows = {r["variant"]: r for r in json.loads(project.run("status", "--json").stdout)}
    assert rows["xl"]["state"] == "stale" and rows["xl"]["reason"].startswith(
        "quantize: params.plan.roles.embedding"
    )
    text = project.run("status").stdout
    assert "xl " in text and "stale" in text and "quantize: params.plan.roles.embedding" in text
