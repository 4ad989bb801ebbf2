"""Plan (what is stale and why) and execute (only the stale nodes, in parallel where independent).

A node's cache key is the xxh3-128 of canonical JSON over its kind, step
version, params (defaults filled in), the digests of its input artifacts, the
versions of libraries that change its bytes, and a step-specific fingerprint
(e.g. the digests of source files). A key found in the store's action cache is
a hit. The ingredients of the last build of each node are kept in the store's
refs so that every rebuild can say why.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import graph as graphs
from . import keys, lazy, workers
from .errors import BuildkitError, StepError, StoreMiss
from .manifest import Manifest, Node
from .steps.base import BuildOptions, Context, Progress
from .store import Store

UNKNOWN = "(pending)"
# A step about to hash this much new content (a new source) starts the imports a new model
# needs (``Step.imports_if_new``) meanwhile: the hash waits on the disk, a core is free, and a
# gigabyte takes about as long to hash as the slowest import (mlx_lm, ~1 s). Below that the
# import would outlast the hash, and a build of a copied or touched source, which turns out to
# hold bytes already built, would wait for an import it does not use.
WARM_NEW_BYTES = 1 << 30


class Cancelled(Exception):
    """A node that started early (see ``Slot.gate``) whose gate input failed: not a failure of its own."""


@dataclass
class NodeState:
    name: str
    kind: str
    key: str | None = None
    fresh: bool = False
    reasons: list[str] = field(default_factory=list)
    ingredients: dict | None = None
    outputs: dict[str, str] = field(default_factory=dict)
    ran: bool = False
    seconds: float = 0.0  # running, including work done ahead of its gates
    early: float = 0.0  # of which ahead of its gates (Slot.gate), overlapping them
    stats: dict = field(default_factory=dict)


def ingredients(node: Node, inputs: dict[str, list[str]], ctx: Context) -> dict:
    """Everything that can change the node's output bytes, and nothing else."""
    step = node.step
    params = step.key_params(node.params)
    # A fingerprint may materialize its subject (a generated fixture, a hub download): two
    # processes fingerprinting the same thing take turns, or they race to create it.
    with ctx.store.lock(keys.digest_json("fingerprint", [node.kind, step.version, params])):
        fingerprint = step.fingerprint(node.params, ctx)
    return {
        "kind": node.kind,
        "version": step.version,
        "params": params,
        "inputs": inputs,
        "libraries": step.libraries(),
        "fingerprint": fingerprint,
    }


def action_key(ingr: dict) -> str:
    return keys.digest_json("action", ingr)


def _flat(prefix: str, v, out: dict) -> dict:
    if isinstance(v, dict) and v:
        for k in sorted(v):
            _flat(f"{prefix}.{k}" if prefix else str(k), v[k], out)
    else:
        out[prefix] = v
    return out


def _fmt(v) -> str:
    s = repr(v) if not isinstance(v, str) else v
    return s if len(s) <= 40 else s[:37] + "..."


def why_changed(node: Node, old: dict | None, new: dict) -> list[str]:
    """Human-readable reasons the ingredients changed since the last build."""
    if old is None:
        return ["never built"]
    reasons = []
    if old.get("version") != new["version"]:
        reasons.append(f"step version changed {old.get('version')}→{new['version']}")
    a, b = _flat("params", old.get("params", {}), {}), _flat("params", new["params"], {})
    for k in sorted(set(a) | set(b)):
        if a.get(k, UNKNOWN) != b.get(k, UNKNOWN):
            reasons.append(f"{k} changed {_fmt(a.get(k, '(unset)'))}→{_fmt(b.get(k, '(unset)'))}")
    for slot in sorted(set(old.get("inputs", {})) | set(new["inputs"])):
        if old.get("inputs", {}).get(slot) != new["inputs"].get(slot):
            src = ", ".join(map(str, node.inputs.get(slot, [])))
            reasons.append(f"input {slot} ({src}) changed")
    for lib in sorted(set(old.get("libraries", {})) | set(new["libraries"])):
        o, n = old.get("libraries", {}).get(lib), new["libraries"].get(lib)
        if o != n:
            reasons.append(f"library {lib} changed {o}→{n}")
    if old.get("fingerprint") != new["fingerprint"]:
        reasons.append("source changed: " + node.step.describe_fingerprint_change(old.get("fingerprint"), new["fingerprint"]))
    return reasons or ["output missing from the store (collected or corrupt)"]


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
                TextColumn("{task.completed}/{task.total} tensors"),
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
                self.tasks[p.node] = self.rich.add_task(p.node, total=p.total or None, mb=0.0)
            self.rich.update(self.tasks[p.node], completed=p.done, total=p.total or None, mb=p.bytes / 1e6)

    def finish_node(self, name: str) -> None:
        if self.rich and name in self.tasks:
            with self.lock:
                self.rich.remove_task(self.tasks.pop(name))

    def close(self) -> None:
        if self.rich:
            self.rich.stop()


class Scheduler:
    def __init__(self, manifest: Manifest, store: Store, options: BuildOptions | None = None):
        self.m = manifest
        self.store = store
        self.options = options or BuildOptions()
        self.topo = graphs.topology(manifest, (store.get_ref(manifest.name) or {}).get("topology"))
        self.order = self.topo.order
        self._warm_lock = threading.Lock()

    def _ctx(self, name: str, reporter: Reporter | None = None) -> Context:
        prog = Progress(name, reporter.update if reporter else None)
        return Context(
            self.store,
            name,
            self.m.name,
            self.options,
            prog,
            (lambda node, msg: reporter.line(f"  {node}: {msg}")) if reporter else None,
        )

    def _previous(self) -> dict:
        """Last built ingredients per node: this variant's, else its nearest parent's."""
        nodes: dict = {}
        for file in reversed(self.m.chain):  # root parent first, this variant last
            nodes.update((self.store.get_ref(Path(file).stem) or {}).get("nodes", {}))
        return nodes

    def _input_digests(self, node: Node, states: dict[str, NodeState], gates: bool = True) -> dict[str, list[str]] | None:
        out = {}
        for slot, refs in node.inputs.items():
            if not gates and node.step.inputs[slot].gate:
                continue
            ds = []
            for r in refs:
                st = states[r.node]
                if r.output not in st.outputs:
                    return None
                ds.append(st.outputs[r.output])
            out[slot] = ds
        return out

    def plan(self, targets: list[str] | None = None) -> list[NodeState]:
        """Every node (or the targets and their dependencies) as fresh or stale, with reasons."""
        prev = self._previous()
        states: dict[str, NodeState] = {}
        for name in self._selection(targets):
            node = self.m.nodes[name]
            st = states[name] = NodeState(name, node.kind)
            digests = self._input_digests(node, states)
            if digests is None:
                stale = [str(r) for refs in node.inputs.values() for r in refs if not states[r.node].fresh]
                st.reasons = [f"input {', '.join(stale)} will be rebuilt first"]
                continue
            ctx = self._ctx(name)
            st.ingredients = ingredients(node, digests, ctx)
            st.key = action_key(st.ingredients)
            rec = self.store.get_action(st.key)
            if rec is None:
                st.reasons = why_changed(node, prev.get(name, {}).get("ingredients"), st.ingredients)
                continue
            st.outputs = rec["outputs"]
            outdated = node.step.outdated(node.params, self._artifacts(st.outputs), ctx)
            if outdated:
                st.reasons = [outdated]
                continue
            st.fresh = True
        return list(states.values())

    def _artifacts(self, outputs: dict[str, str]):
        return {k: self.store.get_artifact(d) for k, d in outputs.items()}

    def _selection(self, targets: list[str] | None) -> list[str]:
        if not targets:
            return self.order
        for t in targets:
            if t not in self.m.nodes:
                from .errors import UsageError, did_you_mean

                raise UsageError(f"{self.m.name} has no step {t!r}{did_you_mean(t, self.m.nodes)}")
        want = set(targets)
        for t in targets:
            want.update(self.topo.ancestors[t])
        return [n for n in self.order if n in want]

    def explain(self, name: str) -> dict:
        states = {s.name: s for s in self.plan([name])}
        st = states[name]
        return {
            "node": name,
            "kind": st.kind,
            "key": st.key,
            "fresh": st.fresh,
            "reasons": st.reasons,
            "ingredients": st.ingredients,
            "inputs": {
                slot: [str(r) for r in refs] for slot, refs in self.m.nodes[name].inputs.items()
            },
        }

    def build(self, targets: list[str] | None = None, jobs: int = 2, quiet: bool = False) -> list[NodeState]:
        """Run the stale nodes; independent nodes run in parallel on ``jobs`` threads.

        A store entry a step finds corrupt (or gone) is a miss: it has been removed, so the
        build runs once more, which re-runs the steps that produced it.
        """
        with self.store.in_use():
            try:
                return self._build(targets, jobs, quiet)
            except StoreMiss as e:
                if not quiet:
                    print(f"buildkit: {e}; building again to restore it", file=sys.stderr)
                return self._build(targets, jobs, quiet)

    def _build(self, targets: list[str] | None, jobs: int, quiet: bool) -> list[NodeState]:
        names = self._selection(targets)
        prev = self._previous()
        states = {n: NodeState(n, self.m.nodes[n].kind) for n in names}
        reporter = Reporter(len(names), quiet)
        remaining = set(names)
        done: set[str] = set()
        failures: list[tuple[str, BaseException]] = []
        running = {}
        self._ended = {n: threading.Event() for n in names}
        self._warming: dict[str, Future] = {}
        t0 = time.monotonic()
        jobs = max(1, jobs)
        pool = workers.pool("nodes")
        try:
            while remaining or running:
                if not failures:
                    for n in [n for n in names if n in remaining]:
                        if len(running) >= jobs:
                            break
                        if self._startable(n, states, done, set(running.values())):
                            remaining.discard(n)
                            fut = pool.submit(self._run_node_once, n, states, prev, reporter, workers=jobs)
                            running[fut] = n
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    n = running.pop(fut)
                    exc = fut.exception()
                    if isinstance(exc, Cancelled):
                        continue
                    if exc is not None:
                        failures.append((n, exc))
                    else:
                        done.add(n)
        finally:
            reporter.close()
            wait(self._warming.values())  # no import may still run when the process exits
        if failures:
            n, exc = failures[0]
            if isinstance(exc, BuildkitError):
                err = type(exc)(f"step {n!r} ({self.m.nodes[n].kind}) failed: {exc}")
                err.exit_code = exc.exit_code
                raise err from exc
            if isinstance(exc, OSError):  # the disk or the OS said no: a clear message, no traceback
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                hint = "; free space (or use --store/--out on another disk) and build again" if full else ""
                raise StepError(f"step {n!r} ({self.m.nodes[n].kind}) failed: {exc}{hint}") from exc
            detail = "".join(traceback.format_exception(exc)).rstrip()
            raise StepError(f"step {n!r} ({self.m.nodes[n].kind}) failed with an internal error:\n{detail}") from exc
        self._record(states)
        ran = sum(s.ran for s in states.values())
        if not quiet:
            reporter.line(
                f"{self.m.name}: {len(states)} steps, {ran} ran, {len(states) - ran} cached "
                f"in {time.monotonic() - t0:.2f}s"
            )
        return list(states.values())

    def _gates(self, name: str, states: dict) -> set[str]:
        """Producers this node may start without (they feed only its gate slots), if it can."""
        node = self.m.nodes[name]
        if node.step.prepare is None:
            return set()
        gate, other = set(), set()
        for slot, refs in node.inputs.items():
            (gate if node.step.inputs[slot].gate else other).update(r.node for r in refs if r.node in states)
        return gate - other

    def _startable(self, name: str, states: dict, done: set[str], running: set[str]) -> bool:
        gates = self._gates(name, states)
        preds = [p for p in self.topo.preds[name] if p in states]
        return all(p in done or (p in gates and p in running) for p in preds)

    def _run_node_once(self, name: str, states: dict[str, NodeState], prev: dict, reporter: Reporter) -> None:
        try:
            self._run_node(name, states, prev, reporter)
        finally:
            self._ended[name].set()

    def _prepare_early(self, name: str, states: dict, prev: dict, reporter: Reporter, ctx: Context):
        """Start a node whose gate producers still run, if it will surely run; wait for them."""
        node = self.m.nodes[name]
        waiting = sorted(g for g in self._gates(name, states) if not self._ended[g].is_set())
        if not waiting:
            return None
        known = self._input_digests(node, states, gates=False)
        old = (prev.get(name, {}).get("ingredients") or {}).get("inputs")
        prepared = failed = None
        if old is None or any(old.get(slot) != ds for slot, ds in known.items()):  # its key will be new
            reporter.line(f"[start]  {name} ({node.kind}): ahead of {', '.join(waiting)}")
            inputs = {slot: [self.store.get_artifact(d) for d in ds] for slot, ds in known.items()}
            t = time.monotonic()
            try:
                prepared = node.step.prepare(ctx, node.params, inputs)
            except Exception as e:  # reported only if the gates pass: theirs is the first error
                failed = e
            states[name].early = time.monotonic() - t
        try:
            for g in waiting:
                self._ended[g].wait()
        except BaseException:
            node.step.discard(prepared)
            raise
        if self._input_digests(node, states) is None:  # a gate producer failed
            node.step.discard(prepared)
            raise Cancelled(name)
        if failed is not None:
            raise failed
        return prepared

    def _run_node(self, name: str, states: dict[str, NodeState], prev: dict, reporter: Reporter) -> None:
        node = self.m.nodes[name]
        st = states[name]
        ctx = self._ctx(name, reporter)
        ctx.on_new_content = functools.partial(self._new_content, name, states)
        prepared = self._prepare_early(name, states, prev, reporter, ctx)
        try:
            self._run_ready(node, st, states, prev, reporter, ctx, prepared)
        except BaseException:
            if ctx.prepared is None:  # not handed to run, which cleans up after itself
                node.step.discard(prepared)
            raise

    def _run_ready(self, node: Node, st: NodeState, states: dict, prev: dict, reporter: Reporter, ctx: Context, prepared) -> None:
        name = node.name
        digests = self._input_digests(node, states)
        assert digests is not None, name
        if name not in prev:  # never built: it will run, after its key (a cold source is hashed)
            self._warm({name, *self.topo.descendants[name]}, states)
        st.ingredients = ingredients(node, digests, ctx)
        st.key = action_key(st.ingredients)
        with self.store.lock(st.key):
            rec = self.store.get_action(st.key)
            if rec is not None:
                st.outputs = rec["outputs"]
                why = node.step.outdated(node.params, self._artifacts(st.outputs), ctx)
                if not why:
                    st.fresh = True
                    node.step.discard(prepared)
                    reporter.line(f"[cached] {name} ({node.kind}) {keys.short(st.key)}")
                    return
                reasons = [why]
            else:
                reasons = why_changed(node, prev.get(name, {}).get("ingredients"), st.ingredients)
            reporter.line(f"[run]    {name} ({node.kind}): {'; '.join(reasons)}")
            st.reasons = reasons
            t = time.monotonic()
            inputs = {
                slot: [self.store.get_artifact(d) for d in ds] for slot, ds in digests.items()
            }
            ctx.prepared = prepared
            ctx.fingerprint = st.ingredients["fingerprint"]
            self._warm(set(self.topo.descendants[name]), states)
            outputs = node.step.run(ctx, node.params, inputs)
            if set(outputs) != set(node.step.outputs):
                raise StepError(f"returned outputs {sorted(outputs)}, expected {list(node.step.outputs)}")
            st.outputs = {k: self.store.put_artifact(a) for k, a in sorted(outputs.items())}
            st.seconds = time.monotonic() - t + st.early
            st.stats = {
                "seconds": round(st.seconds, 3),
                "early_seconds": round(st.early, 3),
                "tensors": ctx.progress.done,
                "bytes": ctx.progress.bytes,
            }
            self.store.put_action(
                st.key,
                {"key": st.key, "outputs": st.outputs, "kind": node.kind, "node": name,
                 "variant": self.m.name, "pid": os.getpid(), "stats": st.stats},
            )
            st.ran = True
            reporter.finish_node(name)
            reporter.line(
                f"[done]   {name} ({node.kind}) {keys.short(st.key)} in {st.seconds:.2f}s"
                + (f" ({st.early:.2f}s of it alongside {', '.join(sorted(self._gates(name, states)))})" if st.early else "")
                + (f", {ctx.progress.done} tensors" if ctx.progress.done else "")
            )

    def watched(self, states: list[NodeState]) -> tuple[list[Path], list[Path]] | None:
        """The files whose stat vouches for this build (``uptodate.py``): inputs (the manifest
        chain, what steps read outside the store) and outputs (what steps wrote, and the store
        records and objects of every node), or None if some step cannot say."""
        inputs, outputs = [Path(f) for f in self.m.chain], []
        for st in states:
            node = self.m.nodes[st.name]
            files = node.step.watch(node.params, self._ctx(st.name))
            if files is None:
                return None
            inputs += files[0]
            outputs += files[1]
        outputs += self.store.record_files(
            [st.key for st in states], [d for st in states for d in st.outputs.values()]
        )
        return [p.absolute() for p in inputs], [p.absolute() for p in outputs]

    def _new_content(self, name: str, states: dict, nbytes: int) -> None:
        """``name`` is about to hash ``nbytes`` the store has never seen (``Context.new_content``)."""
        if nbytes >= WARM_NEW_BYTES:
            self._warm(set(self.topo.descendants[name]), states, new=True)

    def _warm(self, nodes: set[str], states: dict, new: bool = False) -> None:
        """Nodes that will run: import what they need (``Step.imports``; if they will build from
        new content, ``Step.imports_if_new`` too) on a spare thread meanwhile, so a slow import
        is not paid on the critical path later."""
        mods = []
        for n in self.order:
            if n in nodes and n in states:
                node = self.m.nodes[n]
                mods += [*node.step.imports, *(node.step.imports_if_new(node.params) if new else ())]
        with self._warm_lock:
            todo = [m for m in dict.fromkeys(mods) if m not in self._warming]
            if todo:
                fut = lazy.import_ahead(todo)
                self._warming.update(dict.fromkeys(todo, fut))

    def _record(self, states: dict[str, NodeState]) -> None:
        nodes = dict((self.store.get_ref(self.m.name) or {}).get("nodes", {}))  # not the parent's
        for n, st in states.items():
            nodes[n] = {"key": st.key, "ingredients": st.ingredients, "outputs": st.outputs}
        nodes = {n: v for n, v in nodes.items() if n in self.m.nodes}
        self.store.set_ref(
            self.m.name,
            {"keys": {n: v["key"] for n, v in nodes.items()}, "nodes": nodes, "topology": asdict(self.topo)},
        )
