"""mlx_vlm's real-client run within memory (issue 41): decided before anything is loaded, from
the model's tensor sizes against what the machine gives; when it does not fit, eval.json, the
card and ``status`` say so and the build succeeds on its teacher-forced figures. A head that
accepts nothing stops the run after one prompt."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
from conftest import Project, ran

from buildkit.clients import speculative as spec
from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.formats.tensors import read_header

MB = 1 << 20


def eval_json(p: Project, variant: str) -> dict:
    return json.loads((p.out / variant / "eval.json").read_text())


def published_entries(out) -> dict[str, dict]:
    """The published model's tensors (dtype, shape), read from its safetensors headers."""
    return {
        n: {"dtype": i.dtype, "shape": list(i.shape)}
        for f in sorted(out.glob("model*.safetensors"))
        for n, i in read_header(f).tensors.items()
    }


def test_the_decision_follows_the_sizes_and_the_budget(seed):
    entries = published_entries(seed.out / "xl-mtp")
    need = spec.run_bytes(entries)
    stored = sum(f.stat().st_size for f in (seed.out / "xl-mtp").glob("model*.safetensors"))
    # the tensors as stored (the files are those and their small headers), then more on top
    assert 0.99 * stored < need["model_bytes"] <= stored
    assert need["needed_bytes"] > need["model_bytes"] + spec.RUN_OVERHEAD
    n = need["needed_bytes"]
    assert "skipped" not in spec.memory_decision(entries, (n, "a test's budget"))
    no = spec.memory_decision(entries, (n - 1, "a test's budget"))
    assert no["skipped"].startswith("mlx_vlm loads the whole model: its run needs ~")
    assert "a test's budget leaves" in no["skipped"]
    # the real model's size (30.6 GB as published) on a 24 GB machine: not run
    big = {"w": {"dtype": "U32", "shape": [30_600_000_000 // 4]}}
    assert "skipped" in spec.memory_decision(big, (int(23.5 * 2**30), "MemAvailable"))


def test_budget_from_the_environment_is_checked(monkeypatch):
    monkeypatch.setenv(spec.MEMORY_ENV, "12345678")
    assert spec.available_memory() == (12345678, f"{spec.MEMORY_ENV}=12345678")
    monkeypatch.setenv(spec.MEMORY_ENV, "lots")
    with pytest.raises(Exception, match="BUILDKIT_MEMORY='lots' is not a number of bytes"):
        spec.available_memory()


def test_a_build_too_large_for_its_budget_records_why_and_succeeds(project, capsys):
    """A 1 MB budget: eval_head records why mlx_vlm did not run, publish goes on, the card and
    status say so; with the machine's memory again the next build runs it."""
    env = {**os.environ, spec.MEMORY_ENV: str(MB)}
    project.write_manifest("small-box", 'extends = "xl-mtp"\n')
    out = str(project.out / "small-box")
    proc = project.run("build", "small-box", "--out", out, env=env)
    assert "eval_head" in ran(proc) and "publish" in ran(proc)
    assert "speculative run is not possible at this size" in proc.stderr
    s = eval_json(project, "small-box")["speculative"]
    assert set(s) == {"skipped", "needed_bytes"}
    assert f"{spec.MEMORY_ENV}={MB} leaves 1.0 MB" in s["skipped"]
    card = (project.out / "small-box" / "README.md").read_text()
    assert "was not possible at this size" in card and "by depth: d1=" in card
    capsys.readouterr()
    assert project.cli("status", "--json") == 0
    st = {r["variant"]: r for r in json.loads(capsys.readouterr().out)}
    assert st["small-box"]["eval"]["speculative"]["skipped"] == s["skipped"]
    assert project.cli("compare", "small-box") == 0
    assert "not run: memory" in capsys.readouterr().out

    again = project.build("small-box")  # the machine's memory: the cached skip runs again
    assert "eval_head" in ran(again)
    assert "was skipped for memory" in again.stderr
    s = eval_json(project, "small-box")["speculative"]
    assert s["lossless"] is True and "skipped" not in s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux counts it")
def test_every_step_fits_under_an_address_space_limit(project):
    """The whole xl-mtp build from nothing under ``prlimit --as`` 1.25 GB (the build's own
    address space is ~0.7 GB at eval_head, and mlx_vlm's run needs ~0.8 GB): no step fails
    for memory, and eval_head, finding less room than the run needs, records that it did not
    run. (Before one malloc arena for every thread, the build's was ~1.3 GB: 1.75 GB left
    too little; now it leaves enough, and the run goes.)"""
    limit = int(1.25e9)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = project.run("build", "xl-mtp", "--out", str(project.out / "xl-mtp"), preexec_fn=cap)
    assert "publish" in ran(proc)
    s = eval_json(project, "xl-mtp")["speculative"]
    assert "the address-space limit (RLIMIT_AS) leaves" in s["skipped"]


def test_a_head_that_accepts_nothing_stops_after_one_prompt(seed, tmp_path):
    """The head's fc zeroed: its drafts are one fixed token, never the trunk's. The run stops
    after the first prompt at one draft a round, still lossless, and its work (positions run)
    is a small share of the full run's."""
    import shutil

    import mlx.core as mx

    d = tmp_path / "xl-mtp"
    shutil.copytree(seed.out / "xl-mtp", d)  # copies: never write through a published link
    f = d / "mtp" / "model.safetensors"
    w = dict(mx.load(str(f)))
    w["fc.weight"] = mx.zeros_like(w["fc.weight"])
    f.unlink()
    mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
    tokens = list(range(100, 400))
    tok = (d / "tokenizer.json").read_bytes()
    p = spec.SpeculativeParams()
    prompts = spec.decode_prompts(tok, spec.prompt_ids(tokens, p.prompts, p.prompt_tokens))
    s = spec.run(d, prompts, 3, p)
    assert s["lossless"] is True and s["accepted"] == [0] and s["drafted"][0] > 0
    assert s["prompts"] == 1 and "accepted none of its" in s["stopped_early"]
    full = spec.run(seed.out / "xl-mtp", prompts, 3, p)
    assert "stopped_early" not in full and full["prompts"] == p.prompts
    # one prompt's plain and 1-draft runs of the full run's prompts x (plain + 3 depths)
    bound = 2 / (p.prompts * 4) + 0.05
    assert s["positions"] <= bound * full["positions"], (s["positions"], full["positions"])


# This process's peak RSS: VmHWM starts afresh at exec, where ru_maxrss keeps the parent's
HWM = """
def hwm():
    for ln in open("/proc/self/status"):
        if ln.startswith("VmHWM:"):
            return int(ln.split()[1]) * 1024
"""
# mlx_vlm's run of a published directory in a child process: its peak RSS above the imports
RUN = (
    """
import sys
from pathlib import Path
import mlx.core, mlx_lm, mlx_vlm  # noqa: F401
from buildkit.clients import speculative as spec
"""
    + HWM
    + """
d = Path(sys.argv[1])
base = hwm()
p = spec.SpeculativeParams()
tok = (d / "tokenizer.json").read_bytes()
prompts = spec.decode_prompts(tok, spec.prompt_ids(list(range(100, 400)), 4, p.prompt_tokens))
spec.run(d, prompts, 3, p)
print(hwm() - base)
"""
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_the_estimate_bounds_what_the_run_holds(tmp_path):
    """On a 200 MB model (64 experts of 512 x 512 in 4 layers), what mlx_vlm's run adds to
    the process is at most the estimate less its fixed overhead, and most of the model: the
    decision is made on a figure that is neither vacuous nor too small."""
    src = generate(
        tmp_path / "src", FixtureSpec(hidden=512, layers=4, experts=64, moe_intermediate=512)
    )
    p = Project(tmp_path / "p")
    out = p.out / "xl-mtp"
    # the build's own run is not measured here: skipped, then run below in a child of its own
    p.run(
        "build",
        "xl-mtp",
        "--source",
        str(src),
        "--out",
        str(out),
        env={**os.environ, spec.MEMORY_ENV: "0"},
    )
    need = spec.run_bytes(published_entries(out))
    got = subprocess.run([sys.executable, "-c", RUN, str(out)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-3000:]
    added = int(got.stdout.split()[-1])
    assert need["model_bytes"] / 2 < added <= need["needed_bytes"] - spec.RUN_OVERHEAD, (
        f"the run added {added / MB:.0f} MB; the model is {need['model_bytes'] / MB:.0f} MB, "
        f"the estimate {need['needed_bytes'] / MB:.0f} MB"
    )
