"""Degenerate weights through the real pipeline (issue 41): all-zero routed experts, an all-zero
row and all-zero groups in the source give figures or a counted skip in every step, never a
traceback, and the data-aware comparison leaves out the experts it cannot rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import Project

from buildkit.fixtures.trained import write_trained
from buildkit.formats.tensors import read_header
from buildkit.store.store import Store

LM = "model.language_model.layers"


def zero(src: Path, name: str, start: int, length: int) -> None:
    """Zero ``length`` bytes of tensor ``name`` from byte ``start`` of its data, in place."""
    for shard in sorted(src.glob("*.safetensors")):
        info = read_header(shard).tensors.get(name)
        if info is not None:
            assert start + length <= info.nbytes
            fd = os.open(shard, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes(length), info.start + start)
            finally:
                os.close(fd)
            return
    raise AssertionError(f"no tensor {name}")


def degenerate_source(root: Path, every_expert: bool) -> Path:
    """The trained fixture (4 layers of 8 experts) with layer 0's experts 0 and 1 zeroed (or
    every routed expert of every layer), a group of an expert, a row and a group zeroed."""
    src = write_trained(root / "src")
    for layer in range(4 if every_expert else 1):
        for proj, rows, cols in (("gate_up_proj", 128, 128), ("down_proj", 128, 64)):
            experts = 8 if every_expert else 2
            zero(src, f"{LM}.{layer}.mlp.experts.{proj}", 0, experts * rows * cols * 2)
    zero(src, f"{LM}.1.mlp.experts.gate_up_proj", 3 * 128 * 128 * 2, 64 * 2)  # one group
    zero(src, f"{LM}.3.self_attn.q_proj.weight", 0, 128 * 2)  # a whole row
    zero(src, "model.language_model.embed_tokens.weight", 5 * 128 * 2, 64 * 2)  # a group
    return src


@pytest.mark.parametrize(
    "variant,every_expert",
    [("oq4e-mtp-xl", False), ("oq4e-search-mtp-xl", False), ("oq4e-mtp-xl", True)],
)
def test_zeroed_experts_rows_and_groups_build_with_their_figures(tmp_path, variant, every_expert):
    p = Project(tmp_path)
    src = degenerate_source(tmp_path, every_expert)
    p.write_manifest(
        "zeroed",
        f'extends = "{variant}"\nsource = "{src}"\n[steps.donor_fetch]\nparams.source = "{src}"\n',
    )
    done = p.run("build", "zeroed", "--out", str(p.out / "zeroed"), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    store = Store(p.store)
    nodes = store.get_ref("zeroed")["nodes"]
    report = store.get_artifact(nodes["verify"]["outputs"]["out"]).meta["report"]
    assert report["ok"], report
    experts = report["checks"]["calibrated_expert_error"]["figure"]
    # the zeroed experts output nothing: no relative error to rank them by
    assert experts["zero_experts"] == (32 if every_expert else 2)
    if every_expert:  # the data-agnostic error was 0 on every expert: a division by zero once
        assert experts["experts"] == 0 and experts["data_aware"] is None
    else:
        assert experts["experts"] > 0 and experts["data_aware"] < experts["data_agnostic"]
    split = report["checks"]["experts_split_order"]["figure"]  # all-zero gate and up: no order
    assert split.get("indistinct", 0) == (4 if every_expert else 0)
    l1 = report["checks"]["dequant_rel_l1"]["figure"]
    assert all(v["max"] < v["limit"] for v in l1.values()), l1
    figures = json.loads((p.out / "zeroed" / "eval.json").read_text())
    assert figures, "eval graded the model"
