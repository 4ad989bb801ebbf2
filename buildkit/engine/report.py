"""Reporting a build as it runs: progress bars on a terminal (rich), plain lines otherwise."""

from __future__ import annotations

import os
import sys
import threading
import time

from buildkit.engine.step import Progress

# a plain log (CI, a file, a pipe) gets a step's progress as a line at most this often: a
# 35B sensitivity runs an hour, and a log silent for an hour looks hung
PLAIN_EVERY = 60.0


class Reporter:
    """Progress on a terminal (rich), plain lines otherwise."""

    def __init__(self, total: int, quiet: bool = False, stream=None, every: float = PLAIN_EVERY):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.total = total
        self.lock = threading.Lock()
        self.every = every
        self.seen: dict[str, list[float]] = {}  # node -> [its first count's time, last line's]
        self.rich = None
        if not quiet and self.stream.isatty() and os.environ.get("TERM") != "dumb":
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RP

            self.rich = RP(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} {task.fields[unit]}"),
                TextColumn("{task.fields[mb]:,.1f} MB"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self.tasks: dict[str, int] = {}
            self.rich.start()

    def line(self, msg: str) -> None:
        if self.quiet:
            return
        with self.lock:
            if self.rich:
                self.rich.console.print(msg, highlight=False, markup=False)
            else:
                print(msg, file=self.stream, flush=True)

    def update(self, p: Progress) -> None:
        if not self.rich:
            self.plain(p)
            return
        with self.lock:
            if p.node not in self.tasks:
                self.tasks[p.node] = self.rich.add_task(
                    p.node, total=p.total or None, mb=0.0, unit=p.unit
                )
            self.rich.update(
                self.tasks[p.node],
                completed=p.done,
                total=p.total or None,
                mb=p.bytes / 1e6,
                unit=p.unit,
            )

    def plain(self, p: Progress) -> None:
        """A line of ``p``'s counts, its time so far and what is left at that rate, once
        ``every`` seconds have passed since the step's first count or its last line."""
        now = time.monotonic()
        with self.lock:
            if not p.done:  # a (re)start: its rate counts from here
                self.seen[p.node] = [now, now]
                return
            t0, last = self.seen.setdefault(p.node, [now, now])
            if self.quiet or now - last < self.every or not p.total:
                return
            self.seen[p.node][1] = now
            left = (now - t0) / p.done * (p.total - p.done)
            print(
                f"  {p.node}: {p.done}/{p.total} {p.unit} in {now - t0:.0f}s, "
                f"~{left:.0f}s left at this rate",
                file=self.stream,
                flush=True,
            )

    def finish_node(self, name: str) -> None:
        if self.rich and name in self.tasks:
            with self.lock:
                self.rich.remove_task(self.tasks.pop(name))

    def close(self) -> None:
        if self.rich:
            self.rich.stop()
