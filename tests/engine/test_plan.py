"""Planning: why_changed's reasons, action keys, and a Planner's fresh/stale view of a built
store."""

from __future__ import annotations

import copy

import pytest

from buildkit.core.errors import UsageError
from buildkit.engine import manifest
from buildkit.engine.plan import MISSING, Planner, action_key, why_changed
from buildkit.engine.step import BuildOptions
from buildkit.store.store import Store

D1, D2, D3 = (f"xxh3_128:{c * 32}" for c in "123")
T = "language_model.model.layers.{}.mlp.switch_mlp.{}_proj.weight"


@pytest.fixture(scope="module")
def nodes():
    from conftest import REPO

    return manifest.load("xl-mtp", REPO / "manifests").nodes


def ingredients(**over) -> dict:
    base = {
        "kind": "quantize",
        "version": 1,
        "params": {
            "plan": {
                "roles": {"six": {"bits": 6, "group_size": 64}},
                "tensors": {T.format(i, p): "six" for i in range(3) for p in ("gate", "up")},
            },
            "require_all_rules": True,
        },
        "inputs": {"model": [D1]},
        "libraries": {"mlx": "0.29.0"},
        "fingerprint": None,
    }
    base.update(over)
    return base


# ---- why_changed -----------------------------------------------------------------------------


def test_never_built_and_equal_ingredients(nodes):
    new = ingredients()
    assert why_changed(nodes["quantize"], None, new) == ["never built"]
    # equal ingredients but no action record: the output itself is what went
    assert why_changed(nodes["quantize"], copy.deepcopy(new), new) == [MISSING]
    assert MISSING == "output missing from the store (collected or corrupt)"


def test_version_param_and_library_changes_each_have_a_line(nodes):
    old = ingredients()
    new = ingredients(version=2, libraries={"mlx": "0.30.0", "numpy": "2.1"})
    new["params"] = {**old["params"], "require_all_rules": False, "extra": "x" * 50}
    new["params"]["plan"] = copy.deepcopy(old["params"]["plan"])
    new["params"]["plan"]["roles"]["six"]["bits"] = 4
    assert why_changed(nodes["quantize"], old, new) == [
        "step version changed 1→2",
        f"params.extra added {'x' * 37}...",  # long values are cut to 40 characters
        "params.plan.roles.six.bits changed 6→4",
        "params.require_all_rules changed True→False",
        "library mlx changed 0.29.0→0.30.0",
        "library numpy changed None→2.1",
    ]


def test_a_plans_tensors_table_is_summarised_in_one_line(nodes):
    old = ingredients()
    new = copy.deepcopy(old)
    tensors = new["params"]["plan"]["tensors"]
    for name in sorted(tensors)[:4]:
        tensors[name] = "eight"
    del tensors[T.format(2, "up")]
    tensors["vision_tower.x.weight"] = "keep"
    reasons = why_changed(nodes["quantize"], old, new)
    assert reasons == [
        "params.plan.tensors: 6 changed ("
        f"{T.format(0, 'gate')} six→eight, {T.format(0, 'up')} six→eight, "
        f"{T.format(1, 'gate')} six→eight"
        ", and 3 more)"
    ]
    one = copy.deepcopy(old)
    one["params"]["plan"]["tensors"][T.format(1, "up")] = "keep"
    assert why_changed(nodes["quantize"], old, one) == [
        f"params.plan.tensors: 1 changed ({T.format(1, 'up')} six→keep)"
    ]


def test_an_input_is_named_once_with_every_slot_it_feeds(nodes):
    node = nodes["verify_head"]  # model = [quantize, requantize], source = fetch, base = [quantize]
    old = ingredients(kind="verify", inputs={"model": [D1, D2], "source": [D3], "base": [D1]})
    new = ingredients(kind="verify", inputs={"model": [D3, D2], "source": [D3], "base": [D3]})
    assert why_changed(node, old, new) == ["input quantize changed (slot base, model)"]
    new["inputs"]["model"] = [D3, D1]
    assert why_changed(node, old, new) == [
        "input quantize changed (slot base, model)",
        "input requantize changed (slot model)",
    ]
    # a slot whose list changed length: every reference in it is named
    short = ingredients(kind="verify", inputs={"model": [D1], "source": [D3], "base": [D1]})
    assert why_changed(node, short, old) == [
        "input quantize changed (slot model)",
        "input requantize changed (slot model)",
    ]


def test_a_source_change_is_described_by_its_step(nodes):
    old = ingredients(
        kind="fetch", inputs={}, fingerprint={"config.json": D1, "model.safetensors": D2}
    )
    new = ingredients(
        kind="fetch",
        inputs={},
        fingerprint={"config.json": D1, "model.safetensors": D3, "tokenizer.json": D1},
    )
    assert why_changed(nodes["fetch"], old, new) == [
        "source changed: model.safetensors, tokenizer.json"
    ]


def test_action_key_is_stable_for_equal_ingredients_and_pinned():
    a = ingredients()
    b = {k: a[k] for k in reversed(list(a))}  # another order, same content
    assert action_key(a) == action_key(b) == action_key(copy.deepcopy(a))
    assert (
        action_key({"kind": "quantize", "version": 1})
        == "xxh3_128:fd554ab15ed2336adf35e0458bcac707"
    )
    changed = copy.deepcopy(a)
    changed["params"]["plan"]["tensors"][T.format(0, "gate")] = "eight"
    assert action_key(changed) != action_key(a)


# ---- a Planner against a built store -------------------------------------------------------------


def planner(project, variant: str) -> Planner:
    m = manifest.load(variant, project.manifests)
    return Planner(m, Store(project.store), BuildOptions(project_root=project.root))


def test_planner_on_a_built_store(project, seed):
    project.adopt(seed)
    ref = Store(project.store).get_ref("xl")
    states = planner(project, "xl").plan()
    assert [(s.name, s.fresh, s.reasons) for s in states] == [
        (n, True, [])
        for n in ["fetch", "sanitize", "quantize", "reference", "eval", "verify", "publish"]
    ]
    assert {s.name: s.key for s in states} == ref["keys"]

    project.write_manifest("xl4", 'extends = "xl"\n[recipe.roles]\nrouted_expert = { bits = 4 }\n')
    p = planner(project, "xl4")
    by = {s.name: s for s in p.plan()}
    assert [n for n, s in by.items() if s.fresh] == ["fetch", "sanitize", "reference"]
    assert by["quantize"].reasons == [
        "params.plan.roles.routed_expert.bits changed 6→4"
    ]  # against xl's build
    assert by["verify"].reasons == ["input quantize will be rebuilt first"] and by[
        "verify"
    ].waits_for == ["quantize"]
    assert by["eval"].reasons == ["input quantize will be rebuilt first"] and by[
        "eval"
    ].waits_for == ["quantize"]
    # in the order of publish's inputs: model, source, report, eval
    assert by["publish"].waits_for == ["quantize", "verify", "eval"] and by["publish"].key is None

    project.write_manifest(
        "xlr", 'extends = "xl"\n[recipe.rules]\n"*.mlp.shared_expert.*" = "routed_expert"\n'
    )
    reasons = {s.name: s for s in planner(project, "xlr").plan()}["quantize"].reasons
    layer0 = "language_model.model.layers.0.mlp.shared_expert"
    assert reasons[-1] == (
        f"params.plan.tensors: 12 changed ({layer0}.down_proj.weight shared_expert→routed_expert, "
        f"{layer0}.gate_proj.weight shared_expert→routed_expert, "
        f"{layer0}.up_proj.weight shared_expert→routed_expert, "
        "and 9 more)"
    )
    assert reasons[0].startswith(
        "params.plan.roles.shared_expert removed (was {"
    )  # the role no tensor takes now

    assert p.selection(["quantize"]) == ["fetch", "sanitize", "quantize"]
    with pytest.raises(
        UsageError, match=r"xl4 has no step 'quantise' \(did you mean 'quantize'\?\)"
    ):
        p.selection(["quantise"])
    ex = p.explain("quantize")
    assert ex["fresh"] is False and ex["inputs"] == {"model": ["sanitize:model"]}
    assert ex["key"] == by["quantize"].key and ex["ingredients"]["libraries"] == {
        "mlx": ex["ingredients"]["libraries"]["mlx"]
    }
