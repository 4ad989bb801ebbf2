"""Teacher-forced drafting within memory (issue 41): the MTP head's chain of drafts streams its
experts as the trunk's layers do, never widening the head's expert stack whole (3.2 GB of
float32 at the real model's size). Measured as the child process's own peak RSS; no timing."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from buildkit.fixtures.generated import FixtureSpec, generate

MB = 1 << 20
# 64 experts of 512 x 512: the head's experts are 96 MB of bf16, 192 MB once widened; every
# other tensor is small beside them
SPEC = FixtureSpec(
    hidden=512, layers=2, experts=64, moe_intermediate=512, vocab=1024, full_attention_interval=2
)
HEAD_EXPERTS_F32 = 64 * 3 * 512 * 512 * 4

CHILD = """
import sys
import numpy as np
from buildkit.grade import drafting, evaluate as ev
from buildkit.grade.weights import DirWeights
def hwm():  # VmHWM starts afresh at exec, where ru_maxrss keeps the parent's
    for ln in open("/proc/self/status"):
        if ln.startswith("VmHWM:"):
            return int(ln.split()[1]) * 1024
src = DirWeights(sys.argv[1])
if sys.argv[2] == "whole":  # the head loaded whole, as drafting did before
    ev.streamed_head = ev.load_head
tokens = np.random.default_rng(0).integers(0, 1024, 256).tolist()
_, (ts, _) = ev.evaluate(src, src, tokens, 128, head=False)
before = hwm()
drafting.chains(src, ts, 2)
after = hwm()
print(before, after)
"""


def growth(source: Path, mode: str) -> int:
    """Peak RSS the drafting chain adds above the trunk pass's own peak, in a child process."""
    import subprocess

    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), mode], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-3000:]
    before, after = map(int, p.stdout.split())
    return after - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_drafting_streams_the_heads_experts():
    with tempfile.TemporaryDirectory() as d:
        source = generate(Path(d) / "src", SPEC)
        streamed = growth(source, "streamed")
        whole = growth(source, "whole")
    # loaded whole, the chain holds the widened expert stack above the trunk pass's peak
    assert whole > HEAD_EXPERTS_F32 / 2, (whole / MB, streamed / MB)
    assert streamed < HEAD_EXPERTS_F32 / 4, (
        f"drafting added {streamed / MB:.0f} MB above the trunk pass "
        f"(the head's experts widened: {HEAD_EXPERTS_F32 / MB:.0f} MB)"
    )
