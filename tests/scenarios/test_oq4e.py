"""oq4e: calibration, data-aware 4-bit routed experts, donor MTP graft, on the search's variant
(oq4e-search-mtp-xl: what calibration's stop and the search do; oq4e-mtp-xl's GPTQ experts
are tests/quant/test_gptq.py's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import REPO, Project, cached, ran

from buildkit.core.errors import StepError
from buildkit.formats.tensors import from_mlx, nbytes, to_float32, to_mlx
from buildkit.grade import texts
from buildkit.quant import dataaware
from buildkit.quant.roles import Recipe, Role
from buildkit.steps.calibrate import CalibrateParams
from buildkit.store.store import Store

VARIANT = "oq4e-search-mtp-xl"
BUILTIN_TEXT = texts.text_path("builtin:calibration.txt", Path("."))
LAYER0 = "language_model.model.layers.0.mlp.switch_mlp"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    project = Project(tmp_path_factory.mktemp("oq4e"))
    proc = project.build(VARIANT)
    return project, proc


def artifact(project: Project, variant: str, node: str, output: str = "out"):
    store = Store(project.store)
    return store, store.get_artifact(store.get_ref(variant)["nodes"][node]["outputs"][output])


def extend(project: Project, name: str, body: str) -> str:
    project.write_manifest(name, f'extends = "{VARIANT}"\n{body}')
    return name


# ---- the build -------------------------------------------------------------------------


def test_builds_loads_and_generates(built):
    import mlx_lm

    project, proc = built
    assert {"calibrate", "quantize", "graft", "requantize", "verify", "publish"} <= set(ran(proc))
    out = project.out / VARIANT
    model, tokenizer = mlx_lm.load(str(out))
    text = mlx_lm.generate(model, tokenizer, prompt="The harbour at dawn", max_tokens=8)
    assert isinstance(text, str)
    logits = model(mx.array([tokenizer.encode("Water boils at one hundred degrees")]))
    assert mx.isfinite(logits).all().item()
    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]  # routed experts hold most weights: 4-bit is the default entry
    assert (q["bits"], q["group_size"]) == (4, 64) and f"{LAYER0}.gate_proj" not in q
    assert q["language_model.model.layers.0.linear_attn.in_proj_qkv"]["bits"] == 8
    assert "language_model.model.layers.0.mlp.gate" not in q  # the router stays bf16 (xl's roles)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sum(k.startswith("language_model.mtp.") for k in weight_map) == 13 + 7 * 3


def test_data_aware_error_is_below_data_agnostic_and_in_the_card(built):
    project, _ = built
    out = project.out / VARIANT
    check = json.loads((out / "verify.json").read_text())["checks"]["calibrated_expert_error"]
    fig = check["figure"]
    assert check["ok"] and fig["experts"] == 4 * 8 and fig["heldout_tokens"] > 0
    assert fig["data_aware"] < fig["data_agnostic"] * 0.95  # measurably, not by a rounding error
    card = (out / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| calibrated_expert_error |"))
    assert (
        f'"data_aware": {fig["data_aware"]}' in row
        and f'"data_agnostic": {fig["data_agnostic"]}' in row
    )
    assert "routed_expert (calibrated) | 4 | 64" in card
    # quantize measured the data-aware weights' rel-L1 on every row, as xl's: verify checks that
    # figure and measures their first rows itself (4 layers x gate, up, down)
    checks = json.loads((out / "verify.json").read_text())["checks"]
    assert checks["dequant_rel_l1_first_rows"]["figure"]["4-bit"]["tensors"] == 4 * 3
    _, quant = artifact(project, VARIANT, "quantize")
    assert f"{LAYER0}.down_proj.weight" in quant.meta["rel_l1"]


def test_calibration_stops_a_layer_once_every_expert_has_enough_rows(built):
    """rows_per_expert: the first layer stops after the first batch that gives each of its
    experts that many rows, later layers never run more; and what a layer sees is exactly what
    a calibration of that many tokens (the text's prefix) gives it."""
    project, _ = built
    store, stats = artifact(project, VARIANT, "calibrate")
    used, k = stats.meta["tokens_by_layer"], CalibrateParams().rows_per_expert
    assert used == sorted(used, reverse=True) and used[0] < stats.meta["tokens"]
    assert used[0] % 128 == 0  # whole sequences
    first = store.read_tensor(stats.tensors[f"{LAYER0}.tokens"])
    assert first.min() >= k and first.sum() == 2 * used[0]  # top-2 routing: two rows a token
    prefix = f"[steps.calibrate]\nparams.rows_per_expert = 0\nparams.max_tokens = {used[0]}\n"
    proc = project.build(extend(project, "oq4e-prefix", prefix), "--target", "calibrate")
    assert "calibrate" in ran(proc)
    _, whole = artifact(project, "oq4e-prefix", "calibrate")
    assert whole.meta["tokens_by_layer"] == [used[0]] * len(used)
    for name in (f"{LAYER0}.tokens", f"{LAYER0}.down_proj.input_sq_mean"):
        a, b = (store.read_tensor(x.tensors[name]) for x in (stats, whole))
        assert np.allclose(a, b, rtol=1e-6, atol=0), name


def test_head_comes_from_the_donor(built):
    project, _ = built
    store, graft = artifact(project, VARIANT, "graft")
    _, donor = artifact(project, VARIANT, "donor_fetch")
    _, trunk = artifact(project, VARIANT, "fetch")
    files = {e["view"]["file"] for e in graft.tensors.values() if "view" in e}
    assert files and files <= set(donor.external.values())
    assert not files & set(trunk.external.values())


def test_second_build_runs_nothing(built):
    project, _ = built
    proc = project.build(VARIANT)
    assert ran(proc) == []


def test_changing_the_calibration_text_reruns_only_calibrated_nodes(built):
    project, _ = built
    text = project.root / "calibration-edit.txt"
    lines = BUILTIN_TEXT.read_text().splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    lines[first] = "A lighthouse keeper counted the steps: one hundred and twelve, every evening."
    text.write_text("\n".join(lines) + "\n")
    fewer = "params.max_tokens = 1024\nparams.max_heldout_tokens = 256\n"  # a quicker calibration
    name = extend(project, "oq4e-edit", f'[steps.calibrate]\nparams.text = "{text.name}"\n{fewer}')
    proc = project.build(name)
    # eval grades quantize and eval_head reads eval's trunk: both rerun; the data-agnostic
    # baseline (quantize_baseline, eval_baseline) uses no calibration, so it stays cached
    downstream = {"calibrate", "quantize", "verify", "verify_head", "eval", "eval_head", "publish"}
    assert set(ran(proc)) == downstream
    assert {
        "fetch",
        "sanitize",
        "donor_fetch",
        "donor_sanitize",
        "graft",
        "requantize",
        "quantize_baseline",
        "eval_baseline",
    } <= set(cached(proc))

    # an edit in place: the content digest, not the path, is what the key sees
    text.write_text(text.read_text().replace("lighthouse keeper", "harbour master"))
    proc = project.build(name)
    assert set(ran(proc)) == downstream
    assert "source changed: text" in proc.stderr

    # the same content under another name is the same calibration
    shutil.copy(BUILTIN_TEXT, project.root / "copy.txt")
    proc = project.build(
        extend(project, "oq4e-copy", '[steps.calibrate]\nparams.text = "copy.txt"\n')
    )
    assert "calibrate" in cached(proc) and "quantize" in cached(proc)


def without_pack(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "pack"}


def test_unreached_experts_fall_back_and_are_counted(built):
    project, _ = built
    name = extend(project, "oq4e-few", "[steps.calibrate]\nparams.max_tokens = 3\n")
    project.build(name, "--target", "quantize")
    store, stats = artifact(project, name, "calibrate")
    _, quant = artifact(project, name, "quantize")
    _, sanitized = artifact(project, name, "sanitize", "model")
    unreached = stats.meta["unreached_by_layer"]
    # 3 tokens x 2 experts each reach at most 6 of a layer's 8 experts
    assert all(len(v) >= 2 for v in unreached.values()) and len(unreached) == 4
    report = quant.meta["calibration"]
    assert (
        report["fallback_experts"]
        == stats.meta["unreached_experts"]
        == sum(map(len, unreached.values()))
    )
    assert report["fallback_by_layer"] == unreached
    # a fallback expert is exactly mx.quantize's; a reached one is not
    layer = "language_model.model.layers.0"
    src = sanitized.tensors[f"{layer}.mlp.switch_mlp.up_proj.weight"]
    packed = mx.quantize(to_mlx(store.read_tensor(src), src["dtype"]), group_size=64, bits=4)[0]
    agnostic = from_mlx(packed)[0]
    got = store.read_tensor(quant.tensors[f"{layer}.mlp.switch_mlp.up_proj.weight"])
    off = unreached[layer]
    on = sorted(set(range(8)) - set(off))
    assert np.array_equal(got[off], agnostic[off])
    assert not np.array_equal(got[on], agnostic[on])

    # one expert at a time (as the real model's 2 MB experts go, four to a block) gives the
    # same bytes as the whole tensor in one block (this fixture's experts are 16 kB)
    entry = sanitized.tensors[f"{layer}.mlp.switch_mlp.up_proj.weight"]
    one_expert = nbytes(entry["dtype"], entry["shape"]) // entry["shape"][0]
    role = Role(bits=4, group_size=64, calibrated=True)
    for block in (one_expert, 3 * one_expert):
        entries = dataaware.quantize_entry(
            store,
            f"{layer}.mlp.switch_mlp.up_proj.weight",
            entry,
            role,
            stats,
            dataaware.Tally(),
            block,
        )
        # the same tensor digests (the build's are in packs; these stand alone), and the same
        # rel-L1 over every row, measured block by block, as the build recorded for verify
        name = f"{layer}.mlp.switch_mlp.up_proj.weight"
        assert abs(entries[name].pop("rel_l1") - quant.meta["rel_l1"][name]) < 1e-7, block
        assert entries == {k: without_pack(quant.tensors[k]) for k in entries}, block


def test_incompatible_donor_is_refused_with_each_field(built):
    project, _ = built
    name = extend(
        project,
        "oq4e-bad-donor",
        '[steps.donor_fetch]\nparams.source = "fixture:seed=1,vocab=2048,hidden=192,experts=16"\n',
    )
    proc = project.run("build", name, "--target", "graft", check=False)
    assert proc.returncode == 1
    assert "hidden_size: trunk 128 vs head 192" in proc.stderr
    assert "num_experts: trunk 8 vs head 16" in proc.stderr
    assert "2 field(s) differ" in proc.stderr


# ---- pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mx_quantize_layout(bits):
    w = mx.random.normal((3, 256), key=mx.random.key(bits)).astype(mx.bfloat16)
    packed = np.array(mx.quantize(w, group_size=64, bits=bits)[0])
    codes = dataaware.unpack(packed, bits)
    assert codes.max() < 2**bits
    assert np.array_equal(dataaware.pack(codes, bits), packed)


def test_search_is_never_worse_than_data_agnostic_on_its_objective():
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((32, 128)).astype(np.float32) * 0.1).astype(mx.bfloat16)
    d = np.exp(rng.standard_normal(128)).astype(np.float32).reshape(1, 2, 64)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    base = (
        dataaware.unpack(np.array(wq), 4).reshape(32, 2, 64),
        *(to_float32(*from_mlx(a)) for a in (s, b)),
    )
    w32 = np.array(w.astype(mx.float32)).reshape(32, 2, 64)
    q, s2, b2, won = dataaware.search(w32, d, 4, "BF16", base)
    err = (d * np.square(s2[..., None] * q + b2[..., None] - w32)).sum(-1)
    err0 = (d * np.square(base[1][..., None] * base[0] + base[2][..., None] - w32)).sum(-1)
    assert (err <= err0).all() and won.mean() > 0.5 and err.sum() < 0.9 * err0.sum()


SEARCH_UNDER_THE_INTERPRETER = """
import sys
import numpy as np
from buildkit.quant import dataaware
z = np.load(sys.argv[1])
out = {}
for i in range(int(z["cases"])):
    dataaware.TOP, dataaware.REFINE = (int(v) for v in z[f"{i}.top_refine"])
    base = (z[f"{i}.codes"], z[f"{i}.s"], z[f"{i}.b"])
    bits, dtype = int(z[f"{i}.bits"]), str(z[f"{i}.dtype"])
    got = dataaware.search(z[f"{i}.w"], z[f"{i}.d"], bits, dtype, base)
    out.update({f"{i}.{k}": v for k, v in enumerate(got)})
np.savez(sys.argv[2], **out)
"""


def test_compiled_search_gives_the_bytes_of_its_python(tmp_path, monkeypatch):
    """The search compiled (numba, its loops vectorised by LLVM) gives the bytes its Python gives
    under the interpreter: LLVM 22 once vectorised a select-and-store in it wrongly, and no other
    test would see a miscompile that keeps the error low. Rows past a block of 64, group sizes,
    bits, storage dtypes and the number of candidates refit all vary."""
    rng = np.random.default_rng(5)
    cases = [(70, 128, 64, 4, "BF16", 3, 1), (64, 128, 64, 4, "BF16", 1, 0)]
    cases += [(64, 64, 32, 3, "F16", 2, 2), (20, 128, 128, 8, "BF16", 7, 1)]
    cases += [(64, 128, 64, 2, "BF16", 0, 0)]
    arrays = {"cases": len(cases)}
    for i, (rows, cols, g, bits, dtype, top, refine) in enumerate(cases):
        w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1)
        w = w.astype(mx.bfloat16 if dtype == "BF16" else mx.float16)
        wq, s, b = mx.quantize(w, group_size=g, bits=bits)
        arrays |= {
            f"{i}.w": np.array(w.astype(mx.float32)).reshape(rows, cols // g, g),
            f"{i}.d": np.exp(rng.standard_normal(cols)).astype(np.float32).reshape(1, -1, g),
            f"{i}.codes": dataaware.unpack(np.array(wq), bits).reshape(rows, cols // g, g),
            f"{i}.s": to_float32(*from_mlx(s)),
            f"{i}.b": to_float32(*from_mlx(b)),
            f"{i}.bits": bits,
            f"{i}.dtype": dtype,
            f"{i}.top_refine": (top, refine),
        }
    np.savez(tmp_path / "in.npz", **arrays)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONPATH": path}  # this checkout's buildkit
    argv = [
        sys.executable,
        "-c",
        SEARCH_UNDER_THE_INTERPRETER,
        tmp_path / "in.npz",
        tmp_path / "out.npz",
    ]
    subprocess.run(argv, env=env, check=True, timeout=600)
    python = np.load(tmp_path / "out.npz")
    for i, (*_, top, refine) in enumerate(cases):
        monkeypatch.setattr(dataaware, "TOP", top)
        monkeypatch.setattr(dataaware, "REFINE", refine)
        base = (arrays[f"{i}.codes"], arrays[f"{i}.s"], arrays[f"{i}.b"])
        w, d, bits, dtype = (arrays[f"{i}.{k}"] for k in ("w", "d", "bits", "dtype"))
        for k, a in enumerate(dataaware.search(w, d, bits, dtype, base)):
            assert np.array_equal(a.view(np.uint8), python[f"{i}.{k}"].view(np.uint8)), (i, k)


@pytest.mark.parametrize("storage", ["BF16", "F16"])
def test_search_rounds_scales_as_they_are_stored(storage):
    """The compiled loop rounds (scale, bias) by bit operations; they must be numpy's casts,
    normal, subnormal and overflowing values alike."""
    from buildkit.quant import groupsearch

    rng = np.random.default_rng(2)
    x = (rng.standard_normal(50_000) * np.exp2(rng.uniform(-30, 18, 50_000))).astype(np.float32)
    x[:4] = [0.0, -0.0, 65519.0, 65520.0]  # the edge of f16's range: rounds to 65504, then inf
    got = x.copy()
    groupsearch.store_round(got, len(got), dataaware.STORAGE[storage])
    if storage == "F16":
        with np.errstate(over="ignore"):
            want = x.astype(np.float16).astype(np.float32)
    else:
        want = to_float32(*from_mlx(mx.array(x).astype(mx.bfloat16)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_importance_weighting_matters_where_channels_differ():
    """Same search, uniform vs measured importance: with heavy-tailed channel scales (as real
    activations have) the measured importance must cut the held-out output error further."""
    rng = np.random.default_rng(1)
    o = c = 256
    w = mx.array(rng.standard_normal((o, c)).astype(np.float32) * c**-0.5).astype(mx.bfloat16)
    w32 = np.array(w.astype(mx.float32))
    scale = np.exp(rng.standard_normal(c)).astype(np.float32)
    calib, held = (rng.standard_normal((n, c)).astype(np.float32) * scale for n in (2000, 500))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    base = (
        dataaware.unpack(np.array(wq), 4).reshape(o, 4, 64),
        *(to_float32(*from_mlx(a)) for a in (s, b)),
    )
    y = held @ w32.T

    def error(importance):
        q, s2, b2, _ = dataaware.search(
            w32.reshape(o, 4, 64), importance.reshape(1, 4, 64), 4, "BF16", base
        )
        return np.linalg.norm(held @ (s2[..., None] * q + b2[..., None]).reshape(o, c).T - y)

    agnostic = np.linalg.norm(
        held @ (base[1][..., None] * base[0] + base[2][..., None]).reshape(o, c).T - y
    )
    uniform, aware = error(np.ones(c, np.float32)), error(np.square(calib).mean(0))
    assert aware < 0.85 * uniform < 0.85 * agnostic


def test_split_is_deterministic_and_skips_the_header():
    calib, held = texts.split_lines("# licence\n# more\n\na\nb\n\nc\nd\ne\nf\n", 3)
    assert calib == ["a", "b", "d", "e"] and held == ["c", "f"]
    calib, held = texts.split_lines(BUILTIN_TEXT.read_text(), 5)
    assert len(calib) + len(held) >= 250 and len(held) == (len(calib) + len(held)) // 5
    assert calib[0].startswith("The morning train") and not any(
        ln.startswith("#") for ln in calib + held
    )


def test_calibrate_key_has_params_but_not_the_path():
    kp = CalibrateParams(text="anywhere.txt").key_params()
    assert kp == {
        "heldout_every": 5,
        "seq_len": 128,
        "max_tokens": 4096,
        "max_heldout_tokens": 1024,
        "rows_per_expert": 128,
    }
    # GPTQ's calibration (keep_inputs) runs every token: rows_per_expert changes nothing there
    kept = CalibrateParams(keep_inputs=True).key_params()
    assert kept["keep_inputs"] is True and "rows_per_expert" not in kept


def test_calibrated_role_needs_a_calibration_input():
    recipe = Recipe(
        roles={"e": {"bits": 4, "calibrated": True}, "k": {"passthrough": True}},
        rules={"*.switch_mlp.*": "e", "*": "k"},
    )
    roles = {f"{LAYER0}.up_proj.weight": "e", "x.norm.weight": "k"}
    with pytest.raises(StepError, match="calibrated .* no calibration input"):
        dataaware.check_calibration(recipe, roles, None)
    with pytest.raises(StepError, match="no tensor has a calibrated role"):
        dataaware.check_calibration(recipe, {"x.norm.weight": "k"}, object())
