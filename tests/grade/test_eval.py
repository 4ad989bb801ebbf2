"""The eval step, `buildkit eval` and `buildkit compare`: figures, caching, gates, mlx_lm parity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import Project, acceptance_is_depth_one, cached, ran

from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.grade import evaluate as ev
from buildkit.grade import texts
from buildkit.grade.texts import heldout_tokens
from buildkit.grade.weights import HEAD, DirWeights
from buildkit.steps.reference import MAX_TOKENS
from buildkit.store.store import Store

TEXT = Path(__file__).resolve().parents[2] / "buildkit" / "data" / "calibration.txt"
FIGURES = (
    "kld_mean",
    "kld_median",
    "kld_p99",
    "top1_agreement",
    "ppl_source",
    "ppl_model",
    "acceptance",
    "acceptance_source",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """xl, then xl-mtp, from a generated checkpoint directory (so `buildkit eval` can read it)."""
    root = tmp_path_factory.mktemp("eval")
    src = generate(root / "src", FixtureSpec(seed=0))
    p = Project(root / "project")
    xl = p.build("xl", "--source", str(src))
    mtp = p.build("xl-mtp", "--source", str(src))
    return p, Path(src), xl, mtp


def eval_json(p: Project, variant: str) -> dict:
    return json.loads((p.out / variant / "eval.json").read_text())


def cli_json(p: Project, capsys, *argv) -> dict | list:
    capsys.readouterr()
    assert p.cli(*argv) == 0
    return json.loads(capsys.readouterr().out)


def test_figures_are_finite_and_sane(built):
    p, *_ = built
    e = eval_json(p, "xl-mtp")
    assert all(math.isfinite(e[k]) for k in FIGURES)
    assert 0 <= e["kld_median"] <= e["kld_p99"] and 0 < e["kld_mean"]
    assert (
        0 <= e["top1_agreement"] <= 1
        and 0 <= e["acceptance"] <= 1
        and 0 <= e["acceptance_source"] <= 1
    )
    assert e["ppl_model"] > 1 and e["ppl_source"] > 1
    assert e["tokens"] == 2048 and e["windows"] == 16  # the default: 16 sequences of 128
    assert e["positions"] == 2048 - 16 and e["text_tokens"] >= 2048
    for k in ("kld_mean", "kld_median", "kld_p90", "kld_p95", "kld_p99", "kld_p999"):
        lo, hi = e["ci95"][k]  # llama.cpp's KLD report, each figure with its interval
        assert lo <= e[k] <= hi, k
    assert e["kld_median"] <= e["kld_p90"] <= e["kld_p95"] <= e["kld_p99"] <= e["kld_p999"]
    assert -1 <= e["delta_p_mean"] <= 1 and 0 <= e["delta_p_rms"] <= 1
    assert e["ppl_ratio"] == pytest.approx(e["ppl_model"] / e["ppl_source"], rel=1e-9)
    assert set(e["ci95"]) >= {"delta_p_mean", "delta_p_rms", "top1_agreement", "ppl_ratio"}
    card = (p.out / "xl-mtp" / "README.md").read_text()
    assert "## Evaluation" in card and "KL divergence KL(p_bf16 ‖ p_model), mean" in card
    h = (e["ci95"]["kld_mean"][1] - e["ci95"]["kld_mean"][0]) / 2
    assert f"{e['kld_mean']:.5f} ± {h:.5f}" in card
    assert f"On 2048 of {e['text_tokens']} tokens of the held-out lines" in card
    assert "acceptance" not in eval_json(p, "xl")  # xl has no head: no acceptance figure


def test_xl_mtp_reuses_xls_eval_node_and_grades_only_the_head(built):
    p, _, xl, mtp = built
    assert "eval" in ran(xl) and "eval" in cached(mtp)
    assert "eval_head" in ran(mtp)
    store = Store(p.store)
    assert store.get_ref("xl")["keys"]["eval"] == store.get_ref("xl-mtp")["keys"]["eval"]
    head = {  # eval_head's own figures (drafting by depth, tests/grade/test_spec.py)
        "drafts_by_depth",
        "drafts_by_depth_source",
        "tokens_per_cycle",
        "tokens_per_cycle_source",
        "verify_cost",
        "best_drafts",
        "modelled_speedup",
        "speculative",
        "text",
        "undecided",
        "per_window_acceptance",
        "ci95",
    }
    mtp = eval_json(p, "xl-mtp")
    trunk = {k: v for k, v in mtp.items() if not k.startswith("acceptance") and k not in head}
    xl = eval_json(p, "xl")
    assert trunk == {k: v for k, v in xl.items() if k not in ("text", "ci95")} | {
        "size_bytes": trunk["size_bytes"]
    }
    assert xl["ci95"].items() <= mtp["ci95"].items()  # the head's intervals join the trunk's
    assert eval_json(p, "xl-mtp")["text"] == xl["text"] == "builtin:calibration.txt"


def test_the_source_against_itself_is_kld_zero_top1_one(built, capsys):
    p, src, *_ = built
    e = cli_json(p, capsys, "eval", str(src), "--source", str(src), "--json", "--max-tokens", "256")
    assert e["kld_mean"] == 0 and e["kld_p99"] == 0 and e["top1_agreement"] == 1.0
    assert e["ppl_model"] == e["ppl_source"] and e["acceptance"] == e["acceptance_source"]


def test_buildkit_eval_of_a_published_directory_matches_the_step(built, capsys):
    p, src, *_ = built
    e = cli_json(p, capsys, "eval", str(p.out / "xl-mtp"), "--source", str(src), "--json")
    step = eval_json(p, "xl-mtp")
    for k in (*FIGURES, "tokens", "positions"):
        assert e[k] == step[k], k
    acceptance_is_depth_one(e)


def test_buildkit_eval_grades_an_mlx_lm_convert_directory(built, capsys, tmp_path):
    """Any MLX directory: mlx_lm.convert's 4-bit output of the same source (no head, no vision)."""
    from mlx_lm import convert

    p, src, *_ = built
    convert(str(src), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=64)
    e = cli_json(
        p,
        capsys,
        "eval",
        str(tmp_path / "q4"),
        "--source",
        str(src),
        "--json",
        "--max-tokens",
        "256",
    )
    assert e["kld_mean"] > 0 and math.isfinite(e["kld_p99"]) and 0 < e["top1_agreement"] < 1
    assert "acceptance" not in e  # mlx_lm.convert drops the MTP head
    xl = cli_json(
        p, capsys, "eval", str(p.out / "xl"), "--source", str(src), "--json", "--max-tokens", "256"
    )
    assert (
        xl["ppl_source"] == e["ppl_source"] and xl["kld_mean"] < e["kld_mean"]
    )  # 6/8-bit beats 4-bit


def n_sequences(tokens: list[int]) -> int:
    return sum(b.shape[0] for b in texts.windows(tokens, 128))


def test_eval_text_grades_every_line_of_the_file(built, capsys, tmp_path):
    """A user's own text is graded whole, past the step's max_tokens: its '#' lines, blank
    lines and every other line; the printed output says how many of its tokens."""
    from tokenizers import Tokenizer

    from buildkit.steps.reference import MAX_TOKENS

    p, src, *_ = built
    lines = ["# a header line, graded too", ""] + [
        f"line {i}: the {'quick' if i % 2 else 'lazy'} fox number {i * 7}" for i in range(300)
    ]
    text = "\n".join(lines) + "\n"
    mine = str(tmp_path / "mine.txt")
    (tmp_path / "mine.txt").write_text(text)
    tok = Tokenizer.from_str((src / "tokenizer.json").read_text())
    want = tok.encode(text, add_special_tokens=False).ids
    capsys.readouterr()
    assert p.cli("eval", str(src), "--source", str(src), "--text", mine) == 0
    out = capsys.readouterr().out
    n = str(len(want))
    assert out.splitlines()[0].split() == ["graded", n, "of", n, "tokens", "of", mine]
    assert "kld_mean 0 ± 0" in " ".join(out.split())  # every figure with its half-width
    e = cli_json(p, capsys, "eval", str(src), "--source", str(src), "--text", mine, "--json")
    assert e["tokens"] == e["text_tokens"] == len(want) > MAX_TOKENS
    assert e["positions"] == len(want) - n_sequences(want)  # all but each sequence's last
    held = heldout_tokens(text, 5, (src / "tokenizer.json").read_bytes(), 100000)
    assert e["tokens"] > 4 * len(held)  # not the held-out fifth
    argv = ("eval", str(src), "--source", str(src), "--text", mine, "--max-tokens", "200")
    capped = cli_json(p, capsys, *argv, "--json")
    assert capped["tokens"] == 200 and capped["text_tokens"] == len(want)
    assert p.cli(*argv) == 0
    assert (
        f"200 of {len(want)} tokens of {mine} (capped by --max-tokens)" in capsys.readouterr().out
    )


def test_target_rel_ci_grades_in_rounds_until_narrow_enough(built, tmp_path):
    """With target_rel_ci, eval grades 8 windows, then doubles: a wide target stops at the
    first round, a narrow one at max_tokens, with the figures of one pass over those windows."""
    p0, src, *_ = built
    p = Project(tmp_path).adopt(p0)
    for name, target in (("wide", 100.0), ("narrow", 1e-9)):
        p.write_manifest(
            f"xl-{name}", f'extends = "xl"\n[steps.eval]\nparams.target_rel_ci = {target}\n'
        )
        p.build(f"xl-{name}", "--source", str(src))
    wide, narrow, whole = (eval_json(p, v) for v in ("xl-wide", "xl-narrow", "xl"))
    assert (wide["tokens"], wide["windows"]) == (1024, 8)
    assert wide["stopped_by"] == "target_rel_ci 100 reached"
    assert narrow["tokens"] == whole["tokens"] == 2048 and narrow["stopped_by"] == "max_tokens 2048"
    for k in ("kld_mean", "kld_p99", "top1_agreement", "ppl_model", "delta_p_rms"):
        assert narrow[k] == pytest.approx(whole[k], rel=1e-4), k  # two rounds, one pass's figures
    assert narrow["per_window"]["positions"] == whole["per_window"]["positions"]
    card = (p.out / "xl-wide" / "README.md").read_text()
    assert "stopped by target_rel_ci 100 reached" in card


def _mlx_lm_ppl(model, tokens: list[int]) -> float:
    nll = []
    for b in texts.windows(tokens, 128):
        for row in b:
            logits = model(mx.array(row[None]))[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nll.append(
                -np.array(mx.take_along_axis(lp[:-1], mx.array(row[1:])[:, None], axis=-1))[:, 0]
            )
    return float(np.exp(np.concatenate(nll).astype(np.float64).mean()))


def test_perplexity_is_mlx_lms_on_the_same_tokens(built):
    """Our forward is the client's: mlx_lm.load of the published directory, the same tokens."""
    from mlx_lm import load

    p, src, *_ = built
    tokens = heldout_tokens(TEXT.read_text(), 5, (src / "tokenizer.json").read_bytes(), MAX_TOKENS)
    model, _ = load(str(p.out / "xl"))
    want = eval_json(p, "xl")["ppl_model"]
    bf16 = _mlx_lm_ppl(model, tokens)  # as users run it: bf16 arithmetic
    model.set_dtype(mx.float32)  # the same model in float32, as eval runs it
    f32 = _mlx_lm_ppl(model, tokens)
    assert f32 == pytest.approx(want, rel=1e-4)
    assert bf16 == pytest.approx(want, rel=2e-2)


def test_compare_prints_a_table_and_plots(built, capsys):
    p, *_ = built
    capsys.readouterr()
    png = p.root / "size-kld.png"
    assert p.cli("compare", "xl", "xl-mtp", "--plot", str(png)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:6] == ["variant", "size", "MB", "bpw", "KLD", "mean"]
    assert [line.split()[0] for line in out[1:]] == ["xl", "xl-mtp"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = cli_json(p, capsys, "compare", "xl-mtp", "--json")
    assert rows[0]["acceptance"] == eval_json(p, "xl-mtp")["acceptance"]
    assert p.cli("compare", "oq4e-mtp-xl") == 1  # never built: said, not a table of blanks


def test_status_shows_the_figures(built, capsys):
    p, *_ = built
    rows = {r["variant"]: r for r in cli_json(p, capsys, "status", "--json")}
    assert rows["xl-mtp"]["eval"]["kld_mean"] == eval_json(p, "xl-mtp")["kld_mean"]
    assert "eval" not in rows["oq4e-mtp-xl"]
    e = eval_json(p, "xl-mtp")
    h = (e["ci95"]["acceptance"][1] - e["ci95"]["acceptance"][0]) / 2
    assert p.cli("status") == 0  # each figure as its users read it: value ± half-width
    assert f"accept {e['acceptance']:.2%} ± {h:.2%}" in capsys.readouterr().out


def test_text_is_keyed_by_content_not_path(built, capsys):
    p, src, *_ = built
    (p.root / "held.txt").write_text(TEXT.read_text())
    p.write_manifest("xl-text", 'extends = "xl"\n[steps.reference]\nparams.text = "held.txt"\n')
    plan = cli_json(
        p, capsys, "plan", "xl-text", "--source", str(src), "--out", str(p.out / "xl"), "--json"
    )
    assert {s["step"]: s["fresh"] for s in plan["steps"]}["reference"] is True
    (p.root / "held.txt").write_text(TEXT.read_text() + "one more line\n" * 5)
    plan = cli_json(
        p, capsys, "plan", "xl-text", "--source", str(src), "--out", str(p.out / "xl"), "--json"
    )
    step = {s["step"]: s for s in plan["steps"]}["reference"]
    assert not step["fresh"] and "source changed: text" in step["reasons"][0]


def test_a_gate_fails_a_release_build_with_a_clear_message(built, tmp_path):
    p0, src, *_ = built
    p = Project(tmp_path).adopt(p0)
    p.write_manifest("xl-gated", 'extends = "xl"\n[steps.eval]\nparams.max_kld_mean = 1e-9\n')
    ok = p.build("xl-gated", "--source", str(src))  # gates are not in the key: xl's eval, cached
    assert "eval" in cached(ok)
    rel = p.run(
        "build",
        "xl-gated",
        "--source",
        str(src),
        "--out",
        str(p.out / "xl-gated"),
        "--release",
        check=False,
    )
    assert rel.returncode == 1
    assert "release gate failed: kld_mean" in rel.stderr
    assert "is not all <= max_kld_mean 1e-09" in rel.stderr  # judged on the interval
    assert "eval" in cached(rel)  # the release hook judges the cached figures: nothing reruns
    assert not (p.manifests / "xl-gated.lock").exists()


def test_oq4e_grades_a_data_agnostic_baseline_beside_itself(built, tmp_path, capsys):
    p0, src, *_ = built
    p = Project(tmp_path).adopt(p0)
    oq4e = p.manifests / "oq4e-mtp-xl.toml"  # a donor with this source's vocabulary (512)
    oq4e.write_text(oq4e.read_text().replace("fixture:seed=1,vocab=2048", "fixture:seed=1"))
    p.build("oq4e-mtp-xl", "--source", str(src))
    e = eval_json(p, "oq4e-mtp-xl")
    base = e["others"]["data-agnostic 4-bit (baseline)"]
    assert base["tokens"] == e["tokens"] and math.isfinite(base["kld_mean"])
    assert "data-agnostic 4-bit (baseline)" in (p.out / "oq4e-mtp-xl" / "README.md").read_text()
    rows = cli_json(p, capsys, "compare", "oq4e-mtp-xl", "--json")
    assert [r["variant"] for r in rows] == [
        "oq4e-mtp-xl",
        "oq4e-mtp-xl [data-agnostic 4-bit (baseline)]",
    ]
    assert rows[1]["size_bytes"] == rows[0]["size_bytes"]  # the same bits, other bytes
    ratio = rows[1]["kld_ratio"]  # the model's KLD over the baseline's, paired by window
    assert ratio == pytest.approx(e["kld_mean"] / base["kld_mean"], rel=1e-9)
    lo, hi = rows[1]["ci95"]["kld_ratio"]
    assert lo <= ratio <= hi

    # calibration skew: each domain text graded whole, for the model and its baseline
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str((src / "tokenizer.json").read_text())
    texts = Path(ev.__file__).parents[1] / "data" / "texts"
    for figs in (e, base):
        assert set(figs["domains"]) == {"prose", "code", "fr"}
        for name, d in figs["domains"].items():
            whole = tok.encode((texts / f"{name}.txt").read_text(), add_special_tokens=False)
            assert d["tokens"] == min(len(whole.ids), 2048), name
            assert math.isfinite(d["kld_mean"]) and 0 <= d["top1_agreement"] <= 1, name
            assert d["positions"] == d["tokens"] - n_sequences(whole.ids[:2048])
    assert all(0 <= d["acceptance"] <= 1 for d in e["domains"].values())  # its head, per domain
    assert e["text"] == "builtin:calibration.txt"
    card = (p.out / "oq4e-mtp-xl" / "README.md").read_text()
    assert "held-out lines of builtin:calibration.txt" in card
    for name, d in e["domains"].items():
        ratio = d["kld_mean"] / base["domains"][name]["kld_mean"]
        assert f"| {name} | {d['tokens']} | {d['kld_mean']:.5f} ± " in card
        assert base["domains"][name]["kld_ratio"] == pytest.approx(ratio, rel=1e-9)
        assert f"| {ratio:.3f} ± " in card  # paired by window
    assert rows[0]["domains"]["code"]["kld_mean"] == e["domains"]["code"]["kld_mean"]
    capsys.readouterr()
    assert p.cli("compare", "oq4e-mtp-xl") == 0
    table = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[1:]]
    assert table == ["oq4e-mtp-xl", "code", "fr", "prose", "oq4e-mtp-xl", "code", "fr", "prose"]
    status = {r["variant"]: r for r in cli_json(p, capsys, "status", "--json")}
    assert set(status["oq4e-mtp-xl"]["eval"]["domains"]) == {"prose", "code", "fr"}


# ---- with the trained fixture (buildkit/data/trained) ------------------------------------------


def trained_text() -> tuple[Path, int]:
    """The trained fixture's own held-out verses (every other line of them), else the
    builtin text."""
    from buildkit.fixtures.trained import DATA

    return (DATA / "heldout.txt", 2) if (DATA / "heldout.txt").is_file() else (TEXT, 5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from buildkit.fixtures.trained import write_trained

    root = tmp_path_factory.mktemp("trained")
    src = write_trained(root / "src")
    p = Project(root / "project")
    text, every = trained_text()
    xl = p.manifests / "xl.toml"
    line = next(ln for ln in xl.read_text().splitlines() if ln.startswith("params.text"))
    xl.write_text(
        xl.read_text().replace(
            line,
            f'params.text = "{text}"\nparams.heldout_every = {every}\nparams.max_tokens = 1024',
        )
    )  # 1024 tokens: these figures are compared within a few points
    for bits in (4, 3):
        p.write_manifest(
            f"xl-{bits}bit",
            f'extends = "xl"\n[recipe.roles]\n'
            f"routed_expert = {{ bits = {bits}, group_size = 64 }}\n",
        )
    for v in ("xl", "xl-mtp", "xl-4bit", "xl-3bit"):
        p.build(v, "--source", str(src))
    return p, Path(src)


def test_trained_kld_grows_as_bits_shrink(trained):
    p, _ = trained
    assert (
        eval_json(p, "xl")["kld_mean"]
        < eval_json(p, "xl-4bit")["kld_mean"]
        < eval_json(p, "xl-3bit")["kld_mean"]
    )


def test_trained_head_accepts_within_three_points_of_bf16(trained):
    p, _ = trained
    e = eval_json(p, "xl-mtp")
    assert e["acceptance_source"] > 0.3  # a trained head drafts
    assert abs(e["acceptance"] - e["acceptance_source"]) <= 0.03


class Broken(DirWeights):
    """The published xl-mtp with its head broken the way a converter can break it."""

    NORMS = (
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
        "mtp.norm",
        "layernorm",
        "q_norm",
        "k_norm",
    )

    def __init__(self, path, how: str):
        super().__init__(path)
        self.how = how

    def swapped(self, name):
        if name.startswith(HEAD) and self.how == "gate_up" and ".switch_mlp." in name:
            return (
                name.replace("gate_proj", "\0")
                .replace("up_proj", "gate_proj")
                .replace("\0", "up_proj")
            )
        return name

    def iter_rows(self, name, rows, pick=None):  # the experts are read in blocks of rows
        yield from super().iter_rows(self.swapped(name), rows, pick)

    def read(self, name):
        head = name.startswith(HEAD)
        name = self.swapped(name)
        a = super().read(name)
        if (
            head
            and self.how == "norms"
            and name.endswith(".weight")
            and any(n in name for n in self.NORMS)
        ):
            f = a.view(np.uint16).astype(np.uint32) << 16
            return ((f.view(np.float32) + 1.0).view(np.uint32) >> 16).astype(np.uint16)
        if head and self.how == "fc" and name == "language_model.mtp.fc.weight":
            half = a.shape[1] // 2
            return np.concatenate([a[:, half:], a[:, :half]], axis=1)
        return a


# At least 20 points lower where the failure is real on this model. Norms shifted twice are
# not, here: measured 64.9% -> 50.2% (-14.7 points) on the trained fixture, whose head norm
# offsets are near 0 (means -0.25..0.29), so a second +1 scales activations about x2, which the
# next norms mostly absorb; the real model's pre-fc norms (shifted means 0.49, 0.27) are hit
# harder. That case must still cost at least 10 points.
DROP = {"norms": 0.10, "fc": 0.20, "gate_up": 0.20}


@pytest.mark.parametrize("how", sorted(DROP))
def test_trained_broken_heads_grade_lower(trained, how):
    p, src = trained
    good = eval_json(p, "xl-mtp")["acceptance"]
    text, every = trained_text()
    tokens = heldout_tokens(text.read_text(), every, (src / "tokenizer.json").read_bytes(), 1024)
    fig, _ = ev.evaluate(DirWeights(src), Broken(p.out / "xl-mtp", how), tokens, 128)
    assert fig["acceptance"] <= good - DROP[how], (how, fig["acceptance"], good)


def test_trained_data_aware_experts_beat_data_agnostic_at_the_same_bits(tmp_path):
    """oq4e's calibrated 4-bit experts against its own data-agnostic 4-bit baseline, on the
    model's outputs (measured when written: KLD 0.0085 against 0.0094, top-1 95.6% against
    94.3%, on the builtin text's held-out lines)."""
    p = Project(tmp_path)
    p.write_manifest(
        "oq4e-trained",
        'extends = "oq4e-mtp-xl"\nsource = "fixture:trained"\n'
        '[steps.donor_fetch]\nparams.source = "fixture:trained"\n'
        "[steps.reference]\nparams.max_tokens = 1024\n"
        "[steps.reference_domains]\nparams.max_tokens = 1024\n",
    )
    p.build("oq4e-trained")
    e = eval_json(p, "oq4e-trained")
    base = e["others"]["data-agnostic 4-bit (baseline)"]
    assert e["tokens"] == base["tokens"]
    assert e["kld_mean"] < base["kld_mean"], (e["kld_mean"], base["kld_mean"])
