"""verify on real artifacts: the xl build's own outputs pass; the same outputs with gate and up
of one layer's routed experts exchanged fail, naming that layer."""

from __future__ import annotations

import copy

import pytest
from conftest import Project

from buildkit.errors import VerifyError
from buildkit.steps.base import BuildOptions, Context, Progress
from buildkit.steps.verify import Verify, VerifyParams
from buildkit.store import Store

LAYER = "language_model.model.layers.1.mlp.switch_mlp"


def run_verify(p: Project, swap_layer: str | None = None) -> dict:
    store = Store(p.store)
    nodes = store.get_ref("xl")["nodes"]
    model = store.get_artifact(nodes["quantize"]["outputs"]["out"])
    source = store.get_artifact(nodes["fetch"]["outputs"]["out"])
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
