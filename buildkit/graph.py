"""Manifest -> networkx DiGraph of nodes, with cycle errors and text/dot/mermaid renderings."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from . import manifest
from .manifest import Manifest


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
