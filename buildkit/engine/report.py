"""Reporting a build as it runs: progress bars on a terminal (rich), plain lines otherwise."""

from __future__ import annotations

import os
import sys
import threading

from buildkit.engine.step import Progress


class Reporter:
    """Progress on a terminal (rich), plain lines otherwise."""

    def __init__(self, total: int, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.total = total
        self.lock = threading.Lock()
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

    def finish_node(self, name: str) -> None:
        if self.rich and name in self.tasks:
            with self.lock:
                self.rich.remove_task(self.tasks.pop(name))

    def close(self) -> None:
        if self.rich:
            self.rich.stop()
