"""Bounded memory: a build streams tensors, so its peak RSS must not grow with the model.

The same fixture shapes are built at two depths (4 and 48 layers: every tensor the same
size, the model 8x larger). A build that holds the model -- the bf16 source, the
quantized output, or verify's float32 copies -- grows by a large fraction of the size
difference; a streaming build does not grow at all. Peak RSS is the child process's own
``ru_maxrss`` (``os.wait4``), so the test is independent of the machine's other load.
No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import Project

from buildkit.core import allocator
from buildkit.fixtures.generated import FixtureSpec, generate, tensor_plan

MB = 1 << 20
# Small tensors (the largest, an experts.gate_up_proj, is 4.2 MB) and many layers, so the
# model is ~90x its largest tensor, as the real checkpoint is (67 GB vs 1 GB), and whatever
# a build keeps per tensor is small next to what it would keep per model.
DIMS = dict(
    hidden=512,
    experts=8,
    moe_intermediate=256,
    shared_intermediate=128,
    vocab=2048,
    heads=4,
    kv_heads=2,
    head_dim=64,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_dim=64,
    linear_value_dim=64,
)


# The streaming build without publish's client checks (measured apart, below) and eval, which
# holds a whole model part by design (both models' embeddings and heads in float32, README,
# Limits). Publish takes no eval input, and the build targets publish.
NO_LOAD_CHECK = (
    'extends = "xl"\n[steps.publish.params]\nload_check = false\n'
    "[steps.publish.inputs]\neval = []\n"
)


def light_eval(project: Project) -> None:
    """The eval step on 64 tokens, not 1024: its memory is a layer either way, its time is not."""
    xl = project.manifests / "xl.toml"
    line = next(ln for ln in xl.read_text().splitlines() if ln.startswith("params.text"))
    if "params.max_tokens" not in xl.read_text():
        xl.write_text(xl.read_text().replace(line, line + "\nparams.max_tokens = 64"))


def peak_rss_of_build(project: Project, source, variant: str = "xl-stream") -> int:
    """Build in a child process; return its peak RSS in bytes."""
    project.write_manifest("xl-stream", NO_LOAD_CHECK)
    light_eval(project)
    argv = [
        sys.executable,
        "-m",
        "buildkit.cli",
        *project.args(
            "build",
            variant,
            "--source",
            str(source),
            "--out",
            str(project.out / variant),
            "-q",
            *(["--target", "publish"] if variant == "xl-stream" else []),
        ),
    ]
    log = project.root / f"build-{variant}.log"
    with open(log, "wb") as f:
        code, peak = child_peak_rss(argv, project.root, f)
    assert code == 0, f"buildkit build {variant} exited {code}:\n{log.read_text()[-3000:]}"
    return peak


# A child's ru_maxrss starts from the memory of the process it was forked from (Linux keeps the
# high-water mark across fork and exec), and pytest's process holds hundreds of MB by the end
# of the suite: the command runs as the grandchild of a fresh, small Python, which reports it.
LAUNCH = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss * 1024}")
"""


def child_peak_rss(argv: list[str], cwd: Path, out) -> tuple[int, int]:
    """Run ``argv`` with its output to ``out``; (exit code, its own peak RSS in bytes)."""
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "result"
        subprocess.run(
            [sys.executable, "-c", LAUNCH, str(result), *argv],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        code, peak = map(int, result.read_text().split())
    return code, peak


CHECK = """
import sys
from pathlib import Path
from buildkit.core import allocator
from buildkit.clients import loadcheck
allocator.tune()  # as a build process is
part, path = sys.argv[1], Path(sys.argv[2])
if part == "mlx_lm":
    loadcheck.check_loads(path)
else:
    loadcheck.check_vlm_loads(path)
"""
CHECKS = ("mlx_lm", "mlx_vlm") if importlib.util.find_spec("mlx_vlm") else ("mlx_lm",)
CHECK_TOKENS = {"mlx_lm": 1, "mlx_vlm": 32}  # the positions each check's logits cover


def peak_rss_of_check(published: Path, part: str) -> int:
    """Run one client check of a published model in a child process; its peak RSS in bytes."""
    with tempfile.TemporaryFile() as out:
        code, peak = child_peak_rss(
            [sys.executable, "-c", CHECK, part, str(published)], published.parent, out
        )
        out.seek(0)
        assert code == 0, out.read().decode()[-3000:]
    return peak


def model_facts(spec: FixtureSpec) -> tuple[int, int]:
    tensors = [t for t, _ in tensor_plan(spec)]
    return sum(t.nbytes for t in tensors), max(t.nbytes for t in tensors)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="ru_maxrss units and /proc are Linux's"
)
def test_peak_rss_does_not_grow_with_the_model(tmp_path):
    small, large = FixtureSpec(layers=4, **DIMS), FixtureSpec(layers=48, **DIMS)
    (small_bytes, largest), (large_bytes, largest_l) = model_facts(small), model_facts(large)
    assert largest == largest_l  # same tensor shapes, only more layers
    grown = large_bytes - small_bytes  # about 340 MB of bf16

    # publish's client checks are left out here (measured separately below, and against the
    # vocabulary in the next test).
    peaks, srcs = {}, {}
    for name, spec in (("small", small), ("large", large)):
        srcs[name] = generate(tmp_path / f"src-{name}", spec)
        peaks[name] = peak_rss_of_build(Project(tmp_path / name), srcs[name])
    growth = peaks["large"] - peaks["small"]

    # Holding the quantized output alone (about 7 bits per weight) adds ~0.3-0.4 x the size
    # difference, the bf16 source 1.0 x, verify's float32 copies 2.0 x; a streaming build
    # adds ~0.05 x (allocator and mlx buffer-cache noise). The line is drawn at 0.2 x (65 MB).
    assert growth < grown / 5, (
        f"peak RSS grew {growth / MB:.0f} MB when the model grew {grown / MB:.0f} MB "
        f"({peaks['small'] / MB:.0f} -> {peaks['large'] / MB:.0f} MB): something holds the model"
    )
    # Generous absolute bound (DESIGN: "a small multiple of the largest tensor"): three
    # tensors in flight, plus 600 MB for the interpreter, numpy, mlx and mlx_lm (about
    # 100 MB imported), numba and its LLVM (~130 MB once the compiled loops are loaded: the
    # search's and quantize's rel-L1) and mlx's buffer cache.
    bound = 3 * largest + 600 * MB
    assert peaks["large"] < bound, (
        f"peak RSS {peaks['large'] / MB:.0f} MB for a {large_bytes / MB:.0f} MB model exceeds "
        f"3 x largest tensor ({largest / MB:.1f} MB) + 600 MB = {bound / MB:.0f} MB"
    )

    # With the client checks and eval (which holds embeddings and heads), the extra memory is
    # at most about the published model's size on disk, never the bf16 source.
    checked = Project(tmp_path / "checked")
    with_check = peak_rss_of_build(checked, srcs["large"], "xl")
    published = sum(f.stat().st_size for f in (checked.out / "xl").glob("*.safetensors"))
    assert with_check - peaks["large"] < 1.2 * published + 64 * MB, (
        f"load check added {(with_check - peaks['large']) / MB:.0f} MB for a "
        f"{published / MB:.0f} MB published model"
    )


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="ru_maxrss units and /proc are Linux's"
)
def test_peak_rss_does_not_grow_with_the_largest_tensor(tmp_path):
    """The real embedding and lm_head are 1 GB each: quantize and verify stream a tensor in
    blocks of rows, and so do publish's client checks, so peak RSS must not follow the largest
    tensor either. Same model but for the vocabulary: embed_tokens and lm_head go from 32 MB to
    160 MB each (both many blocks)."""
    small, large = (
        FixtureSpec(layers=4, **{**DIMS, "vocab": 32768}),
        FixtureSpec(layers=4, **{**DIMS, "vocab": 163840}),
    )
    (_, largest_s), (_, largest_l) = model_facts(small), model_facts(large)
    peaks = {}
    for name, spec in (("small", small), ("large", large)):
        peaks[name] = peak_rss_of_build(
            Project(tmp_path / name), generate(tmp_path / f"src-{name}", spec)
        )
    growth = peaks["large"] - peaks["small"]
    checks = {
        name: {
            part: peak_rss_of_check(tmp_path / name / "out" / "xl-stream", part) for part in CHECKS
        }
        for name in peaks
    }
    # Quantizing a tensor whole holds its bf16 bytes and mlx's copy of them: 2 x the tensor
    # (measured: 2.0-2.05 x on real-size tensors), 4 x with both workers on one. In blocks,
    # what grows is verify's float32 scales and biases (1/16 of the tensor) and allocator
    # noise: 15-19 MB here (0.12-0.15 x). The line is drawn at 0.25 x (32 MB).
    assert growth < (largest_l - largest_s) / 4, (
        f"peak RSS grew {growth / MB:.0f} MB when the largest tensor grew from "
        f"{largest_s / MB:.0f} "
        f"to {largest_l / MB:.0f} MB ({peaks['small'] / MB:.0f} -> {peaks['large'] / MB:.0f} MB): "
        "something holds a whole tensor"
    )
    # publish's client checks stream too: the embedding by its tokens' rows, lm_head (bf16 here,
    # 2x in float32 on the CPU) in blocks. Holding lm_head whole grew the mlx_lm check 460 MB
    # (its bf16 bytes, their float32 copy, the embedding); streamed, both checks grew 17 MB.
    # What may grow is the logits (vocabulary x tokens in float32, twice while joined).
    for part in CHECKS:
        grew = checks["large"][part] - checks["small"][part]
        logits = 2 * 4 * CHECK_TOKENS[part] * (large.vocab - small.vocab)
        assert grew < (largest_l - largest_s) / 4 + logits, (
            f"the {part} check's peak RSS grew {grew / MB:.0f} MB when lm_head grew from "
            f"{largest_s / MB:.0f} to {largest_l / MB:.0f} MB "
            f"({checks['small'][part] / MB:.0f} -> {checks['large'][part] / MB:.0f} MB): "
            "it holds a vocabulary-sized tensor"
        )


MALLINFO = """
import ctypes, json, os, sys
import numpy as np

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "cli":
    from buildkit.cli.main import main
    assert main(sys.argv[2:]) == 0
a = np.ones(16 << 20, np.uint8)  # a block of rows: above glibc's initial 128 KiB threshold
mapped = libc.mallinfo2().hblkhd  # bytes in blocks served by mmap of their own
del a
print(json.dumps({"mapped": mapped, "kept": libc.mallinfo2().fordblks}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_build_process_keeps_freed_buffers_for_reuse(tmp_path):
    """A build's blocks come from malloc's heap and stay there once freed, for the next block,
    instead of each being mapped afresh and its pages faulted in (buildkit/core/allocator.py)."""
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc < 2.33: no mallinfo2 to look with")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}

    def child(*argv: str, **extra) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", MALLINFO, *argv],
            env={**env, **extra},
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])  # after what the command printed

    project = Project(tmp_path / "p")
    tuned = child("cli", *project.args("list"))  # any command: main tunes the process first
    assert tuned["mapped"] < 16 * MB, f"a 16 MB buffer was mmapped in a buildkit process: {tuned}"
    assert tuned["kept"] >= 16 * MB, f"a freed 16 MB buffer went back to the OS: {tuned}"
    # Without it (a plain process, or the user's own malloc settings), the same buffer is
    # mmapped and unmapped: the difference this test sees is the tuning.
    for plain in (
        child("plain"),
        child("cli", *project.args("list"), MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="131072"),
    ):
        assert plain["mapped"] >= 16 * MB and plain["kept"] < 16 * MB, plain


MLX_CACHE = """
import json, sys
from buildkit.cli.main import main
assert main(sys.argv[1:]) == 0
import mlx.core as mx
print(json.dumps({"cached": mx.get_cache_memory(), "limit": mx.set_cache_limit(1 << 30)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_build_process_keeps_no_second_reserve_in_mlx(tmp_path):
    """With malloc keeping freed buffers, mlx's own buffer cache is off in a build (it held
    ~30 MB of the peak on the bench fixture); without the tuning it stays, the only reserve."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}

    def child(name: str, **extra) -> dict:  # a cold build each, in a project of its own
        project = Project(tmp_path / name)
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                MLX_CACHE,
                *project.args("build", "xl", "--out", str(project.out)),
            ],
            env={**env, **extra},
            cwd=project.root,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    tuned = child("tuned")
    assert tuned == {"cached": 0, "limit": 0}, tuned
    plain = child(
        "plain", MALLOC_TRIM_THRESHOLD_="131072"
    )  # the user's malloc settings: tune stands aside
    assert plain["limit"] > 0, plain


def peak_rss_of_eval(source: Path, cwd: Path) -> int:
    """`buildkit eval` of a bf16 checkpoint against itself in a child process; its peak RSS."""
    argv = [sys.executable, "-m", "buildkit.cli", "eval", str(source), "--source", str(source)]
    with tempfile.TemporaryFile() as out:
        code, peak = child_peak_rss([*argv, "--max-tokens", "64", "--json"], cwd, out)
        out.seek(0)
        assert code == 0, out.read().decode()[-3000:]
    return peak


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="ru_maxrss units and /proc are Linux's"
)
def test_eval_peak_rss_does_not_hold_the_vocabulary(tmp_path):
    """eval reads the embedding for its tokens' rows and both models' lm_head in blocks of
    vocabulary rows (KL, top-1 and perplexity reduced block by block), so its peak RSS stays
    under one float32 copy of the head on a vocabulary where that copy is 400 MB. Holding the
    heads whole (float32, both models, and the embeddings) took it from 289 to 1088 MB here;
    streamed, 170 -> 178 MB."""
    small, large = (
        FixtureSpec(layers=4, **{**DIMS, "vocab": 32768}),
        FixtureSpec(layers=4, **{**DIMS, "vocab": 196608}),
    )
    f32 = {s.vocab: 4 * s.vocab * s.hidden for s in (small, large)}  # one whole float32 head
    peaks = {}
    try:
        for spec in (small, large):
            src = generate(tmp_path / f"src-{spec.vocab}", spec)
            peaks[spec.vocab] = peak_rss_of_eval(src, tmp_path)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    grew = peaks[large.vocab] - peaks[small.vocab]
    assert peaks[large.vocab] < f32[large.vocab], (
        f"eval's peak RSS {peaks[large.vocab] / MB:.0f} MB is above one float32 copy of the "
        f"{large.vocab} x {large.hidden} head ({f32[large.vocab] / MB:.0f} MB)"
    )
    assert grew < (f32[large.vocab] - f32[small.vocab]) / 8, (
        f"eval's peak RSS grew {grew / MB:.0f} MB when the vocabulary grew from {small.vocab} "
        f"to {large.vocab} ({peaks[small.vocab] / MB:.0f} -> {peaks[large.vocab] / MB:.0f} MB): "
        "it holds a vocabulary-sized tensor"
    )


CHURN = """
import threading
import numpy as np
from buildkit.core import allocator
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) << 10
assert allocator.tune()
base = rss()
both = threading.Barrier(2)
def work():  # a step's way: 12 MB buffers made on two threads at once, all freed at its end
    keep = [np.ones(3 << 20, np.float32) for _ in range(allocator.TRIM_THRESHOLD // (32 << 20))]
    both.wait()
threads = [threading.Thread(target=work) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
kept = rss()
allocator.release()
print(base, kept, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, /proc")
def test_release_hands_back_what_a_step_freed():
    """Between steps the scheduler calls ``allocator.release``: the buffers ``tune`` keeps for
    reuse within a step do not stay in the process for the next step's peak. With glibc's
    per-thread arenas they did, up to 64 MB an arena: ``malloc_trim`` does not shrink a thread
    arena's top (base, kept, after: 31, 178, 147 MB in one CI run)."""
    env = {k: v for k, v in os.environ.items() if k not in allocator.ENV}
    p = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    base, kept, after = map(int, p.stdout.split())
    assert kept - base > allocator.TRIM_THRESHOLD // 2, (base // MB, kept // MB)  # tune kept them
    assert after - base < 8 * MB, (base // MB, kept // MB, after // MB)
