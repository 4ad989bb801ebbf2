"""Execution: run the stale nodes of a plan, in parallel where independent, and record them.

Planning (keys, reasons) is ``plan.py``; progress on the terminal is ``report.py``. A node
runs under its key's lock, so a node shared by two concurrent builds runs once; its outputs
go to the store and its action record is written last, so a record never names a missing
artifact. A successful build records its nodes in the variant's ref (for rebuild reasons)
and in its request's root (what gc keeps).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, wait
from typing import NoReturn

from buildkit.core import allocator, keys, workers
from buildkit.core.errors import BuildkitError, StepError, StoreMiss, VerifyError
from buildkit.engine import step as plugin
from buildkit.engine.manifest import Manifest
from buildkit.engine.plan import (
    InputArtifacts,
    NodeState,
    Planner,
    action_key,
    ingredients,
    why_changed,
)
from buildkit.engine.report import Reporter
from buildkit.engine.step import BuildOptions, Context, Progress, resource
from buildkit.store.fsio import atomic_write
from buildkit.store.store import Store


class Scheduler(Planner):
    """Runs a plan: the stale nodes, in parallel where independent, each recorded as it ends."""

    def __init__(self, manifest: Manifest, store: Store, options: BuildOptions | None = None):
        super().__init__(manifest, store, options)
        self.executor = None  # a distributed.DaskExecutor while a --dask build runs

    def build(
        self, targets: list[str] | None = None, jobs: int = 2, quiet: bool = False
    ) -> list[NodeState]:
        """Run the stale nodes; independent nodes run in parallel on ``jobs`` threads.

        A store entry a step finds corrupt (or gone) is a miss: it has been removed (or, from
        a remote cache, refused), so the build runs again, which re-runs the steps that produced
        it. Each round loses at least one node's outputs, so rounds are at most the nodes.
        """
        self.check_request(targets)
        with self.store.in_use(), self._dask():
            for _ in range(len(self.selection(targets))):
                try:
                    return self._build(targets, jobs, quiet)
                except StoreMiss as e:
                    if not quiet:
                        print(f"buildkit: {e}; building again to restore it", file=sys.stderr)
            return self._build(targets, jobs, quiet)

    @contextlib.contextmanager
    def _dask(self):
        """Under ``--dask``, a client (and a cluster, for local:N) for this build; Dask is
        imported only then."""
        if not self.options.dask:
            yield
            return
        from buildkit.engine.distributed import DaskExecutor

        self.executor = DaskExecutor(self.options.dask, self.options.remote, self.store)
        try:
            yield
        finally:
            self.executor.close()
            self.executor = None

    def _build(self, targets: list[str] | None, jobs: int, quiet: bool) -> list[NodeState]:
        names = self.selection(targets)
        prev = self.previous()
        states = {n: NodeState(n, self.m.nodes[n].kind) for n in names}
        reporter = Reporter(len(names), quiet)
        remaining = set(names)
        rank = {n: i for i, n in enumerate(names)}
        done: set[str] = set()
        failures: list[tuple[str, BaseException]] = []
        running = {}
        t0 = time.monotonic()
        jobs = max(1, jobs)
        pool = workers.pool("nodes")
        try:
            while remaining or running:
                if not failures:
                    held = {resource(self.m.nodes[r].step) for r in running.values()}
                    # the longest chain first: a step that many wait on does not queue behind
                    # one few do for the same resource (oq's sensitivity before its reference)
                    ready = sorted(remaining, key=lambda n: (-self.topo.height[n], rank[n]))
                    for n in ready:
                        if len(running) >= jobs:
                            break
                        if resource(self.m.nodes[n].step) in held - {None}:
                            continue
                        if all(p in done for p in self.topo.preds[n] if p in states):
                            held.add(resource(self.m.nodes[n].step))
                            remaining.discard(n)
                            fut = pool.submit(
                                self._run_node, n, states, prev, reporter, workers=jobs
                            )
                            running[fut] = n
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    n = running.pop(fut)
                    exc = fut.exception()
                    if exc is not None:
                        failures.append((n, exc))
                    else:
                        done.add(n)
        finally:
            reporter.close()
        if failures:
            self._fail(*failures[0])
        self.record(states)
        ran = sum(s.ran for s in states.values())
        if not quiet:
            reporter.line(
                f"{self.m.name}: {len(states)} steps, {ran} ran, {len(states) - ran} cached "
                f"in {time.monotonic() - t0:.2f}s"
            )
        return list(states.values())

    def _fail(self, n: str, exc: BaseException) -> NoReturn:
        """Raises the first failed step's error, naming the step."""
        if isinstance(exc, VerifyError) and exc.report:
            exc = self._keep_report(n, exc)
        if isinstance(exc, BuildkitError):
            err = copy.copy(exc)  # the same class and fields, whatever its constructor takes
            err.args = (f"step {n!r} ({self.m.nodes[n].kind}) failed: {exc}",)
            raise err from exc
        if isinstance(exc, OSError):  # the disk or the OS said no: a clear message, no traceback
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            hint = (
                "; free space (or use --store/--out on another disk) and build again"
                if full
                else ""
            )
            raise StepError(f"step {n!r} ({self.m.nodes[n].kind}) failed: {exc}{hint}") from exc
        detail = "".join(traceback.format_exception(exc)).rstrip()
        raise StepError(
            f"step {n!r} ({self.m.nodes[n].kind}) failed with an internal error:\n{detail}"
        ) from exc

    def _run_node(
        self, name: str, states: dict[str, NodeState], prev: dict, reporter: Reporter
    ) -> None:
        node = self.m.nodes[name]
        st = states[name]
        ctx = self.context(
            name,
            Progress(name, reporter.update),
            lambda node, msg: reporter.line(f"  {node}: {msg}"),
        )
        ctx.executor = self.executor
        digests = self.input_digests(node, states)
        arts = InputArtifacts(self.store, digests)
        st.ingredients = ingredients(node, arts, ctx)
        st.key = action_key(st.ingredients)
        with self.store.lock(st.key):
            rec = self.lookup(st.key)
            if rec is not None:
                st.outputs = rec["outputs"]
                why = plugin.outdated(node.step, node.params, self.artifacts(st.outputs), ctx)
                if not why:
                    st.fresh = True
                    reporter.line(
                        f"[cached] {name} ({node.kind}) {keys.short(st.key)}"
                        + (" (remote)" if "remote" in rec else "")
                    )
                    return
                reasons = [why]
            else:
                reasons = why_changed(node, prev.get(name, {}).get("ingredients"), st.ingredients)
            reporter.line(f"[run]    {name} ({node.kind}): {'; '.join(reasons)}")
            st.reasons = reasons
            self._execute(st, ctx, digests, arts, reporter)

    def _execute(
        self, st: NodeState, ctx: Context, digests: dict, arts: InputArtifacts, reporter: Reporter
    ) -> None:
        """Runs a stale node's step and records its outputs under its key."""
        name = st.name
        node = self.m.nodes[name]
        t = time.monotonic()
        self.fetch_inputs(digests, name)
        inputs = dict(arts)
        ctx.fingerprint = st.ingredients["fingerprint"]
        ctx.key, ctx.libraries = st.key, st.ingredients["libraries"]
        allocator.tune_imported()  # an earlier step imported mlx: its buffer cache off
        try:
            outputs = node.step.run(ctx, node.params, inputs)
        finally:
            allocator.release()  # what the step freed goes back, not to the next step's peak
        if set(outputs) != set(node.step.outputs):
            raise StepError(
                f"returned outputs {sorted(outputs)}, expected {list(node.step.outputs)}"
            )
        st.outputs = {k: self.store.put_artifact(a) for k, a in sorted(outputs.items())}
        st.seconds = time.monotonic() - t
        st.stats = {
            "seconds": round(st.seconds, 3),
            "tensors": ctx.progress.done,
            "bytes": ctx.progress.bytes,
        }
        self.store.put_action(
            st.key,
            {
                "key": st.key,
                "outputs": st.outputs,
                "kind": node.kind,
                "node": name,
                "variant": self.m.name,
                "pid": os.getpid(),
                "stats": st.stats,
            },
        )
        st.ran = True
        reporter.finish_node(name)
        reporter.line(
            f"[done]   {name} ({node.kind}) {keys.short(st.key)} in {st.seconds:.2f}s"
            + (f", {ctx.progress.done} {ctx.progress.unit}" if ctx.progress.done else "")
        )

    def _keep_report(self, name: str, exc: VerifyError) -> VerifyError:
        """A failed verify's full report, kept where the user can read it."""
        path = (
            self.store.layout.reports
            / f"{self.m.name}.{name}.{keys.short(keys.blob_digest(exc.report))}.json"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, exc.report, self.store.layout.tmp)
        return VerifyError(f"{exc}. Full report: {path}", report=exc.report)

    def record(self, states: dict[str, NodeState]) -> None:
        nodes = dict((self.store.get_ref(self.m.name) or {}).get("nodes", {}))  # not the parent's
        for n, st in states.items():
            nodes[n] = {"key": st.key, "ingredients": st.ingredients, "outputs": st.outputs}
        nodes = {n: v for n, v in nodes.items() if n in self.m.nodes}
        self.store.set_ref(
            self.m.name, {"keys": {n: v["key"] for n, v in nodes.items()}, "nodes": nodes}
        )
        root = (self.store.get_root(self.request()) or {}).get("nodes", {})
        root.update({n: {"key": st.key, "ingredients": st.ingredients} for n, st in states.items()})
        self.store.set_root(self.request(), {n: v for n, v in root.items() if n in self.m.nodes})
