"""Role rules: Role validation, first match wins, module-path matching, unassigned tensors and
dead rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from buildkit.core.errors import StepError
from buildkit.quant.roles import Recipe, Role

ATTN = "language_model.model.layers.0.self_attn.q_proj.weight"
GATE = "language_model.model.layers.0.mlp.gate.weight"
EXPERT = "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"
NORM = "language_model.model.norm.weight"


def recipe(rules: dict[str, str]) -> Recipe:
    roles = {
        "eight": {"bits": 8},
        "six": {"bits": 6, "group_size": 32},
        "keep": {"passthrough": True},
    }
    return Recipe(roles=roles, rules=rules)


# ---- Role ------------------------------------------------------------------------------------


def test_role_quant_settings_and_defaults():
    assert Role(bits=4).quant() == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert Role(bits=6, group_size=32).quant() == {"group_size": 32, "bits": 6, "mode": "affine"}
    assert Role(passthrough=True).quant() is None
    assert Role(bits=8, calibrated=True).calibrated


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"bits": 7}, "bits must be one of 2, 3, 4, 5, 6, 8 (mlx affine), got 7"),
        ({"bits": 1}, "Input should be greater than or equal to 2"),
        ({"bits": 9}, "Input should be less than or equal to 8"),
        ({}, "a role needs `bits` (and optionally group_size) or `passthrough = true`"),
        ({"group_size": 64}, "a role needs `bits`"),
        (
            {"passthrough": True, "bits": 8},
            "a passthrough role takes no bits and is not calibrated",
        ),
        (
            {"passthrough": True, "calibrated": True},
            "a passthrough role takes no bits and is not calibrated",
        ),
        ({"bits": 4, "group_size": 8}, "Input should be greater than or equal to 16"),
        ({"bits": 4, "mode": "mxfp4"}, "Input should be 'affine'"),
        ({"bits": 4, "bit": 4}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_role_is_refused_saying_why(fields, message):
    with pytest.raises(ValidationError) as e:
        Role(**fields)
    assert message in str(e.value)


def test_roles_and_recipes_are_frozen():
    r = recipe({"*": "keep"})
    with pytest.raises(ValidationError):
        r.roles["eight"].bits = 4
    with pytest.raises(ValidationError):
        r.rules = {}


def test_rule_naming_an_unknown_role_is_refused_listing_the_roles():
    with pytest.raises(ValidationError) as e:
        Recipe(roles={"a": {"bits": 4}, "b": {"passthrough": True}}, rules={"*.q_proj": "attn"})
    assert "rule '*.q_proj' names role 'attn', which is not in recipe.roles (a, b)" in str(e.value)
    with pytest.raises(ValidationError, match=r"not in recipe.roles \(none\)"):
        Recipe(rules={"*": "keep"})


# ---- matching --------------------------------------------------------------------------------


def test_first_matching_rule_wins():
    r = recipe({"*.mlp.gate": "eight", "*.mlp.*": "six", "*": "keep"})
    assert r.match(GATE) == ("*.mlp.gate", "eight")
    assert r.match(EXPERT) == ("*.mlp.*", "six")
    assert r.match(NORM) == ("*", "keep")
    flipped = recipe({"*.mlp.*": "six", "*.mlp.gate": "eight", "*": "keep"})
    assert flipped.match(GATE) == (
        "*.mlp.*",
        "six",
    )  # the same rules in another order: another role


def test_patterns_match_the_module_path_or_the_full_name():
    r = recipe({"*.self_attn.q_proj": "eight", "*.norm.weight": "keep"})
    assert r.match(ATTN) == ("*.self_attn.q_proj", "eight")  # the module: the name without .weight
    assert r.match(NORM) == ("*.norm.weight", "keep")  # the full name
    assert r.match(ATTN.replace(".weight", ".scales")) is None  # only .weight is dropped
    assert r.match("x.self_attn.q_proj.bias") is None
    assert recipe({"*.Q_PROJ": "eight"}).match(ATTN) is None  # case matters


def test_assign_gives_every_tensor_its_role():
    r = recipe(
        {"*.mlp.gate": "eight", "*.switch_mlp.*": "six", "*.self_attn.*": "eight", "*norm*": "keep"}
    )
    assert r.assign([ATTN, GATE, EXPERT, NORM]) == {
        ATTN: "eight",
        GATE: "eight",
        EXPERT: "six",
        NORM: "keep",
    }


def test_unassigned_tensors_are_named_with_a_count_of_the_rest():
    r = recipe({"*norm*": "keep"})
    with pytest.raises(StepError) as e:
        r.assign([NORM, ATTN, GATE])
    assert str(e.value) == (
        f"no recipe rule matches tensor(s) {ATTN}, {GATE}; "
        "add a rule under [recipe.rules] (for example a passthrough role)"
    )
    names = [f"t{i}.weight" for i in range(8)]
    with pytest.raises(
        StepError,
        match=r"tensor\(s\) t0.weight, t1.weight, t2.weight, t3.weight, t4.weight \(and 3 more\); ",
    ):
        r.assign(names)


def test_dead_rules_are_named_unless_allowed():
    r = recipe({"*.typo_proj": "eight", "*norm*": "keep", "*.gone": "six"})
    with pytest.raises(StepError) as e:
        r.assign([NORM])
    assert str(e.value).startswith(
        "recipe rule(s) '*.typo_proj', '*.gone' match no tensor; fix the pattern or remove it"
    )
    assert r.assign([NORM], require_all_rules=False) == {NORM: "keep"}
    # a rule shadowed by an earlier one for every tensor is dead too
    with pytest.raises(StepError, match=r"recipe rule\(s\) '\*norm\*' match no tensor"):
        recipe({"*": "keep", "*norm*": "six"}).assign([NORM, ATTN])
