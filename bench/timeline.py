"""Resident memory of a ``buildkit build`` over time, attributed to the steps running.

Runs the command, samples the child's VmRSS every few milliseconds and reads its
``[run]`` / ``[done]`` lines as they come, then prints each step's start, duration and
the peak RSS seen while it ran (with ``-j 2`` two steps can overlap; both are charged).

    python bench/timeline.py [--csv FILE] -- buildkit --store S build xl --source SRC
"""

from __future__ import annotations

import argparse
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
    samples: list[tuple[float, int, tuple[str, ...]]] = []
    running: set[str] = set()
    seen = 0
    while child.poll() is None:
        while seen < len(events):
            _, kind, step = events[seen]
            (running.add if kind == "run" else running.discard)(step)
            seen += 1
        samples.append((time.perf_counter() - t0, rss(child.pid), tuple(sorted(running))))
        time.sleep(args.interval)
    reader.join()
    wall = time.perf_counter() - t0

    steps: dict[str, dict] = {}
    for t, kind, step in events:
        s = steps.setdefault(step, {"start": t, "end": wall, "peak": 0})
        if kind == "done":
            s["end"] = t
    for _, r, run in samples:
        for step in run:
            steps[step]["peak"] = max(steps[step]["peak"], r)
    outside = max((r for _, r, run in samples if not run), default=0)
    print(f"\n{'step':12} {'start':>8} {'seconds':>8} {'peak RSS':>10}")
    for step, s in steps.items():
        print(f"{step:12} {s['start']:8.1f} {s['end'] - s['start']:8.1f} {s['peak'] / MB:8.0f} MB")
    print(f"{'(no step)':12} {'':8} {'':8} {outside / MB:8.0f} MB")
    print(
        f"{'(process)':12} {'':8} {wall:8.1f} {max((r for _, r, _ in samples), default=0) / MB:8.0f} MB"
    )
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("seconds,rss_mb,running\n")
            for t, r, run in samples:
                f.write(f"{t:.3f},{r / MB:.1f},{'+'.join(run)}\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
