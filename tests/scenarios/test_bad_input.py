"""Bad input: each is refused with a clear message and exit code, and nothing is left half-written.

Manifest errors are pinned in test_manifest.py; here a few go through ``build`` for the exit
code and "nothing written". The sources are copies of one generated checkpoint, each broken in
one way (``MUTATIONS``).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import Project

from buildkit.core import keys
from buildkit.core.errors import SourceError
from buildkit.engine.step import BuildOptions, Context, Progress
from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.formats.tensors import header_bytes, read_header, read_tensor
from buildkit.steps.fetch import Fetch, FetchParams
from buildkit.store.store import Store

INDEX = "model.safetensors.index.json"
GATE = "model.language_model.layers.0.mlp.gate.weight"
FUSED = "model.language_model.layers.2.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("bad-input") / "src", FixtureSpec(seed=0))


def written(project: Project) -> list[str]:
    """What a failed build left behind that it should not have: outputs, temp files, bad objects."""
    left = [
        str(p) for p in project.root.rglob("*") if ".tmp" in p.name or p.name.endswith(".partial")
    ]
    if project.out.exists() and any(project.out.iterdir()):
        left.append(f"{project.out} is not empty: {sorted(x.name for x in project.out.iterdir())}")
    if project.store.exists():
        left += Store(project.store).check()
        left += [str(p) for p in (project.store / "tmp").iterdir()]
    return left


def outside_store(project: Project) -> list[Path]:
    return sorted(
        p for p in project.root.rglob("*") if p != project.store and project.store not in p.parents
    )


def fail(project: Project, capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = project.cli(*argv)
    return code, capsys.readouterr().err


# ---- manifests --------------------------------------------------------------------------

MANIFESTS = {  # the messages of every manifest error are pinned in test_manifest.py
    "malformed_toml": ('extends = "xl"\n[steps.quantize\n', "invalid TOML"),
    "bad_bits": (
        'extends = "xl"\n[recipe.roles]\nrouted_expert = { bits = 7 }\n',
        "bits must be one of",
    ),
    "recipe_not_a_table": (
        'extends = "xl"\n[steps.quantize]\nparams.recipe = "oops"\n',
        "steps.quantize.params.recipe",
    ),
    "cycle": (
        'extends = "xl"\n[steps.quantize]\ninputs = { model = "requant" }\n'
        '[steps.requant]\nkind = "requantize"\ninputs = { model = "quantize" }\n',
        "cycle between steps",
    ),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_bad_manifest_exits_2_and_writes_nothing(project, capsys, case):
    text, message = MANIFESTS[case]
    project.write_manifest("bad", text)
    code, err = fail(project, capsys, "build", "bad", "--out", str(project.out / "bad"))
    assert code == 2, err
    assert message in err and "bad.toml" in err and "Traceback" not in err
    assert not project.out.exists() and not list(project.store.glob("objects/*/*"))


def test_rule_matching_nothing_fails_naming_the_pattern(project, capsys, source):
    project.write_manifest(
        "typo", 'extends = "xl"\n[recipe.rules]\n"*.self_attn.typo_proj" = "attention"\n'
    )
    code, err = fail(
        project,
        capsys,
        "build",
        "typo",
        "--source",
        str(source),
        "--out",
        str(project.out / "typo"),
    )
    assert code == 1 and "'*.self_attn.typo_proj' match no tensor" in err
    assert written(project) == []


def test_failing_quantize_exits_1_from_a_real_process(project):
    """A tensor failing mid-quantize stops the other workers first (mlx aborts on exit
    otherwise)."""
    project.write_manifest(
        "g128", 'extends = "xl"\n[recipe.roles]\nrouted_expert = { bits = 6, group_size = 128 }\n'
    )
    r = project.run("build", "g128", "--out", str(project.out / "g128"), check=False)
    assert r.returncode == 1, r.stderr
    assert "last dimension 64 is not a multiple of group_size 128" in r.stderr
    assert "terminate called" not in r.stderr and written(project) == []


# ---- sources ----------------------------------------------------------------------------


def shards(src: Path) -> dict[str, dict[str, tuple[str, np.ndarray]]]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        h = read_header(f)
        out[f.name] = {n: (i.dtype, read_tensor(i, f)) for n, i in h.tensors.items()}
    return out


def write_shard(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    entries = [(n, dt, a.shape) for n, (dt, a) in tensors.items()]
    with open(path, "wb") as f:
        f.write(header_bytes(entries, {"format": "pt"}))
        for _, a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def edit_tensors(src: Path, fn) -> None:
    """Rewrite every shard through ``fn(name, dtype, array) -> [(name, dtype, array), ...]``,
    index too."""
    wmap = {}
    for shard, tensors in shards(src).items():
        new = {}
        for name, (dt, a) in tensors.items():
            for n2, d2, a2 in fn(name, dt, a):
                new[n2] = (d2, a2)
                wmap[n2] = shard
        write_shard(src / shard, new)
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(wmap.items()))}))


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def set_nan_inf(name, dt, a):
    if name == GATE:
        a = a.copy()
        a[0, 0] = 0x7FC0  # bf16 NaN
    if name == "model.language_model.layers.1.linear_attn.A_log":
        a = a.copy()
        a[0] = 0x7F80  # bf16 +Inf
    if name == FUSED:  # in the up half of the last expert: named as both tensors split from it
        a = a.copy()
        a[-1, -1, -1] = 0xFF80  # bf16 -Inf
    return [(name, dt, a)]


def first_shard(src: Path) -> Path:
    return sorted(src.glob("*.safetensors"))[0]


def raw_header(src: Path, head: dict, data: bytes = b"") -> None:
    blob = json.dumps(head).encode()
    first_shard(src).write_bytes(struct.pack("<Q", len(blob)) + blob + data)


MUTATIONS = {
    "no_such_directory": (lambda s: shutil.rmtree(s), "no such directory"),
    "no_config": (lambda s: (s / "config.json").unlink(), "config.json is missing"),
    "config_not_json": (
        lambda s: (s / "config.json").write_text("{nope"),
        "config.json is not valid JSON",
    ),
    "no_shards": (
        lambda s: [p.unlink() for p in s.glob("*.safetensors")],
        "no *.safetensors files",
    ),
    "missing_tensor": (
        lambda s: edit_tensors(s, lambda n, d, a: [] if n == GATE else [(n, d, a)]),
        f"source is missing 1 tensor(s): {GATE}",
    ),
    "wrong_shape": (
        lambda s: edit_tensors(s, lambda n, d, a: [(n, d, a[:4] if n == GATE else a)]),
        f"tensor {GATE!r} has shape [4, 128] but config.json implies [8, 128]",
    ),
    "config_disagrees": (
        lambda s: edit_json(
            s / "config.json", lambda c: c["text_config"].update(moe_intermediate_size=32)
        ),
        "but config.json implies",
    ),
    "wrong_dtype": (
        lambda s: edit_tensors(
            s, lambda n, d, a: [(n, "I16", a.view(np.int16)) if n == GATE else (n, d, a)]
        ),
        "has dtype I16",
    ),
    "extra_tensor": (
        lambda s: edit_tensors(
            s,
            lambda n, d, a: (
                [(n, d, a)] + ([("model.language_model.extra.weight", d, a)] if n == GATE else [])
            ),
        ),
        "'model.language_model.extra.weight' is not part of the qwen3_5_moe layout",
    ),
    "tensor_named_to_escape": (
        lambda s: edit_tensors(
            s, lambda n, d, a: [(n, d, a)] + ([("../../escape", d, a)] if n == GATE else [])
        ),
        "'../../escape' is not part of the qwen3_5_moe layout",
    ),
    "tensor_named_absolute": (
        lambda s: edit_tensors(
            s, lambda n, d, a: [(n, d, a)] + ([("/tmp/escape", d, a)] if n == GATE else [])
        ),
        "'/tmp/escape' is not part of the qwen3_5_moe layout",
    ),
    "duplicate_across_shards": (
        lambda s: write_shard(
            s / "model-00002-of-00002.safetensors",
            {
                **shards(s)["model-00002-of-00002.safetensors"],
                GATE: ("BF16", np.zeros((8, 128), np.uint16)),
            },
        ),
        f"tensor {GATE!r} appears in both",
    ),
    "index_points_outside": (
        lambda s: edit_json(
            s / INDEX, lambda d: d["weight_map"].update({GATE: "../../evil.safetensors"})
        ),
        "weight_map puts",
    ),
    "truncated_shard": (
        lambda s: first_shard(s).write_bytes(first_shard(s).read_bytes()[:-1000]),
        "truncated or corrupt file",
    ),
    "shard_cut_in_header": (
        lambda s: first_shard(s).write_bytes(first_shard(s).read_bytes()[:100]),
        "truncated or not a safetensors file",
    ),
    "garbage_header": (
        lambda s: first_shard(s).write_bytes(struct.pack("<Q", 16) + b"\xff" * 16 + b"\0" * 64),
        "header is not valid JSON",
    ),
    "absurd_header_length": (
        lambda s: first_shard(s).write_bytes(struct.pack("<Q", 1 << 62) + b"{}"),
        "header claims 4611686018427387904 bytes",
    ),
    "absurd_tensor_size": (
        lambda s: raw_header(
            s, {GATE: {"dtype": "BF16", "shape": [1 << 31, 1 << 31], "data_offsets": [0, 1 << 63]}}
        ),
        "fall outside the 0 data bytes",
    ),
    "overlapping_tensors": (
        lambda s: raw_header(
            s,
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 8,
        ),
        "overlap",
    ),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_bad_source_is_refused_and_nothing_is_half_written(project, capsys, source, case):
    mutate, message = MUTATIONS[case]
    src = project.root / "src"
    shutil.copytree(source, src)
    mutate(src)
    before = outside_store(project)
    code, err = fail(
        project, capsys, "build", "xl", "--source", str(src), "--out", str(project.out / "xl")
    )
    assert code == (2 if case == "no_such_directory" else 1), (
        err
    )  # no directory: the user's input is wrong
    assert message in err and "Traceback" not in err and "internal error" not in err
    assert written(project) == []
    assert (
        outside_store(project) == before
    )  # nothing written outside the store, in the source or beside it


def test_nan_and_inf_fail_verify_naming_each_tensor(project, capsys, source):
    src = project.root / "src"
    shutil.copytree(source, src)
    edit_tensors(src, set_nan_inf)
    code, err = fail(
        project, capsys, "build", "xl", "--source", str(src), "--out", str(project.out / "xl")
    )
    assert code == 1 and "step 'verify' (verify) failed" in err
    assert "step 'publish'" not in err and "[run]    publish" not in err  # publish never starts
    assert "language_model.model.layers.0.mlp.gate.weight" in err
    assert "language_model.model.layers.1.linear_attn.A_log" in err
    report = json.loads(next((project.store / "reports").iterdir()).read_text())
    assert report["checks"]["finite"]["figure"] == {"non_finite": 4}
    assert sorted(report["checks"]["finite"]["detail"])[2:] == [
        f"language_model.model.layers.2.mlp.switch_mlp.{p}_proj.weight" for p in ("gate", "up")
    ]
    assert written(project) == []


def test_fetch_refuses_a_source_that_changed_after_its_key_was_made(tmp_path, source):
    """Fetch records the digests the node's key was made from, or none: a source file edited
    between hashing (the key) and the run fails the step and names the file."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    store = Store(tmp_path / "store")
    ctx = Context(store, "fetch", "v", BuildOptions(project_root=tmp_path), Progress("fetch"))
    step, params = Fetch(), FetchParams(source=str(src))
    ctx.fingerprint = step.fingerprint(params, ctx)
    art = step.run(ctx, params, {})["out"]
    assert {
        **art.external,
        **{k: keys.blob_digest(store.get_blob(d)) for k, d in art.files.items()},
    } == ctx.fingerprint
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "edited": True}))
    with pytest.raises(
        SourceError, match=r"changed after this build hashed them \(config\.json\); run again"
    ):
        step.run(ctx, params, {})


def test_escaping_tensor_names_stay_header_keys(project, capsys, source):
    """A vision tensor named with ``..`` passes through as a key of a shard header, never a path."""
    src = project.root / "src"
    shutil.copytree(source, src)
    name = "model.visual.../../../../escape"
    edit_tensors(src, lambda n, d, a: [(n, d, a)] + ([(name, d, a)] if n == GATE else []))
    # mlx_vlm loads the vision tower strictly: the client check refuses the build before the swap
    code, err = fail(
        project, capsys, "build", "xl", "--source", str(src), "--out", str(project.out / "xl")
    )
    assert (
        code == 1
        and "mlx_vlm cannot run an image prompt" in err
        and "vision_tower.../../../../escape" in err
    ), err
    assert not (project.out / "xl").exists()
    project.write_manifest(
        "nocheck", 'extends = "xl"\n[steps.publish.params]\nload_check = false\n'
    )
    code, err = fail(
        project, capsys, "build", "nocheck", "--source", str(src), "--out", str(project.out / "xl")
    )
    assert code == 0, err
    assert not list(project.root.rglob("escape*")) and not list(project.root.parent.glob("escape*"))
    weight_map = json.loads((project.out / "xl" / INDEX).read_text())["weight_map"]
    assert "vision_tower.../../../../escape" in weight_map


# ---- donor heads ------------------------------------------------------------------------


def test_donor_head_with_other_head_dim_is_refused(project, capsys, source):
    project.write_manifest(
        "donor",
        'extends = "oq4e-mtp-xl"\n[steps.donor_fetch]\n'
        'params.source = "fixture:seed=1,head_dim=64"\n',
    )
    code, err = fail(
        project, capsys, "build", "donor", "--source", str(source), "--target", "graft"
    )
    assert code == 1 and "head_dim: trunk 32 vs head 64" in err and "1 field(s) differ" in err
    assert written(project) == []


def test_donor_head_disagreeing_with_its_own_config_is_refused(project, capsys, source):
    donor = project.root / "donor"
    shutil.copytree(source, donor)
    edit_tensors(donor, lambda n, d, a: [(n, d, a[:, :128] if n == "mtp.fc.weight" else a)])
    project.write_manifest(
        "donor", f'extends = "oq4e-mtp-xl"\n[steps.donor_fetch]\nparams.source = "{donor}"\n'
    )
    code, err = fail(
        project, capsys, "build", "donor", "--source", str(source), "--target", "graft"
    )
    assert code == 1 and "step 'donor_sanitize'" in err
    assert "'mtp.fc.weight' has shape [128, 128] but config.json implies [128, 256]" in err


def test_a_missing_package_a_step_needs_is_refused_before_any_work(project):
    """xl-mtp's eval_head runs mlx_vlm's speculative generation: without mlx_vlm the build
    stops before any step, in one line naming the package and how to install it."""
    hide = "import sys; sys.modules['mlx_vlm'] = None; from buildkit.cli.main import entry; entry()"
    argv = ["-c", hide, *project.args("build", "xl-mtp", "--out", str(project.out / "x"))]
    p = subprocess.run([sys.executable, *argv], cwd=project.root, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line == (
        "buildkit: error: step 'eval_head' (eval, speculative) needs the package mlx-vlm, "
        "which is not installed: pip install 'mlx-vlm' (in buildkit's checkout: make install)"
    )
    assert not list(project.store.glob("actions/*/*"))  # no step ran
    assert not project.out.exists()
