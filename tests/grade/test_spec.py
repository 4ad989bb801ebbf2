"""MTP drafting measured as users run it (issue 36): acceptance by depth (teacher-forced),
tokens per cycle, and mlx_vlm's own speculative generation, lossless, on the trained fixture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import Project

from buildkit.clients import speculative as spec
from buildkit.fixtures.trained import write_trained
from buildkit.grade import drafting
from buildkit.grade import evaluate as ev
from buildkit.grade import forward as fw
from buildkit.grade.texts import heldout_tokens
from buildkit.grade.weights import DirWeights
from buildkit.steps.eval import EvalParams, gate_failures

TEXT = Path(__file__).resolve().parents[2] / "buildkit" / "data" / "calibration.txt"
SPEC = "[steps.eval_head]\nparams.speculative = {}\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """xl-mtp and oq4e-mtp-xl (its donor head the trained one) from the trained fixture, each
    with mlx_vlm's speculative run in eval_head."""
    root = tmp_path_factory.mktemp("spec")
    p = Project(root / "project")
    p.write_manifest(  # and the bf16 pass, off by default
        "xl-mtp-spec", 'extends = "xl-mtp"\n[steps.eval_head]\nparams.speculative = {bf16 = true}\n'
    )
    p.write_manifest(
        "oq4e-spec",
        'extends = "oq4e-mtp-xl"\n[steps.donor_fetch]\nparams.source = "fixture:trained"\n' + SPEC,
    )
    for v in ("xl-mtp-spec", "oq4e-spec"):
        p.build(v, "--source", "fixture:trained")
    return p


def eval_json(p: Project, variant: str) -> dict:
    return json.loads((p.out / variant / "eval.json").read_text())


@pytest.mark.parametrize("variant", ["xl-mtp-spec", "oq4e-spec"])
def test_depth_counts_add_up(built, variant):
    e = eval_json(built, variant)
    d = e["drafts_by_depth"]
    assert len(d) == 3 and len(e["tokens_per_cycle"]) == 3
    # depth 1 is the acceptance eval always reported, on the same positions
    assert d[0][1] == e["acceptance_positions"]
    assert d[0][0] / d[0][1] == e["acceptance"]
    for k in range(1, 3):  # tried at depth k+1: accepted at depth k, where the text goes on
        assert 0 <= d[k][0] <= d[k][1] <= d[k - 1][0]
    assert d[1][1] > 0
    rates = [a / n if n >= 30 else None for a, n in d]  # no rate from fewer than 30 drafts
    assert e["acceptance_by_depth"] == rates
    want, prod = [], 1.0
    for r in rates:
        if r is None:  # never extrapolated beyond the last measured depth
            want += [None] * (len(rates) - len(want))
            break
        prod *= r
        want.append(1 + (want[-1] - 1 if want else 0) + prod)
    speed = [None if t is None else t / 1.66 for t in want]
    for got, exp in ((e["tokens_per_cycle"], want), (e["modelled_speedup"], speed)):
        assert [x is None for x in got] == [x is None for x in exp]
        assert [x for x in got if x is not None] == pytest.approx(
            [x for x in exp if x is not None], rel=1e-12
        )
    for k, t in enumerate(want):  # each measured depth's tokens per cycle has its interval
        ci = e["ci95"]["tokens_per_cycle"][k]
        assert (ci is None) == (t is None) and (t is None or ci[0] <= t <= ci[1])
    if e["best_drafts"] is None:
        assert e["undecided"].startswith(f"not decided at {e['tokens']} tokens")
    else:  # named only when it clears the runner-up
        assert speed[e["best_drafts"] - 1] == max(x for x in speed if x is not None)


@pytest.mark.parametrize("variant", ["xl-mtp-spec", "oq4e-spec"])
def test_mlx_vlm_speculative_is_lossless_in_float32(built, variant):
    s = eval_json(built, variant)["speculative"]
    assert s["lossless"] is True and s["mismatches"] == []
    assert len(s["tokens_per_round"]) == len(s["rounds"]) == 3
    for k, (rounds, acc, drafted) in enumerate(zip(s["rounds"], s["accepted"], s["drafted"]), 1):
        assert 0 <= acc <= drafted <= k * rounds
    assert s["tokens_per_round"][0] > 1.3  # the trained head drafts (a broken one: ~1.0)
    card = (built.out / variant / "README.md").read_text()
    assert "by depth: d1=" in card and "output identical to plain greedy decoding" in card
    assert "Drafting pays where tokens per cycle exceed the verify cost" in card
    if variant == "xl-mtp-spec":  # asked for the bf16 pass
        assert 0 <= s["bf16_divergent_prompts"] <= s["prompts"]
        assert "In bf16," in card
    else:
        assert s["bf16_divergent_prompts"] is None and "In bf16," not in card


def test_broken_head_is_lossless_and_slow(built, tmp_path):
    """fc's halves swapped (embedding and hidden inputs exchanged): the drafter drafts junk,
    the output is still plain greedy's, and only tokens per round shows the defect."""
    d = tmp_path / "broken"
    shutil.copytree(built.out / "xl-mtp-spec", d)  # copies: never write through a published link
    f = d / "mtp" / "model.safetensors"
    w = dict(mx.load(str(f)))
    fc = w["fc.weight"]
    h = fc.shape[0]
    w["fc.weight"] = mx.concatenate([fc[:, h:], fc[:, :h]], axis=1)
    f.unlink()
    mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
    src = DirWeights(write_trained(tmp_path / "trained"))
    tokens = heldout_tokens(TEXT.read_text(), 5, src.tokenizer_json(), 1024)
    p = spec.SpeculativeParams(prompts=2, max_tokens=16, bf16=False)
    prompts = spec.decode_prompts(
        src.tokenizer_json(), spec.prompt_ids(tokens, p.prompts, p.prompt_tokens)
    )
    s = spec.run(d, prompts, 2, p)
    good = eval_json(built, "xl-mtp-spec")["speculative"]["tokens_per_round"]
    assert s["lossless"] is True
    assert all(x < 1.15 for x in s["tokens_per_round"])
    assert all(b < g for b, g in zip(s["tokens_per_round"], good, strict=False))


def test_eval_cli_speculative_json_has_every_key(built, tmp_path, capsys):
    src = write_trained(tmp_path / "trained")
    capsys.readouterr()
    assert (
        built.cli(
            "eval",
            str(built.out / "xl-mtp-spec"),
            "--source",
            str(src),
            "--max-tokens",
            "256",
            "--speculative",
            "--json",
        )
        == 0
    )
    e = json.loads(capsys.readouterr().out)
    assert len(e["acceptance_by_depth"]) == len(e["drafts_by_depth"]) == 3
    assert len(e["tokens_per_cycle"]) == 3
    s = e["speculative"]
    for k in ("lossless", "rounds", "accepted", "drafted", "tokens_per_round"):
        assert k in s
    assert s["lossless"] is True and "bf16_divergent_prompts" in s


def test_compare_and_status_show_the_drafting_figures(built, capsys):
    capsys.readouterr()
    assert built.cli("compare", "xl-mtp-spec", "oq4e-spec") == 0
    out = capsys.readouterr().out
    assert "tok/cycle" in out and "mlx_vlm tok/round" in out and "NOT LOSSLESS" not in out
    assert built.cli("compare", "xl-mtp-spec", "--json") == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["drafts_by_depth"] == eval_json(built, "xl-mtp-spec")["drafts_by_depth"]
    assert built.cli("status", "--json") == 0
    st = {r["variant"]: r for r in json.loads(capsys.readouterr().out)}
    assert st["xl-mtp-spec"]["eval"]["tokens_per_cycle"] == row["tokens_per_cycle"]


def test_min_tokens_per_cycle_gate():
    rep = {
        "tokens_per_cycle": [1.5, 1.9, 2.1],
        "drafts_by_depth": [[50, 100], [40, 50], [30, 40]],
        "ci95": {"tokens_per_cycle": [[1.4, 1.6], [1.8, 2.0], [2.05, 2.2]]},
    }
    assert gate_failures(EvalParams(min_tokens_per_cycle=2.0), rep) == []
    (msg,) = gate_failures(EvalParams(min_tokens_per_cycle=2.1), rep)  # the figure meets it
    assert msg == (
        "tokens_per_cycle (3 drafts) 2.1 (95% interval [2.05, 2.2]) is not all >= "
        "min_tokens_per_cycle 2.1"
    )
    (msg,) = gate_failures(EvalParams(min_tokens_per_cycle=2.5), {})
    assert "measures no drafts by depth" in msg


def test_trunk_eval_key_is_unchanged_by_the_head_params():
    base = EvalParams().key_params()
    assert "depth" not in base and "speculative" not in base
    head = EvalParams(scope="head").key_params()
    assert head["depth"] == 3 and "speculative" not in head
    assert (
        "speculative" in EvalParams(scope="head", speculative=spec.SpeculativeParams()).key_params()
    )


def test_chain_is_the_drafters_incremental_loop(built, tmp_path):
    """The batched chain (one head pass per depth, masked) drafts what the runtime's loop
    drafts: the head's cache filled with the true entries 0..t, then one token at a time."""
    from mlx_lm.models.cache import KVCache

    src = DirWeights(write_trained(tmp_path / "trained"))
    mod = DirWeights(built.out / "xl-mtp-spec")
    tokens = heldout_tokens(TEXT.read_text(), 5, src.tokenizer_json(), 64)
    _, (_, tm) = ev.evaluate(src, mod, tokens, 64, head=False)
    depth = 3
    drafts = drafting.chains(mod, tm, depth)
    head, out = ev.load_head(mod), fw.Output(mod)
    x0, h = tm.x0[0], tm.h[0]
    for t in (0, 17, 40, h.shape[1] - 2):
        cache = [KVCache()]
        o = drafting.head_pass(head, x0[:, 1 : t + 2], h[:, : t + 1], cache[0], "causal")
        o = o[:, -1:]
        got = [int(mx.argmax(out(o), axis=-1).item())]
        for _ in range(depth - 1):
            e = fw.embed(mod, [np.array([[got[-1]]], np.int32)])[0]
            o = drafting.head_pass(head, e, o, cache[0], None)
            got.append(int(mx.argmax(out(o), axis=-1).item()))
        want = [int(drafts[0][d][0, t].item()) for d in range(depth)]
        assert got == want, t
    # read out only where graded (the build's way), the counts are the same
    pruned = drafting.chains(mod, tm, depth, tokens)
    assert drafting.count(pruned, tm, tokens, depth) == drafting.count(drafts, tm, tokens, depth)
    skipped = sum(int((p == -1).sum()) for dr in pruned for p in dr)
    assert skipped > 0  # some chains ended before the last depth, and were not read out
