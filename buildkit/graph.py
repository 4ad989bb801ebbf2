"""Manifest -> networkx DiGraph of nodes, with cycle errors and text/dot/mermaid renderings,
and the Topology the scheduler walks.

networkx answers every question about the graph. Its answers (order, predecessors,
ancestors, descendants) are kept in the variant's ref with a digest of the graph's shape,
so a build whose manifest graph is unchanged reads them back instead of importing networkx,
which costs 0.2 s (half of a no-op build).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import keys, manifest
from .lazy import lazy
from .manifest import Manifest

nx = lazy("networkx", __name__, "nx")


def build(m: Manifest) -> nx.DiGraph:
    """Edges run producer -> consumer; node attribute ``node`` holds the resolved Node."""
    g = nx.DiGraph()
    for name, node in m.nodes.items():
        g.add_node(name, node=node)
    for name, node in m.nodes.items():
        for slot, refs in node.inputs.items():
            for r in refs:
                g.add_edge(r.node, name, slot=slot, output=r.output)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return g
    names = [u for u, _ in cycle] + [cycle[0][0]]
    # Blame the edge declared by the most derived manifest: that is where the loop was closed.
    rank = {f: i for i, f in enumerate(m.chain)}
    u, v = min(cycle, key=lambda e: rank.get(m.nodes[e[1]].file, len(rank)))
    raise manifest.error_at(
        Path(m.nodes[v].file),
        ["steps", v, "inputs", g.edges[u, v]["slot"]],
        f"cycle between steps: {' -> '.join(names)}; a step cannot depend on its own output",
    )


def order(g: nx.DiGraph) -> list[str]:
    """Deterministic topological order (ties broken by name)."""
    return list(nx.lexicographical_topological_sort(g))


@dataclass(frozen=True)
class Topology:
    digest: str  # of the graph's shape: node names and edges
    order: list[str]  # ``order``: deterministic topological order
    preds: dict[str, list[str]]
    ancestors: dict[str, list[str]]
    descendants: dict[str, list[str]]


def shape_digest(m: Manifest) -> str:
    edges = {n: sorted([slot, r.node, r.output] for slot, refs in node.inputs.items() for r in refs) for n, node in m.nodes.items()}
    return keys.digest_json("graph", edges)


def topology(m: Manifest, known: dict | None = None) -> Topology:
    """The scheduler's view of ``m``'s graph: ``known`` (a Topology's fields, from the last
    build's ref) if it has the same shape, else computed with networkx (cycles raise)."""
    digest = shape_digest(m)
    if known and known.get("digest") == digest:
        try:
            topo = Topology(**known)
        except TypeError:  # an older or foreign ref: compute it
            pass
        else:
            if sorted(topo.order) == sorted(m.nodes):
                return topo
    g = build(m)
    nodes = order(g)
    return Topology(
        digest,
        nodes,
        {n: sorted(g.predecessors(n)) for n in nodes},
        {n: sorted(nx.ancestors(g, n)) for n in nodes},
        {n: sorted(nx.descendants(g, n)) for n in nodes},
    )


def render(g: nx.DiGraph, fmt: str = "text") -> str:
    nodes = order(g)
    if fmt == "dot":
        lines = ["digraph buildkit {", "  rankdir=LR;"]
        lines += [f'  "{n}" [label="{n}\\n({g.nodes[n]["node"].kind})"];' for n in nodes]
        lines += [f'  "{u}" -> "{v}" [label="{d["slot"]}"];' for u, v, d in sorted(g.edges(data=True))]
        return "\n".join([*lines, "}"])
    if fmt == "mermaid":
        ident = {n: f"n{i}" for i, n in enumerate(nodes)}
        lines = ["flowchart LR"]
        lines += [f'  {ident[n]}["{n} ({g.nodes[n]["node"].kind})"]' for n in nodes]
        lines += [f"  {ident[u]} -->|{d['slot']}| {ident[v]}" for u, v, d in sorted(g.edges(data=True))]
        return "\n".join(lines)
    lines = []
    for n in nodes:
        node = g.nodes[n]["node"]
        deps = ", ".join(f"{slot}={', '.join(map(str, refs))}" for slot, refs in node.inputs.items())
        lines.append(f"{n} ({node.kind})" + (f" <- {deps}" if deps else ""))
    return "\n".join(lines)
