"""Resident memory of a ``buildkit build`` over time, attributed to the steps running.

Runs the command, samples the child's VmRSS and CPU time every few milliseconds and reads
its ``[run]`` / ``[done]`` lines as they come, then prints each step's start, duration, the
peak RSS seen while it ran and the cores the whole process used meanwhile (with ``-j 2``
two steps can overlap; both are charged).

    python bench/timeline.py [--csv FILE] -- buildkit --store S build xl --source SRC
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

MB = 1e6


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    p.add_argument("--csv", help="write every sample (seconds, rss_mb, running steps) here")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    events: list[tuple[float, str, str]] = []  # (seconds, "run"|"done", step)

    def read():
        for line in child.stderr:
            sys.stderr.write(line)
            m = re.match(r"^\[(run|done)\]\s+(\S+)", line)
            if m:
                events.append((time.perf_counter() - t0, m[1], m[2]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples: list[tuple[float, int, float, tuple[str, ...]]] = []
    running: set[str] = set()
    seen = 0
    while child.poll() is None:
        while seen < len(events):
            _, kind, step = events[seen]
            (running.add if kind == "run" else running.discard)(step)
            seen += 1
        samples.append(
            (time.perf_counter() - t0, rss(child.pid), cpu(child.pid), tuple(sorted(running)))
        )
        time.sleep(args.interval)
    reader.join()
    wall = time.perf_counter() - t0

    steps: dict[str, dict] = {}
    for t, kind, step in events:
        s = steps.setdefault(step, {"start": t, "end": wall, "peak": 0})
        if kind == "done":
            s["end"] = t
    for _, r, _, run in samples:
        for step in run:
            steps[step]["peak"] = max(steps[step]["peak"], r)

    def cores(a: float, b: float) -> float:
        """Mean cores the process used between seconds a and b (from the samples)."""
        inside = [(t, c) for t, _, c, _ in samples if a <= t <= b]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    outside = max((r for _, r, _, run in samples if not run), default=0)
    first = min((s["start"] for s in steps.values()), default=wall)
    print(f"\n{'step':12} {'start':>8} {'seconds':>8} {'peak RSS':>10} {'cores':>6}")
    print(f"{'(before)':12} {0:8.1f} {first:8.1f} {'':>10} {cores(0, first):6.2f}")
    for step, s in steps.items():
        print(
            f"{step:12} {s['start']:8.1f} {s['end'] - s['start']:8.1f} {s['peak'] / MB:7.0f} MB"
            f" {cores(s['start'], s['end']):6.2f}"
        )
    print(f"{'(no step)':12} {'':8} {'':8} {outside / MB:7.0f} MB")
    peak = max((r for _, r, _, _ in samples), default=0)
    print(f"{'(process)':12} {'':8} {wall:8.1f} {peak / MB:7.0f} MB {cores(0, wall):6.2f}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("seconds,rss_mb,cpu_seconds,running\n")
            for t, r, c, run in samples:
                f.write(f"{t:.3f},{r / MB:.1f},{c:.2f},{'+'.join(run)}\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
