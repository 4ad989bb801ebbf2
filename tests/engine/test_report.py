"""A build's progress in a plain log (not a terminal): a line per step at most every so often."""

from __future__ import annotations

import io
import re

from buildkit.engine.report import Reporter
from buildkit.engine.step import Progress


def test_plain_progress_lines_say_counts_time_and_what_is_left():
    out = io.StringIO()
    r = Reporter(1, stream=out, every=0.0)
    p = Progress("sensitivity", r.update)
    p.start(4, "candidates")
    assert out.getvalue() == ""  # nothing counted yet: no rate to give
    p.advance(1)
    p.advance(2)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"  sensitivity: 3/4 candidates in \d+s, ~\d+s left at this rate", lines[1])


def test_plain_progress_is_rate_limited_and_quiet_when_asked():
    out = io.StringIO()
    p = Progress("calibrate", Reporter(1, stream=out, every=3600.0).update)
    p.start(10, "layers")
    for _ in range(10):
        p.advance(1)
    assert out.getvalue() == ""  # within the hour: no line
    quiet = io.StringIO()
    q = Progress("calibrate", Reporter(1, quiet=True, stream=quiet, every=0.0).update)
    q.start(2)
    q.advance(1)
    assert quiet.getvalue() == ""
