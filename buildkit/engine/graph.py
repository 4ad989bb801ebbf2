"""Manifest -> networkx graph of steps: cycle errors, the order the scheduler walks, and
text/dot/mermaid renderings.

Edges run producer -> consumer, one per input reference (a MultiDiGraph: verify_head takes
quantize as ``model`` and as ``base``, two edges), each with its slot and the producer's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from buildkit.engine import manifest
from buildkit.engine.manifest import Manifest


def build(m: Manifest) -> nx.MultiDiGraph:
    """One node per step (attribute ``node``: the resolved Node), one edge per input reference."""
    g = nx.MultiDiGraph()
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
    names = [e[0] for e in cycle] + [cycle[0][0]]
    # Blame the edge declared by the most derived manifest: that is where the loop was closed.
    rank = {f: i for i, f in enumerate(m.chain)}
    u, v, k = min(cycle, key=lambda e: rank.get(m.nodes[e[1]].file, len(rank)))
    raise manifest.error_at(
        Path(m.nodes[v].file),
        ["steps", v, "inputs", g.edges[u, v, k]["slot"]],
        f"cycle between steps: {' -> '.join(names)}; a step cannot depend on its own output",
    )


def order(g: nx.MultiDiGraph) -> list[str]:
    """Deterministic topological order (ties broken by name)."""
    return list(nx.lexicographical_topological_sort(g))


@dataclass(frozen=True)
class Topology:
    order: list[str]  # deterministic topological order
    preds: dict[str, list[str]]
    ancestors: dict[str, list[str]]
    descendants: dict[str, list[str]]
    # steps on the longest chain from a step to the end of the graph, itself included: among
    # ready steps the scheduler starts the highest first (the critical path, with no costs known)
    height: dict[str, int]


def topology(m: Manifest) -> Topology:
    """The scheduler's view of ``m``'s graph (cycles raise)."""
    g = build(m)
    nodes = order(g)
    return Topology(
        nodes,
        {n: sorted(set(g.predecessors(n))) for n in nodes},
        {n: sorted(nx.ancestors(g, n)) for n in nodes},
        {n: sorted(nx.descendants(g, n)) for n in nodes},
        heights(g, nodes),
    )


def heights(g: nx.MultiDiGraph, nodes: list[str]) -> dict[str, int]:
    """Each node's ``Topology.height``, walking ``nodes`` (a topological order) backwards."""
    h: dict[str, int] = {}
    for n in reversed(nodes):
        h[n] = 1 + max((h[s] for s in g.successors(n)), default=0)
    return h


def _edges(g: nx.MultiDiGraph) -> list[tuple[str, str, str]]:
    """(producer, consumer, label) per edge, sorted; the label names the slot and, when it is
    not the default one, the producer's output (``sanitize:mtp``)."""
    out = []
    for u, v, d in g.edges(data=True):
        src = u if d["output"] == "out" else f"{u}:{d['output']}"
        out.append((u, v, f"{d['slot']} = {src}" if src != u else d["slot"]))
    return sorted(out)


def render(g: nx.MultiDiGraph, fmt: str = "text") -> str:
    nodes = order(g)
    if fmt == "dot":
        lines = ["digraph buildkit {", "  rankdir=LR;"]
        lines += [f'  "{n}" [label="{n}\\n({g.nodes[n]["node"].kind})"];' for n in nodes]
        lines += [f'  "{u}" -> "{v}" [label="{label}"];' for u, v, label in _edges(g)]
        return "\n".join([*lines, "}"])
    if fmt == "mermaid":
        ident = {n: f"n{i}" for i, n in enumerate(nodes)}
        lines = ["flowchart LR"]
        lines += [f'  {ident[n]}["{n} ({g.nodes[n]["node"].kind})"]' for n in nodes]
        lines += [f'  {ident[u]} -->|"{label}"| {ident[v]}' for u, v, label in _edges(g)]
        return "\n".join(lines)
    lines = []
    for n in nodes:
        node = g.nodes[n]["node"]
        deps = ", ".join(
            f"{slot}={', '.join(map(str, refs))}" for slot, refs in node.inputs.items()
        )
        lines.append(f"{n} ({node.kind})" + (f" <- {deps}" if deps else ""))
    return "\n".join(lines)
