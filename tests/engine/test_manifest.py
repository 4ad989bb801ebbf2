"""Manifests: extends, resolution at load, every manifest error (message and exit code 2) and
--help."""

from __future__ import annotations

import argparse

import pytest

from buildkit.cli.main import main, parser
from buildkit.core.errors import ManifestError
from buildkit.engine import manifest
from buildkit.store.artifact import Artifact

# name -> (files to write, variant to plan, substrings the error must contain). "{d}" is the
# resolved manifests directory: every message names the file, the line where the manifest has
# one, the dotted TOML path and what is expected instead.
ERRORS = {
    "malformed TOML": (
        {"bad": 'extends = "xl"\n[recipe\nx = 1\n'},
        ["{d}/bad.toml: invalid TOML: ", "(at line 2, column"],
    ),
    "unknown top-level key": (
        {"bad": 'extends = "xl"\nsorce = "fixture:"\n'},
        [
            "{d}/bad.toml:2: sorce: unknown key (did you mean 'source'?); "
            "allowed: description, extends, source, recipe, steps",
            'sorce = "fixture:"\n    ^^^',
        ],
    ),
    "unknown step key": (
        {"bad": 'extends = "xl"\n[steps.quantize]\nkinds = "quantize"\n'},
        [
            "{d}/bad.toml:3: steps.quantize.kinds: unknown key (did you mean 'kind'?); "
            "a step has kind, inputs, params"
        ],
    ),
    "step without a kind": (
        {"bad": 'extends = "xl"\n[steps.extra]\ninputs = { model = "sanitize:model" }\n'},
        ["{d}/bad.toml:2: steps.extra.kind: missing required key"],
    ),
    "unknown step kind": (
        {"bad": 'extends = "xl"\n[steps.quantize]\nkind = "quantise"\n'},
        [
            "{d}/bad.toml:3: steps.quantize.kind: unknown step kind 'quantise' "
            "(did you mean 'quantize'?); "
            "known kinds: ",
            "publish, quantize, reference, requantize",
        ],
    ),
    "unknown param": (
        {"bad": 'extends = "xl"\n[steps.quantize]\nparams.rulez = {}\n'},
        [
            "{d}/bad.toml:3: steps.quantize.params.rulez: unknown param (did you mean 'rules'?) "
            "for kind 'quantize'; known: recipe, rules, ",
            "params.rulez = {}",
        ],
    ),
    "wrong param type": (
        {"bad": 'extends = "xl"\n[steps.publish]\nparams.max_shard_bytes = "big"\n'},
        [
            "{d}/bad.toml:3: steps.publish.params.max_shard_bytes: Input should be a valid integer",
            "(got 'big')",
        ],
    ),
    "wrong type in an inherited recipe": (
        {
            "bad": 'extends = "xl"\n# 5-bit experts\n[recipe.roles]\n'
            'routed_expert = { bits = "six" }\n'
        },
        [
            "{d}/bad.toml:4: recipe.roles.routed_expert.bits: Input should be a valid integer",
            "(got 'six')",
            'routed_expert = { bits = "six" }',
        ],
    ),
    "missing required input": (
        {"bad": 'extends = "xl"\n[steps.extra]\nkind = "quantize"\n'},
        ["{d}/bad.toml:2: steps.extra.inputs: missing input 'model' for kind 'quantize'"],
    ),
    "input slot the kind does not have": (
        {
            "bad": 'extends = "xl"\n[steps.extra]\nkind = "quantize"\n'
            'inputs = { modle = "sanitize:model" }\n'
        },
        [
            "{d}/bad.toml:4: steps.extra.inputs.modle: kind 'quantize' has no input 'modle' "
            "(did you mean 'model'?); its inputs: model"
        ],
    ),
    "input naming a missing step": (
        {
            "bad": 'extends = "xl"\n[steps.extra]\nkind = "quantize"\n'
            'inputs = { model = "sanitise" }\n'
        },
        [
            "{d}/bad.toml:4: steps.extra.inputs.model: input 'sanitise' names no step "
            "(did you mean 'sanitize'?); "
            "steps: fetch, sanitize, quantize, verify, reference, eval, publish, extra"
        ],
    ),
    "input naming a missing output": (
        {
            "bad": 'extends = "xl"\n[steps.extra]\nkind = "quantize"\n'
            'inputs = { model = "sanitize:nope" }\n'
        },
        [
            "{d}/bad.toml:4: steps.extra.inputs.model: step 'sanitize' (sanitize) "
            "has no output 'nope'; "
            "its outputs: model, mtp"
        ],
    ),
    "cycle between steps": (
        {"bad": 'extends = "xl"\n[steps.sanitize]\ninputs = { source = "quantize" }\n'},
        [
            "{d}/bad.toml:3: steps.sanitize.inputs.source: cycle between steps: "
            "sanitize -> quantize -> sanitize; a step cannot depend on its own output"
        ],
    ),
    "extends loop": (
        {"bad": 'extends = "loop"\n', "loop": 'extends = "bad"\n'},
        [
            "{d}/loop.toml:1: extends: extends loop: bad -> loop -> bad; "
            "a manifest cannot extend itself"
        ],
    ),
    "unknown extends parent": (
        {"bad": 'extends = "xll"\n'},
        [
            "{d}/bad.toml:1: extends: unknown parent: ",
            "no manifest named 'xll' (did you mean 'xl'?); known: ",
        ],
    ),
    "no steps": (
        {"bad": 'source = "fixture:"\n'},
        ["{d}/bad.toml: steps: a manifest needs at least one step"],
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_manifest_error_names_file_line_path_and_expectation(project, capsys, case):
    files, want = ERRORS[case]
    for name, text in files.items():
        project.write_manifest(name, text)
    assert project.cli("plan", "bad") == 2
    err = capsys.readouterr().err
    assert err.startswith("buildkit: error: ")
    for s in want:
        assert s.replace("{d}", str(project.manifests.resolve())) in err, err
    assert "Traceback" not in err


def test_manifest_error_exits_2_from_a_real_process(project):
    project.write_manifest("bad", 'extends = "xl"\n[steps.quantize]\nkind = "quantise"\n')
    p = project.run("build", "bad", check=False)
    assert p.returncode == 2
    assert "did you mean 'quantize'?" in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_unknown_variant_on_the_command_line(project, capsys):
    assert project.cli("build", "xll") == 2
    err = capsys.readouterr().err
    assert (
        f"{project.manifests}/xll.toml: no manifest named 'xll' (did you mean 'xl'?); known: "
        in err
    )
    assert "xl, xl-3bit, xl-mtp" in err


def test_unknown_step_on_the_command_line(project, capsys):
    assert project.cli("explain", "xl", "quantise") == 2
    assert "xl has no step 'quantise' (did you mean 'quantize'?)" in capsys.readouterr().err


def test_manifest_error_is_one_exception_type_with_file_and_path(project):
    project.write_manifest("bad", 'extends = "xl"\n[steps.quantize]\nparams.rulez = 1\n')
    with pytest.raises(ManifestError) as e:
        manifest.load("bad", project.manifests)
    assert e.value.exit_code == 2
    assert e.value.file == f"{project.manifests.resolve()}/bad.toml:3"
    assert e.value.where == "steps.quantize.params.rulez"


# ---- extends and resolution at load --------------------------------------------------------


def test_extends_inherits_and_deep_merges(project):
    xl = manifest.load("xl", project.manifests)
    mtp = manifest.load("xl-mtp", project.manifests)
    assert list(xl.nodes) == [
        "fetch",
        "sanitize",
        "quantize",
        "verify",
        "reference",
        "eval",
        "publish",
    ]
    assert list(mtp.nodes) == [*xl.nodes, "graft", "requantize", "verify_head", "eval_head"]
    assert [p.rsplit("/", 1)[1] for p in mtp.chain] == ["xl-mtp.toml", "xl.toml"]
    # inherited untouched, redefined partly (kind from xl, inputs from xl-mtp), new
    assert mtp.nodes["fetch"].file.endswith("/xl.toml")
    assert mtp.nodes["publish"].file.endswith("/xl-mtp.toml")
    assert mtp.nodes["publish"].kind == "publish"
    assert mtp.nodes["verify"].file.endswith("/xl.toml")  # the trunk's verify is xl's own
    assert mtp.nodes["eval"].file.endswith("/xl.toml")  # and so is the trunk's eval
    assert mtp.nodes["verify_head"].params.only == "language_model.mtp.*"
    assert {s: list(map(str, r)) for s, r in mtp.nodes["verify_head"].inputs.items()} == {
        "model": ["quantize", "requantize"],
        "source": ["fetch"],
        "base": ["quantize"],
    }
    assert mtp.source == xl.source == "fixture:trained"
    assert mtp.nodes["fetch"].params.source == "fixture:trained"
    # the recipe deep-merges: xl's roles and rules plus xl-mtp's mtp_fc role
    roles = mtp.nodes["requantize"].params.recipe.roles
    assert roles["mtp_fc"].passthrough and roles["routed_expert"].bits == 6
    assert mtp.nodes["requantize"].params.rules == {"language_model.mtp.fc": "mtp_fc"}
    # ...and a role no recipe rule names stays out of quantize's key: xl-mtp shares xl's quantize
    names = [
        "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight",
        "language_model.model.norm.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
    ]
    model = {"model": [Artifact(tensors={n: {} for n in names})]}
    params = [
        m.nodes["quantize"].params.model_copy(update={"require_all_rules": False})
        for m in (mtp, xl)
    ]
    assert params[0].key_params(model) == params[1].key_params(model)


def test_override_of_one_role_field_and_source_on_the_command_line(project):
    project.write_manifest(
        "xl4", 'extends = "xl"\n[recipe.roles]\nrouted_expert = { bits = 4, group_size = 64 }\n'
    )
    m = manifest.load("xl4", project.manifests, source="/data/model")
    roles = m.nodes["quantize"].params.recipe.roles
    assert (roles["routed_expert"].bits, roles["attention"].bits) == (4, 8)
    assert m.nodes["fetch"].params.source == "/data/model"
    assert m.description == manifest.load("xl", project.manifests).description


def test_params_are_resolved_with_defaults_at_load(project):
    m = manifest.load("xl", project.manifests)
    pub = m.nodes["publish"].params
    assert pub.max_shard_bytes == 5 << 30 and pub.load_check is True
    with pytest.raises(ValueError):  # frozen: the graph never changes what the manifest resolved
        pub.max_shard_bytes = 1


def test_manifest_by_path(project, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "mine.toml").write_text((project.manifests / "xl.toml").read_text())
    assert manifest.load(str(other / "mine.toml"), project.manifests).name == "mine"
    with pytest.raises(ManifestError, match="no such manifest file"):
        manifest.load(str(other / "absent.toml"), project.manifests)


# ---- --help --------------------------------------------------------------------------------


def _commands() -> list[list[str]]:
    out = []

    def walk(p: argparse.ArgumentParser, prefix: list[str]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out.append(prefix)
        for a in subs:
            for name, child in a.choices.items():
                walk(child, [*prefix, name])

    walk(parser(), [])
    return out


def test_every_subcommand_has_help(capsys):
    cmds = _commands()
    assert {"build", "plan", "explain", "graph", "gc", "store check"} <= {" ".join(c) for c in cmds}
    for cmd in [[], *cmds]:
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: buildkit {' '.join(cmd)}".rstrip()), cmd
        assert len(out.splitlines()) > 3


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["graph", "xl", "--format", "png"])
    assert e.value.code == 2
    assert "invalid choice: 'png'" in capsys.readouterr().err
