"""verify on real artifacts: the xl build's own outputs pass; the same outputs with gate and up
of one layer's routed experts exchanged fail, naming that layer."""

from __future__ import annotations

import copy

import pytest
from conftest import Project

from buildkit.core.errors import VerifyError
from buildkit.engine.step import BuildOptions, Context, Progress
from buildkit.steps.verify import Verify, VerifyParams
from buildkit.store.store import Store

LAYER = "language_model.model.layers.1.mlp.switch_mlp"


def run_verify(p: Project, swap_layer: str | None = None, rel_l1: dict | None = None) -> dict:
    store = Store(p.store)
    nodes = store.get_ref("xl")["nodes"]
    model = store.get_artifact(nodes["quantize"]["outputs"]["out"])
    source = store.get_artifact(nodes["fetch"]["outputs"]["out"])
    if rel_l1:  # quantize's own figures, as a build that measured them wrongly would record
        model = copy.deepcopy(model)
        model.meta["rel_l1"].update(rel_l1)
    if swap_layer:
        model = copy.deepcopy(model)
        t = model.tensors
        for suffix in ("weight", "scales", "biases"):
            g, u = f"{swap_layer}.gate_proj.{suffix}", f"{swap_layer}.up_proj.{suffix}"
            t[g], t[u] = t[u], t[g]
    ctx = Context(
        store,
        "verify",
        "xl",
        BuildOptions(project_root=p.root),
        Progress("verify"),
        log_sink=lambda *a: None,
    )
    return (
        Verify()
        .run(ctx, VerifyParams(), {"model": [model], "source": [source]})["out"]
        .meta["report"]
    )


def test_the_builds_outputs_pass_with_their_figures(seed: Project):
    checks = run_verify(seed)["checks"]
    assert all(c["ok"] for c in checks.values()), [k for k, c in checks.items() if not c["ok"]]
    split = checks["experts_split_order"]["figure"]
    assert split["checked"] == split["ok"] == 4  # the trunk's fused expert tensors, one a layer
    assert split["worst_right"] < 0.045 < 1.0 < split["best_swapped"]  # 6-bit error against ~1.4


def test_gate_and_up_exchanged_in_one_layer_fail_naming_it(seed: Project):
    with pytest.raises(VerifyError) as e:
        run_verify(seed, swap_layer=LAYER)
    msg = str(e.value)
    assert "experts_split_order" in msg and "dequant_rel_l1" in msg
    assert "mlp.experts.gate_up_proj: gate|up" in msg and "layers.1." in msg
    assert f"{LAYER}.gate_proj.weight" in msg


def test_quantizes_figures_are_checked_and_the_first_rows_measured_again(seed: Project):
    """Quantize measures each weight's error on every row as it writes it; verify checks those
    figures and measures the first rows again from the source and the stored bytes, in its
    own numpy arithmetic: the two agree, and a recorded figure over the limit fails."""
    checks = run_verify(seed)["checks"]
    every, first = checks["dequant_rel_l1"]["figure"], checks["dequant_rel_l1_first_rows"]["figure"]
    assert set(every) == set(first) and all(
        every[b]["tensors"] == first[b]["tensors"] for b in every
    )
    for b in every:  # the same kind of error: within a factor of the first rows' own spread
        assert 0.5 * every[b]["max"] < first[b]["max"] < 2 * every[b]["max"], (b, every, first)
    name = f"{LAYER}.down_proj.weight"
    with pytest.raises(VerifyError) as e:
        run_verify(seed, rel_l1={name: 0.5})
    assert "dequant_rel_l1" in str(e.value) and name in str(e.value)
    assert "first_rows" not in str(e.value)  # the bytes themselves are right
