"""oq: one bits-per-weight budget over every role with budget_bits, bf16 a candidate."""

from __future__ import annotations

import pytest
from conftest import Project

from buildkit.engine import manifest
from buildkit.quant import budget
from buildkit.quant.roles import Recipe, Role
from buildkit.steps.quantize import QuantizeParams, RequantizeParams, resolved_plan
from buildkit.store.artifact import Artifact
from buildkit.store.store import Store

# the trained fixture shaped like the real model (48 experts, top-4, experts 88% of the
# weights): on random weights the outputs are near-uniform and a KL is noise
SOURCE = "fixture:trained=austen"


def _inputs():
    """Experts (4-bit, may take 3/4/8), a head kept bf16 (may take 4/8/bf16) and a role
    without budget_bits (8-bit): the head matters little, the experts much."""
    tensors = {f"e{i}.weight": {"dtype": "BF16", "shape": [4, 64, 64]} for i in range(2)}
    tensors["head.weight"] = {"dtype": "BF16", "shape": [256, 64]}
    tensors["k.weight"] = {"dtype": "BF16", "shape": [64, 64]}
    recipe = Recipe(
        roles={
            "e": Role(bits=4, budget_bits=(3, 4, 8)),
            "h": Role(passthrough=True, budget_bits=(4, 8, 16)),
            "k": Role(bits=8),
        },
        rules={"e*": "e", "head": "h", "k": "k"},
    )
    sens = {
        "e0.weight": {"3": 50.0, "4": 10.0, "8": 0.5},
        "e1.weight": {"3": 40.0, "4": 8.0, "8": 0.4},
        "head.weight": {"4": 3.0, "8": 0.1},
    }
    measured = {"groups": {n: [n] for n in sens}, "sensitivity": sens}
    return tensors, recipe, measured


def _bits(tensors: dict, recipe: Recipe, roles: dict[str, str]) -> float:
    """Stored bits per weight of ``tensors`` under ``roles`` (role names of ``recipe``, or
    ``<role>@<bits>``)."""
    total = weights = 0
    for n, e in tensors.items():
        name, _, b = roles[n].partition("@")
        role = recipe.roles[name].at(16 if b == "bf16" else int(b)) if b else recipe.roles[name]
        total += budget.stored_bits(e, role)
        weights += e["shape"][0] * e["shape"][-1] * (e["shape"][1] if len(e["shape"]) == 3 else 1)
    return total / weights


def test_the_budget_moves_bits_out_of_a_bf16_role_into_the_experts_within_the_target():
    tensors, recipe, measured = _inputs()
    base = {n: recipe.match(n)[1] for n in tensors}
    target = _bits(tensors, recipe, base)  # the recipe as it stands: experts 4, head bf16
    recipe = recipe.model_copy(update={"target_bpw": target})
    plan = resolved_plan(tensors, QuantizeParams(recipe=recipe), Artifact(meta=measured))
    assert plan["tensors"]["head.weight"] == "h@4"  # out of bf16 (its 12 bits pay for 8) ...
    assert plan["tensors"]["e0.weight"] == plan["tensors"]["e1.weight"] == "e@8"  # ... into these
    assert plan["roles"]["h@4"] == Role(bits=4).key_dump()
    assert plan["budget"]["bits_per_weight"] <= target
    assert _bits(tensors, recipe, plan["tensors"]) <= target
    # a role without budget_bits keeps its recipe bits, and so does a budgeted role that
    # was not measured (it is not in the sensitivity's groups)
    assert plan["tensors"]["k.weight"] == "k" and plan["roles"]["k"]["bits"] == 8
    measured["groups"].pop("head.weight")
    plan = resolved_plan(tensors, QuantizeParams(recipe=recipe), Artifact(meta=measured))
    assert plan["tensors"]["head.weight"] == "h" and plan["roles"]["h"]["passthrough"]


def test_bf16_is_a_candidate_that_costs_nothing_to_measure():
    tensors, recipe, measured = _inputs()
    roles = {n: recipe.match(n)[1] for n in tensors}
    lo, hi = budget.reachable(tensors, roles, recipe.roles, measured)
    bits, summary = budget.plan(tensors, roles, recipe.roles, hi, measured)
    assert bits["head.weight"] == 16 and summary["sensitivity"]["head.weight"]["16"] == 0.0
    recipe = recipe.model_copy(update={"target_bpw": hi})
    plan = resolved_plan(tensors, QuantizeParams(recipe=recipe), Artifact(meta=measured))
    assert plan["roles"]["h@bf16"] == Role(passthrough=True).key_dump()


def test_requantize_takes_its_roles_own_bits_and_keys_them_without_budget_bits():
    tensors, recipe, _ = _inputs()
    recipe = recipe.model_copy(update={"target_bpw": 5.0})
    plan = resolved_plan(tensors, RequantizeParams(recipe=recipe))  # no sensitivity needed
    assert "budget" not in plan and plan["tensors"]["e0.weight"] == "e"
    assert plan["roles"]["e"] == Role(bits=4).key_dump()


def test_a_child_of_oq_sets_the_budget_and_the_text_that_calibrate_and_sensitivity_read(tmp_path):
    project = Project(tmp_path)
    project.write_manifest(
        "mine",
        'extends = "oq"\n[recipe]\ntarget_bpw = 4.2\n'
        '[steps.calibrate]\nparams.text = "texts/mine.txt"\n',
    )
    m = manifest.load("mine", project.manifests)
    assert m.nodes["quantize"].params.recipe.target_bpw == 4.2
    assert m.nodes["sensitivity"].params.text == "texts/mine.txt"
    oq = manifest.load("oq", project.manifests).nodes
    assert oq["sensitivity"].params.text == oq["calibrate"].params.text == "builtin:calibration.txt"


def node(project: Project, variant: str, name: str, output: str = "out") -> Artifact:
    store = Store(project.store)
    return store.get_artifact(store.get_ref(variant)["nodes"][name]["outputs"][output])


def local_inputs(project: Project, asked: list | None = None):
    """oq-eq's store, sanitized model, sensitivity params and plan, and ``blocks`` for
    ``sensitivity.local``: a candidate's tensor a block of rows at a time, as the build makes
    it (each (name, rows) asked noted in ``asked``)."""
    from buildkit.steps.sensitivity import measured

    store = Store(project.store)
    model, calibration = (
        node(project, "oq-eq", "sanitize", "model"),
        node(project, "oq-eq", "calibrate"),
    )
    params = manifest.load("oq-eq", project.manifests).nodes["sensitivity"].params

    def blocks(name, b, rows, pick=None):
        if asked is not None:
            asked.append((name, rows))
        role = Role(bits=b, group_size=64, calibrated=".switch_mlp." in name)
        return budget.dequantized_rows(store, model, name, role, calibration, rows, pick)

    return store, model, params, measured(params, model.tensors), blocks


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """oq on the austen fixture at xl-4bit's bits per weight (its baseline's), up to eval."""
    project = Project(tmp_path_factory.mktemp("oq"))
    project.write_manifest("oq-base", f'extends = "oq"\nsource = "{SOURCE}"\n')
    project.build("oq-base", "--target", "eval_baseline")
    target = node(project, "oq-base", "quantize_baseline").meta["bits_per_weight"]
    project.write_manifest(
        "oq-eq", f'extends = "oq"\nsource = "{SOURCE}"\n[recipe]\ntarget_bpw = {target}\n'
    )
    project.build("oq-eq", "--target", "eval")
    project.build("oq-eq", "--target", "eval_baseline")
    return project, target


def test_oq_moves_bits_between_roles_and_beats_xl_4bit_at_equal_bytes_on_the_new_fixture(built):
    project, target = built
    quant = node(project, "oq-eq", "quantize")
    b = quant.meta["budget"]
    assert 0.995 * target <= quant.meta["bits_per_weight"] <= target
    # roles that xl keeps bf16 and roles it quantizes were both measured and planned
    planned = {g.rpartition(".")[2]: bits for g, bits in b["bits"].items()}
    assert {"lm_head", "embed_tokens", "switch_mlp", "shared_expert", "gate"} <= set(planned)
    base = {"lm_head": 16, "embed_tokens": 8}  # xl's
    moved = [
        g for g, bits in b["bits"].items() if base.get(g.rpartition(".")[2]) not in (None, bits)
    ]
    moved += [g for g, bits in b["bits"].items() if g.endswith("switch_mlp") and bits != 4]
    assert len(moved) >= 2, b["bits"]
    # roles without budget_bits keep theirs: norms bf16
    roles = quant.meta["roles"]
    assert all(roles[n] == "keep" for n in roles if n.endswith("norm.weight"))
    ours = node(project, "oq-eq", "eval").meta["report"]
    xl4 = node(project, "oq-eq", "eval_baseline").meta["report"]
    assert ours["tokens"] == xl4["tokens"]
    assert abs(ours["size_bytes"] / xl4["size_bytes"] - 1) <= 0.005
    assert ours["kld_mean"] < xl4["kld_mean"], (ours["kld_mean"], xl4["kld_mean"])


def test_the_local_sensitivity_plans_within_5pct_of_the_measured_one_at_equal_bytes(built):
    """The cheap method (``method = "local"``, probed at 2 of the 4 layers so the gains are
    interpolated) against the measured one (auto's choice on 4 layers): the KL divergence of
    the model each plans, at the same target, on the same held-out text."""
    project, target = built
    assert node(project, "oq-eq", "sensitivity").meta["method"] == "measured"
    project.write_manifest(
        "oq-local",
        'extends = "oq-eq"\n[steps.sensitivity]\nparams.method = "local"\nparams.probes = 2\n',
    )
    project.build("oq-local", "--target", "eval")
    sens = node(project, "oq-local", "sensitivity").meta
    gained = {k.split()[0] for k in sens["gains"]}  # "<layer> <kind>"
    assert sens["method"] == "local" and gained == {"-1", "0", "3"}
    local, measured = (node(project, v, "eval").meta["report"] for v in ("oq-local", "oq-eq"))
    assert local["tokens"] == measured["tokens"]
    assert node(project, "oq-local", "quantize").meta["bits_per_weight"] <= target
    assert abs(local["size_bytes"] / measured["size_bytes"] - 1) <= 0.005
    assert local["kld_mean"] <= 1.05 * measured["kld_mean"], (local, measured)


def test_the_local_sensitivity_never_holds_an_expert_stack_or_the_vocabulary_whole(
    built, monkeypatch
):
    """local streams (the 35B model's experts are 3.2 GB and its lm_head 2 GB in float32): with
    blocks of 64 KB, no routed-expert, embedding or lm_head tensor is read whole, of the
    source or of a candidate, and every group still gets a figure at each of its bits."""
    from buildkit.grade import forward as fw
    from buildkit.grade import sensitivity as sens
    from buildkit.grade import texts
    from buildkit.grade.weights import StoreWeights

    project, _ = built
    asked = []
    store, model, params, plan, blocks = local_inputs(project, asked)
    groups = {g: p["tensors"] for g, p in plan.items()}
    bits = {g: [b for b in p["bits"] if b != 16] for g, p in plan.items()}
    big = [
        n
        for n in model.tensors
        if ".switch_mlp." in n or n in (fw.EMBED + ".weight", fw.LM_HEAD + ".weight")
    ]

    class Streamed(StoreWeights):
        def read(self, name):
            assert name not in big, f"{name} read whole"
            return super().read(name)

    monkeypatch.setattr(fw, "BLOCK_BYTES", 64 << 10)
    w = Streamed(store, [model], model.meta["config"], None)
    calib, _ = texts.split_lines(texts.read(texts.text_path(params.text, project.root)), 5)
    tokenizer = store.get_blob(model.files["tokenizer.json"])
    tokens = texts.tokenize(tokenizer, calib, 256)
    figures, gains = sens.local(w, groups, bits, budget.layer_index, blocks, tokens, 128, [0, 3])
    assert {g: sorted(f) for g, f in figures.items()} == {g: sorted(b) for g, b in bits.items()}
    assert all(v >= 0 for f in figures.values() for v in f.values()) and gains
    whole = [(n, r) for n, r in asked if n in big and r >= model.tensors[n]["shape"][0]]
    assert not whole, whole
    assert {n for n, _ in asked} & set(big)  # expert and vocabulary candidates were streamed


def test_a_local_candidate_reuses_what_it_does_not_change_and_gets_the_whole_layers_output(built):
    """local runs of a candidate's layer only what the candidate changes (the routed experts'
    candidates the experts on the source's routing, the shared expert's the shared expert): for
    a candidate of each kind, the output is the whole layer's run with the candidate in it."""
    import mlx.core as mx
    import numpy as np

    from buildkit.grade import forward as fw
    from buildkit.grade import sensitivity as sens
    from buildkit.grade import texts
    from buildkit.grade.weights import StoreWeights

    project, _ = built
    store, model, _, plan, blocks = local_inputs(project)
    groups = {g: p["tensors"] for g, p in plan.items()}
    w = StoreWeights(store, [model], model.meta["config"], None)
    tokens = list(range(3, 200))
    run = sens.LocalPass(w, texts.windows(tokens, 64), blocks)
    prefix, i = "language_model.model.layers.1.", 1
    h = [mx.array(fw.embeddings(w, s)) for s in run.seqs]
    source = fw.streamed_layer(w, prefix, run.args, i)
    parts: dict = {}
    out = fw.run_streamed(source, h, parts)
    kinds = set()
    for g, names in groups.items():
        if not g.startswith(prefix) or sens.kind(g) in kinds:
            continue
        kinds.add(sens.kind(g))
        c = (g, tuple(names), 3 if ".switch_mlp" in g else 4)
        got = run.output(i, c, source, h, parts)
        want = fw.run_streamed(fw.streamed_layer(run.swapped(c), prefix, run.args, i), h)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5, err_msg=g)
        assert sens.squared_error(got, out) > 0  # the candidate changed the layer's output
    assert {"mlp.switch_mlp", "mlp.shared_expert", "attention"} <= kinds, kinds


def test_local_figures_are_the_same_however_many_models_share_a_head_scan(built, monkeypatch):
    """The carried candidates' and lm_head's KLs go KL_GROUP to a head scan (the source's
    logits made once for them): the figures and fits are the bytes of one scan a model."""
    from buildkit.grade import sensitivity as sens
    from buildkit.grade.weights import StoreWeights

    project, _ = built
    store, model, _, plan, blocks = local_inputs(project)
    groups = {g: p["tensors"] for g, p in plan.items()}
    bits = {g: [b for b in p["bits"] if b != 16] for g, p in plan.items()}
    w = StoreWeights(store, [model], model.meta["config"], None)
    args = (w, groups, bits, budget.layer_index, blocks, list(range(3, 200)), 64, [0, 3])
    shared = sens.local(*args)
    monkeypatch.setattr(sens, "KL_GROUP", 1)
    alone = sens.local(*args)
    assert len(shared[1]) >= 4 and shared == alone  # fits at layers -1, 0 and 3, by kind


def test_local_progress_reaches_its_total_when_a_probed_group_moves_nothing(built):
    """A probed group whose candidates leave its layer's output as it was (all-zero weights, as
    the sparse 35B source's are) has nothing to carry through the later layers; the progress
    still ends at the total it announced, and that group's figures are 0."""
    from buildkit.engine.step import Progress
    from buildkit.grade import forward as fw
    from buildkit.grade import sensitivity as sens
    from buildkit.grade.weights import StoreWeights

    project, _ = built
    store, model, _, plan, blocks = local_inputs(project)
    groups = {g: p["tensors"] for g, p in plan.items()}
    bits = {g: [b for b in p["bits"] if b != 16] for g, p in plan.items()}
    w = StoreWeights(store, [model], model.meta["config"], None)
    router = next(g for g in groups if ".layers.0." in g and sens.kind(g) == "mlp.gate")

    def unchanged(name, b, rows, pick=None):  # the router's candidates: its own weights
        if name not in groups[router]:
            return blocks(name, b, rows, pick)
        module = name.removesuffix(".weight")
        return (fw.widen(w, module, parts) for _, parts in fw.raw_blocks(w, module, rows))

    progress = Progress("sensitivity")
    figures, gains = sens.local(
        w, groups, bits, budget.layer_index, unchanged, list(range(3, 200)), 64, [0, 3], progress
    )
    assert progress.total and progress.done == progress.total, (progress.done, progress.total)
    assert bits[router] and set(figures[router].values()) == {0.0}
    assert "0 mlp.gate" not in gains
