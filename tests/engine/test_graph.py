"""The step graph: one edge per input reference, cycle errors, deterministic order, topology,
renderings."""

from __future__ import annotations

import re

import pytest
from conftest import XL_MTP

from buildkit.core.errors import ManifestError
from buildkit.engine import graph as graphs
from buildkit.engine import manifest

MTP_EDGES = {
    ("fetch", "sanitize", "source"),
    ("sanitize", "quantize", "model = sanitize:model"),
    ("sanitize", "graft", "head = sanitize:mtp"),
    ("sanitize", "graft", "trunk = sanitize:model"),
    ("graft", "requantize", "model"),
    ("quantize", "verify", "model"),
    ("fetch", "verify", "source"),
    ("quantize", "verify_head", "model"),
    ("requantize", "verify_head", "model"),
    ("fetch", "verify_head", "source"),
    ("quantize", "verify_head", "base"),
    ("quantize", "publish", "model"),
    ("requantize", "publish", "model"),
    ("fetch", "publish", "source"),
    ("verify", "publish", "report"),
    ("verify_head", "publish", "report"),
    ("quantize", "eval", "model"),
    ("sanitize", "eval", "source = sanitize:model"),
    ("sanitize", "reference", "source = sanitize:model"),
    ("reference", "eval", "reference"),
    ("quantize", "eval_head", "model"),
    ("requantize", "eval_head", "model"),
    ("sanitize", "eval_head", "source = sanitize:model"),
    ("graft", "eval_head", "source"),
    ("eval", "eval_head", "trunk = eval:trunk"),
    ("eval", "publish", "eval"),
    ("eval_head", "publish", "eval"),
}


def test_graph_edges_and_order(project):
    g = graphs.build(manifest.load("xl-mtp", project.manifests))
    edges = {(u, v) for u, v, _ in MTP_EDGES}
    assert {(u, v) for u, v, _ in g.edges} == edges
    assert g.number_of_edges() == len(MTP_EDGES)  # two references between one pair: two edges
    order = graphs.order(g)
    assert all(order.index(u) < order.index(v) for u, v in edges)
    assert order == graphs.order(graphs.build(manifest.load("xl-mtp", project.manifests)))


@pytest.mark.parametrize("fmt", ["text", "dot", "mermaid"])
def test_graph_command_renders_every_node_and_edge(project, capsys, fmt):
    assert project.cli("graph", "xl-mtp", "--format", fmt) == 0
    out = capsys.readouterr().out
    kinds = {
        n: n
        for n in (
            "fetch",
            "sanitize",
            "quantize",
            "graft",
            "requantize",
            "verify",
            "reference",
            "eval",
            "publish",
        )
    }
    kinds["verify_head"] = "verify"
    kinds["eval_head"] = "eval"
    if fmt == "text":
        assert "graft (graft) <- head=sanitize:mtp, trunk=sanitize:model" in out
        assert "verify (verify) <- model=quantize, source=fetch" in out
        assert (
            "verify_head (verify) <- model=quantize, requantize, source=fetch, base=quantize" in out
        )
        assert "eval (eval) <- model=quantize, source=sanitize:model, reference=reference\n" in out
        assert (
            "eval_head (eval) <- model=quantize, requantize, source=sanitize:model, graft, "
            "trunk=eval:trunk\n" in out
        )
        assert (
            "publish (publish) <- model=quantize, requantize, source=fetch, "
            "report=verify, verify_head, eval=eval, eval_head" in out
        )
        assert "fetch (fetch)\n" in out
        return
    if fmt == "dot":
        assert out.startswith("digraph buildkit {") and out.rstrip().endswith("}")
        for n, k in kinds.items():
            assert f'"{n}" [label="{n}\\n({k})"];' in out
        edges = set(re.findall(r'"([\w-]+)" -> "([\w-]+)" \[label="([^"]+)"\]', out))
        assert edges == MTP_EDGES  # every reference, with the producer's output where it names one
        return
    assert out.startswith("flowchart LR")
    ident = dict((name, i) for i, name in re.findall(r'(n\d+)\["([\w-]+) \([\w-]+\)"\]', out))
    assert set(ident) == set(kinds)
    edges = set(re.findall(r'(n\d+) -->\|"([^"]+)"\| (n\d+)', out))
    assert edges == {(ident[u], label, ident[v]) for u, v, label in MTP_EDGES}


# ---- cycles ----------------------------------------------------------------------------------


def test_cycle_error_names_the_file_line_slot_and_the_loop(project):
    f = project.write_manifest(
        "bad", 'extends = "xl"\n[steps.sanitize]\ninputs = { source = "quantize" }\n'
    )
    m = manifest.load("bad", project.manifests)  # loading checks references, not loops
    with pytest.raises(ManifestError) as e:
        graphs.build(m)
    assert e.value.exit_code == 2
    assert e.value.file == f"{f.resolve()}:3"
    assert e.value.where == "steps.sanitize.inputs.source"
    assert (
        "cycle between steps: sanitize -> quantize -> sanitize; "
        "a step cannot depend on its own output" in str(e.value)
    )
    with pytest.raises(ManifestError, match="cycle between steps"):
        graphs.topology(m)


def test_cycle_closed_by_a_child_is_blamed_on_the_child(project):
    """Of a loop's edges, the one the most derived manifest declared is where the loop was
    closed."""
    project.write_manifest(
        "mid",
        'extends = "xl"\n[steps.extra]\nkind = "quantize"\ninputs = { model = "sanitize:model" }\n',
    )
    f = project.write_manifest(
        "bad", 'extends = "mid"\n\n[steps.sanitize]\ninputs = { source = "extra" }\n'
    )
    with pytest.raises(ManifestError) as e:
        graphs.build(manifest.load("bad", project.manifests))
    assert e.value.file == f"{f.resolve()}:4"
    assert e.value.where == "steps.sanitize.inputs.source"
    loop = re.search(r"cycle between steps: ([\w >-]+);", str(e.value))[1].split(" -> ")
    assert loop[0] == loop[-1] and sorted(loop[:-1]) == ["extra", "sanitize"]


def test_a_step_reading_its_own_output_is_a_cycle_of_one(project):
    f = project.write_manifest(
        "bad", 'extends = "xl"\n[steps.verify]\ninputs = { model = ["verify"] }\n'
    )
    with pytest.raises(ManifestError) as e:
        graphs.build(manifest.load("bad", project.manifests))
    assert str(e.value).startswith(
        f"{f.resolve()}:3: steps.verify.inputs.model: cycle between steps: verify -> verify; "
        'a step cannot depend on its own output\n    inputs = { model = ["verify"] }\n    ^^^'
    )


# ---- order and topology ------------------------------------------------------------------------


def test_order_breaks_ties_by_name_not_declaration_order(project):
    project.write_manifest(
        "ties",
        (
            'extends = "xl"\n'
            '[steps.zz]\nkind = "quantize"\ninputs = { model = "sanitize:model" }\n'
            '[steps.aa]\nkind = "quantize"\ninputs = { model = "sanitize:model" }\n'
        ),
    )
    m = manifest.load("ties", project.manifests)
    assert list(m.nodes)[-2:] == ["zz", "aa"]  # declared zz first
    assert graphs.order(graphs.build(m)) == [
        "fetch",
        "sanitize",
        "aa",
        "quantize",
        "reference",
        "eval",
        "verify",
        "publish",
        "zz",
    ]
    mtp = graphs.order(graphs.build(manifest.load("xl-mtp", project.manifests)))
    assert mtp == XL_MTP


def test_topology_lists_preds_ancestors_and_descendants_sorted(project):
    t = graphs.topology(manifest.load("xl-mtp", project.manifests))
    assert t.order[0] == "fetch" and t.order[-1] == "publish"
    assert t.preds["verify_head"] == [
        "fetch",
        "quantize",
        "requantize",
    ]  # quantize twice, once here
    assert t.preds["fetch"] == [] and t.ancestors["fetch"] == []
    assert t.ancestors["requantize"] == ["fetch", "graft", "sanitize"]
    assert t.preds["eval_head"] == ["eval", "graft", "quantize", "requantize", "sanitize"]
    assert t.descendants["graft"] == ["eval_head", "publish", "requantize", "verify_head"]
    assert t.descendants["eval"] == ["eval_head", "publish"]
    assert t.descendants["publish"] == []
    assert t.ancestors["publish"] == sorted(set(t.order) - {"publish"})


# ---- renderings ------------------------------------------------------------------------------


def test_render_text_dot_and_mermaid_of_xl(project):
    g = graphs.build(manifest.load("xl", project.manifests))
    assert graphs.render(g) == (
        "fetch (fetch)\n"
        "sanitize (sanitize) <- source=fetch\n"
        "quantize (quantize) <- model=sanitize:model\n"
        "reference (reference) <- source=sanitize:model\n"
        "eval (eval) <- model=quantize, source=sanitize:model, reference=reference\n"
        "verify (verify) <- model=quantize, source=fetch\n"
        "publish (publish) <- model=quantize, source=fetch, report=verify, eval=eval"
    )
    assert graphs.render(g, "dot") == "\n".join(
        [
            "digraph buildkit {",
            "  rankdir=LR;",
            '  "fetch" [label="fetch\\n(fetch)"];',
            '  "sanitize" [label="sanitize\\n(sanitize)"];',
            '  "quantize" [label="quantize\\n(quantize)"];',
            '  "reference" [label="reference\\n(reference)"];',
            '  "eval" [label="eval\\n(eval)"];',
            '  "verify" [label="verify\\n(verify)"];',
            '  "publish" [label="publish\\n(publish)"];',
            '  "eval" -> "publish" [label="eval"];',
            '  "fetch" -> "publish" [label="source"];',
            '  "fetch" -> "sanitize" [label="source"];',
            '  "fetch" -> "verify" [label="source"];',
            '  "quantize" -> "eval" [label="model"];',
            '  "quantize" -> "publish" [label="model"];',
            '  "quantize" -> "verify" [label="model"];',
            '  "reference" -> "eval" [label="reference"];',
            '  "sanitize" -> "eval" [label="source = sanitize:model"];',
            '  "sanitize" -> "quantize" [label="model = sanitize:model"];',
            '  "sanitize" -> "reference" [label="source = sanitize:model"];',
            '  "verify" -> "publish" [label="report"];',
            "}",
        ]
    )
    assert graphs.render(g, "mermaid") == "\n".join(
        [
            "flowchart LR",
            '  n0["fetch (fetch)"]',
            '  n1["sanitize (sanitize)"]',
            '  n2["quantize (quantize)"]',
            '  n3["reference (reference)"]',
            '  n4["eval (eval)"]',
            '  n5["verify (verify)"]',
            '  n6["publish (publish)"]',
            '  n4 -->|"eval"| n6',
            '  n0 -->|"source"| n6',
            '  n0 -->|"source"| n1',
            '  n0 -->|"source"| n5',
            '  n2 -->|"model"| n4',
            '  n2 -->|"model"| n6',
            '  n2 -->|"model"| n5',
            '  n3 -->|"reference"| n4',
            '  n1 -->|"source = sanitize:model"| n4',
            '  n1 -->|"model = sanitize:model"| n2',
            '  n1 -->|"source = sanitize:model"| n3',
            '  n5 -->|"report"| n6',
        ]
    )
