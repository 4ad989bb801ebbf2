"""Planning: each node's key ingredients, its cache key, fresh or stale, and why.

A node's cache key is the xxh3-128 of canonical JSON over its kind, step version, params as
they enter the key (``Params.key_params``), the digests
of its input artifacts, the versions of libraries that change its bytes, and a step-specific
fingerprint (the digests of source files). A key found in the store's action cache is a hit
(else in the remote cache, if one is configured: ``Planner.lookup``, ``remote.py``).
The ingredients of the last build of each node are kept (the variant's ref, and each build
request's root) so that every rebuild can say why. Nothing here runs a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from buildkit.core import keys
from buildkit.core.errors import UsageError, did_you_mean
from buildkit.engine import graph as graphs
from buildkit.engine import step as plugin
from buildkit.engine.manifest import Manifest, Node
from buildkit.engine.step import BuildOptions, ChecksRequest, Context, Progress
from buildkit.store.store import Store


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


UNKNOWN = _Unset()  # a value one side of a comparison lacks
MANY = ("params.plan.tensors.",)  # tables whose entries are reported together
MISSING = "output missing from the store (collected or corrupt)"


@dataclass
class NodeState:
    name: str
    kind: str
    key: str | None = None
    fresh: bool = False
    reasons: list[str] = field(default_factory=list)
    waits_for: list[str] = field(default_factory=list)  # stale producers its key depends on
    ingredients: dict | None = None
    outputs: dict[str, str] = field(default_factory=dict)
    ran: bool = False
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)


class InputArtifacts(Mapping):
    """A node's input artifacts by slot, each slot's listings read (and checked against their
    digests) once, when first asked for: the key (``Params.key_params``) and ``run`` share them."""

    def __init__(self, store: Store, digests: dict[str, list[str]]):
        self.store, self.digests, self._read = store, digests, {}

    def __getitem__(self, slot: str) -> list:
        if slot not in self._read:
            self._read[slot] = [self.store.get_artifact(d) for d in self.digests[slot]]
        return self._read[slot]

    def __iter__(self):
        return iter(self.digests)

    def __len__(self) -> int:
        return len(self.digests)


def ingredients(node: Node, inputs: InputArtifacts, ctx: Context) -> dict:
    """Everything that can change the node's output bytes, and nothing else."""
    step = node.step
    params = node.params.key_params(inputs)
    # A fingerprint may materialize its subject (a generated fixture, a hub download): two
    # processes fingerprinting the same thing take turns, or they race to create it.
    with ctx.store.lock(keys.digest_json("fingerprint", [node.kind, step.version, params])):
        fingerprint = plugin.fingerprint(step, node.params, ctx)
    return {
        "kind": node.kind,
        "version": step.version,
        "params": params,
        "inputs": inputs.digests,
        "libraries": step.libraries(),
        "fingerprint": fingerprint,
    }


def action_key(ingr: dict) -> str:
    return keys.digest_json("action", ingr)


def _diff(prefix: str, a, b, out: list) -> list:
    """(path, old, new) for each difference; a table one side lacks is one entry, not one per
    field."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k, UNKNOWN) != b.get(k, UNKNOWN):
                _diff(f"{prefix}.{k}", a.get(k, UNKNOWN), b.get(k, UNKNOWN), out)
    else:
        out.append((prefix, a, b))
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
    by_table: dict[str, list[str]] = {}  # a table of many entries (a plan's tensors) in one line
    for path, was, now in _diff("params", old.get("params", {}), new["params"], []):
        change = (
            f"added {_fmt(now)}"
            if was is UNKNOWN
            else f"removed (was {_fmt(was)})"
            if now is UNKNOWN
            else f"changed {_fmt(was)}→{_fmt(now)}"
        )
        table = next((m[:-1] for m in MANY if path.startswith(m)), None)
        if table is None:
            reasons.append(f"{path} {change}")
        else:
            by_table.setdefault(table, []).append(
                f"{path.removeprefix(table + '.')} {_fmt(was)}→{_fmt(now)}"
            )
    for table, changes in by_table.items():
        more = f", and {len(changes) - 3} more" if len(changes) > 3 else ""
        reasons.append(f"{table}: {len(changes)} changed ({', '.join(changes[:3])}{more})")
    changed: dict[str, list[str]] = {}  # producer -> the slots it feeds whose digests changed
    for slot in sorted(set(old.get("inputs", {})) | set(new["inputs"])):
        was, now = old.get("inputs", {}).get(slot), new["inputs"].get(slot)
        if was == now:
            continue
        refs = [str(r) for r in node.inputs.get(slot, [])]
        if isinstance(was, list) and isinstance(now, list) and len(was) == len(now) == len(refs):
            names = [r for r, a, b in zip(refs, was, now) if a != b]
        else:
            names = refs or [slot]
        for r in names:
            changed.setdefault(r, []).append(slot)
    for r, slots in changed.items():
        reasons.append(f"input {r} changed (slot {', '.join(slots)})")
    for lib in sorted(set(old.get("libraries", {})) | set(new["libraries"])):
        o, n = old.get("libraries", {}).get(lib), new["libraries"].get(lib)
        if o != n:
            reasons.append(f"library {lib} changed {o}→{n}")
    if old.get("fingerprint") != new["fingerprint"]:
        reasons.append(
            "source changed: "
            + plugin.describe_fingerprint_change(
                node.step, old.get("fingerprint"), new["fingerprint"]
            )
        )
    return reasons or [MISSING]


class Planner:
    """A manifest's nodes against a store: keys, fresh or stale, reasons, explanations."""

    def __init__(self, manifest: Manifest, store: Store, options: BuildOptions | None = None):
        self.m = manifest
        self.store = store
        self.options = options or BuildOptions()
        self.topo = graphs.topology(manifest)
        self.order = self.topo.order

    def request(self) -> dict:
        """This build request, as gc keeps it: the variant, its source and where it publishes."""
        out = self.options.out_dir
        return {"variant": self.m.name, "source": self.m.source, "out": str(out) if out else None}

    def context(self, name: str, progress: Progress | None = None, log_sink=None) -> Context:
        return Context(
            self.store, name, self.m.name, self.options, progress or Progress(name), log_sink
        )

    def previous(self) -> dict:
        """Last built ingredients per node: this request's, else this variant's, else its
        nearest parent's."""
        nodes: dict = {}
        for file in reversed(self.m.chain):  # root parent first, this variant last
            nodes.update((self.store.get_ref(Path(file).stem) or {}).get("nodes", {}))
        nodes.update((self.store.get_root(self.request()) or {}).get("nodes", {}))
        return nodes

    def input_digests(
        self, node: Node, states: dict[str, NodeState]
    ) -> dict[str, list[str]] | None:
        out = {}
        for slot, refs in node.inputs.items():
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
        prev = self.previous()
        states: dict[str, NodeState] = {}
        for name in self.selection(targets):
            node = self.m.nodes[name]
            st = states[name] = NodeState(name, node.kind)
            digests = self.input_digests(node, states)
            if digests is None:
                st.waits_for = list(
                    dict.fromkeys(
                        r.node
                        for refs in node.inputs.values()
                        for r in refs
                        if not states[r.node].fresh
                    )
                )
                st.reasons = [f"input {', '.join(st.waits_for)} will be rebuilt first"]
                continue
            ctx = self.context(name)
            st.ingredients = ingredients(node, InputArtifacts(self.store, digests), ctx)
            st.key = action_key(st.ingredients)
            rec = self.lookup(st.key)
            if rec is None:
                st.reasons = why_changed(
                    node, prev.get(name, {}).get("ingredients"), st.ingredients
                )
                continue
            st.outputs = rec["outputs"]
            outdated = plugin.outdated(node.step, node.params, self.artifacts(st.outputs), ctx)
            if outdated:
                st.reasons = [outdated]
                continue
            st.fresh = True
        return list(states.values())

    def lookup(self, key: str) -> dict | None:
        """The action record of a key: the local store's, else the remote cache's (its listings
        then in the store, its objects fetched by ``fetch_inputs`` when a consumer runs)."""
        rec = self.store.get_action(key)
        if rec is None and self.options.remote is not None:
            rec = self.options.remote.lookup(self.store, key)
        return rec

    def fetch_inputs(self, digests: dict[str, list[str]], name: str) -> None:
        """Bring the objects of a node's input artifacts from the remote cache, if they came
        from it."""
        if self.options.remote is not None:
            self.options.remote.materialize(
                self.store, [d for ds in digests.values() for d in ds], label=f"{name} inputs"
            )

    def check_request(self, targets: list[str] | None = None) -> None:
        """Every selected step's ``check_request``: a bad output path fails before any work."""
        for name in self.selection(targets):
            node = self.m.nodes[name]
            if isinstance(node.step, ChecksRequest):
                node.step.check_request(node.params, self.context(name))

    def artifacts(self, outputs: dict[str, str]):
        return {k: self.store.get_artifact(d) for k, d in outputs.items()}

    def selection(self, targets: list[str] | None) -> list[str]:
        if not targets:
            return self.order
        for t in targets:
            if t not in self.m.nodes:
                raise UsageError(f"{self.m.name} has no step {t!r}{did_you_mean(t, self.m.nodes)}")
        want = set(targets)
        for t in targets:
            want.update(self.topo.ancestors[t])
        return [n for n in self.order if n in want]

    def explain(self, name: str) -> dict:
        if name not in self.m.nodes:
            raise UsageError(
                f"{self.m.name} has no step {name!r}{did_you_mean(name, self.m.nodes)}"
            )
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

    def watched(self, states: list[NodeState]) -> tuple[list[Path], list[Path]] | None:
        """The files whose stat vouches for this build (``uptodate.py``): inputs (the manifest
        chain, what steps read outside the store) and outputs (what steps wrote, and the store
        records and objects of every node), or None if some step cannot say."""
        inputs, outputs = [Path(f) for f in self.m.chain], []
        for st in states:
            node = self.m.nodes[st.name]
            files = plugin.watch(node.step, node.params, self.context(st.name))
            if files is None:
                return None
            inputs += files[0]
            outputs += files[1]
        outputs += self.store.record_files(
            [st.key for st in states], [d for st in states for d in st.outputs.values()]
        )
        return [p.absolute() for p in inputs], [p.absolute() for p in outputs]
