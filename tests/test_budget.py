"""oq-budget: sensitivities measured once per source and text, bits planned under target_bpw."""

from __future__ import annotations

import json

import pytest
from conftest import Project, cached, ran

from buildkit import budget, manifest
from buildkit.errors import StepError
from buildkit.roles import Role
from buildkit.steps.quantize import assign_roles
from buildkit.store import Store

VARIANT = "oq-budget"
# The checkpoint the budget is planned on: None is the manifest's generated fixture. Point it at
# a trained fixture (a `fixture:...` spec or a directory) once one exists; nothing else changes.
SOURCE: str | None = None


def source_args() -> tuple[str, ...]:
    return ("--source", SOURCE) if SOURCE else ()


def artifact(project: Project, variant: str, node: str, output: str = "out"):
    store = Store(project.store)
    return store, store.get_artifact(store.get_ref(variant)["nodes"][node]["outputs"][output])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A project with oq-budget's sensitivities measured, and the bits per weight its budget
    can reach on this source (lowest, highest)."""
    project = Project(tmp_path_factory.mktemp("budget"))
    proc = project.build(VARIANT, "--target", "sensitivity", *source_args())
    assert {"calibrate", "sensitivity"} <= set(ran(proc))
    _, model = artifact(project, VARIANT, "sanitize", "model")
    _, sens = artifact(project, VARIANT, "sensitivity")
    params = manifest.load(VARIANT, project.manifests).nodes["quantize"].params
    roles = assign_roles(sorted(model.tensors), params)
    return project, budget.reachable(
        model.tensors, roles, params.recipe.roles, sens.meta["tensors"]
    )


def budgeted(project: Project, name: str, target: float) -> str:
    project.write_manifest(name, f'extends = "{VARIANT}"\n[recipe]\ntarget_bpw = {target:.4f}\n')
    return name


def test_a_budget_is_met_and_a_new_one_replans_without_remeasuring(measured):
    project, (lo, hi) = measured
    assert lo < hi
    sizes = []
    for i, share in enumerate((0.3, 0.7)):
        target = round(lo + share * (hi - lo), 4)
        name = budgeted(project, f"budget-{i}", target)
        proc = project.build(name, "--target", "quantize", *source_args())
        assert ran(proc) == ["quantize"]  # the plan is quantize's; sensitivity is not re-measured
        assert {"fetch", "sanitize", "calibrate", "sensitivity"} == set(cached(proc))
        _, quant = artifact(project, name, "quantize")
        bpw = quant.meta["bits_per_weight"]
        assert 0.99 * target <= bpw <= target, (bpw, target)
        b = quant.meta["budget"]
        assert b["target_bpw"] == target and b["bits_per_weight"] == pytest.approx(bpw, abs=1e-4)
        assert set(b["bits"].values()) <= {3, 4, 6, 8} and len(b["bits"]) == 12
        for tensor, bits in b["bits"].items():  # the plan is per tensor, in mlx_lm's config too
            assert quant.meta["quantization"][tensor.removesuffix(".weight")]["bits"] == bits
        sizes.append(sum(b["bits"].values()))
    assert sizes[0] < sizes[1]


def test_budgeted_model_publishes_with_its_plan_in_the_card(measured):
    project, (lo, hi) = measured
    name = budgeted(project, "budget-card", round(lo + 0.5 * (hi - lo), 4))
    proc = project.build(name, *source_args())
    assert {"calibrate", "sensitivity"} <= set(cached(proc)) and "quantize" in ran(proc)
    out = project.out / name
    card = (out / "README.md").read_text()
    assert "## Bits-per-weight budget" in card and "| sensitivity at 3 |" in card.replace(
        " | sensitivity at 4", ""
    )
    config = json.loads((out / "config.json").read_text())
    _, quant = artifact(project, name, "quantize")
    for tensor, bits in quant.meta["budget"]["bits"].items():
        module = tensor.removesuffix(".weight")
        assert config["quantization"].get(module, config["quantization"])["bits"] == bits
    # the data-agnostic baseline (from oq4e-mtp-xl) is planned to the same bits, uncalibrated
    _, base = artifact(project, name, "quantize_baseline")
    assert base.meta["budget"]["bits"] == quant.meta["budget"]["bits"]
    assert "calibration" in quant.meta and "calibration" not in base.meta


# ---- the plan ---------------------------------------------------------------------------------


def _plan_inputs():
    role = Role(bits=4, budget_bits=(3, 4, 8))
    tensors = {f"t{i}.weight": {"dtype": "BF16", "shape": [2, 64, 64]} for i in range(3)}
    tensors["k.weight"] = {"dtype": "BF16", "shape": [2, 64, 64]}
    roles = {**{f"t{i}.weight": "e" for i in range(3)}, "k.weight": "k"}
    recipe_roles = {"e": role, "k": Role(bits=8)}
    # t0 matters most, t2 least
    sens = {
        f"t{i}.weight": {"3": 100.0 / (i + 1), "4": 20.0 / (i + 1), "8": 1.0 / (i + 1)}
        for i in range(3)
    }
    return tensors, roles, recipe_roles, sens


def test_plan_spends_bits_where_sensitivity_drops_most():
    tensors, roles, recipe_roles, sens = _plan_inputs()
    lo, hi = budget.reachable(tensors, roles, recipe_roles, sens)
    assert (lo, hi) == pytest.approx(((3 * 3.5 + 8.5) / 4, (3 * 8.5 + 8.5) / 4))
    bits, summary = budget.plan(tensors, roles, recipe_roles, (3 * 3.5 + 1 + 8.5) / 4, sens)
    assert bits == {
        "t0.weight": 4,
        "t1.weight": 3,
        "t2.weight": 3,
    }  # one bit to spend: the most sensitive
    assert summary["bits_per_weight"] <= (3 * 3.5 + 1 + 8.5) / 4
    bits, _ = budget.plan(tensors, roles, recipe_roles, hi, sens)
    assert set(bits.values()) == {8}


def test_plan_refuses_an_unreachable_budget_and_says_the_floor():
    tensors, roles, recipe_roles, sens = _plan_inputs()
    with pytest.raises(StepError, match=r"below the lowest this recipe reaches, 4\.7500.*raise it"):
        budget.plan(tensors, roles, recipe_roles, 4.0, sens)
    with pytest.raises(StepError, match=r"not measured at bits \[8\]"):
        budget.plan(tensors, roles, recipe_roles, 6.0, {n: {"3": 1.0, "4": 0.5} for n in sens})


def test_roles_without_budget_bits_keep_their_keys():
    assert Role(bits=6).key_dump() == {
        "passthrough": False,
        "bits": 6,
        "group_size": 64,
        "mode": "affine",
        "calibrated": False,
    }
    assert Role(bits=4, budget_bits=(3, 4)).key_dump()["budget_bits"] == [3, 4]
    with pytest.raises(ValueError, match="increasing order"):
        Role(bits=4, budget_bits=(4, 3))


def test_sensitivity_key_has_its_params_and_never_a_budget():
    from buildkit.steps.sensitivity import Sensitivity, SensitivityParams

    kp = Sensitivity().key_params(SensitivityParams(bits=[8, 3, 4]), {})
    assert kp == {"bits": [3, 4, 8], "group_size": 64, "max_rows": 64}


def test_a_budgeted_plan_enters_quantize_key_per_tensor(measured):
    project, (lo, hi) = measured
    store, model = artifact(project, VARIANT, "sanitize", "model")
    _, sens = artifact(project, VARIANT, "sensitivity")
    node = manifest.load(VARIANT, project.manifests).nodes["quantize"]
    params = node.params.model_copy(
        update={"recipe": node.params.recipe.model_copy(update={"target_bpw": hi})}
    )
    kp = node.step.key_params(params, {"model": [model], "sensitivity": [sens]})
    plan = kp["plan"]
    assert (
        plan["budget"]["target_bpw"] == hi and plan["budget"]["sensitivity"] == sens.meta["tensors"]
    )
    experts = {t: r for t, r in plan["tensors"].items() if ".switch_mlp." in t}
    assert len(experts) == 12 and set(experts.values()) == {
        "routed_expert@8"
    }  # the whole budget: 8 bits
    assert (
        plan["roles"]["routed_expert@8"]["bits"] == 8
        and "budget_bits" not in plan["roles"]["routed_expert@8"]
    )
    with pytest.raises(StepError, match="needs measured sensitivities: add inputs.sensitivity"):
        node.step.key_params(params, {"model": [model]})
