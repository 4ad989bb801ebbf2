"""estimate: what each node of a variant would output, from layouts alone, no tensor data.

Every step kind with an ``estimate`` hook (``step.Estimates``) is asked, in graph order, what
its outputs would be given its inputs' estimated layouts; a kind without one (a step that
measures or publishes) is skipped, and so are the slots it would have fed. What a layout holds
is the steps' business: the engine only carries them along the edges (``buildkit estimate``
adds up the quantizing steps', ``quant/estimate.py``).
"""

from __future__ import annotations

from buildkit.engine.graph import topology
from buildkit.engine.manifest import Manifest
from buildkit.engine.step import Estimates


def layouts(m: Manifest) -> dict[str, dict[str, dict]]:
    """node -> output -> layout, for the nodes whose kind estimates, in manifest order."""
    out: dict[str, dict[str, dict]] = {}
    for name in topology(m).order:
        node = m.nodes[name]
        if not isinstance(node.step, Estimates):
            continue
        given = {
            slot: [out[r.node][r.output] for r in refs if r.output in out.get(r.node, {})]
            for slot, refs in node.inputs.items()
        }
        out[name] = node.step.estimate(node.params, {k: v for k, v in given.items() if v})
    return {name: out[name] for name in m.nodes if name in out}
