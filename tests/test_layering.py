"""The package's layering, read from the imports: lower folders never import higher ones, the
engine imports nothing that knows a model, no module imports another's private names, and no
two modules import each other in a loop. docs/develop.md's picture is drawn from this table."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import buildkit

# Low to high: a folder may import itself and the folders before it (buildkit/__init__.py).
LAYERS = (
    "core",
    "formats",
    "store",
    "fixtures",
    "grade",
    "quant",
    "clients",
    "present",
    "engine",
    "steps",
    "cli",
)

# Folders that may import fewer than every folder below them: the engine knows no model, so a
# second model family (or kind of artifact) could reuse it.
ONLY = {"engine": ("core", "store")}


def imports(root: Path) -> list[tuple[str, str, str, int]]:
    """(importer, imported module, name or '', line) for every buildkit import under ``root``,
    at any depth of the code (a function's deferred import counts as much as a top-level one)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        mod = ".".join(("buildkit", *path.relative_to(root).with_suffix("").parts))
        mod = mod.removesuffix(".__init__")
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, "", node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    is_module = (root.parent / (sub.replace(".", "/") + ".py")).exists() or (
                        root.parent / sub.replace(".", "/")
                    ).is_dir()
                    out.append(
                        (mod, sub if is_module else base, "" if is_module else a.name, node.lineno)
                    )
    return [i for i in out if i[1] == "buildkit" or i[1].startswith("buildkit.")]


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def violations(root: Path) -> list[str]:
    found = []
    graph = nx.DiGraph()
    for importer, imported, name, line in imports(root):
        where = f"{importer} (line {line})"
        lo, hi = layer(importer), layer(imported)
        if lo is not None and hi is not None and hi > lo:
            found.append(f"{where} imports {imported}: {LAYERS[lo]} is below {LAYERS[hi]}")
        elif lo is not None and hi is not None and hi != lo and LAYERS[lo] in ONLY:
            if LAYERS[hi] not in ONLY[LAYERS[lo]]:
                found.append(
                    f"{where} imports {imported}: {LAYERS[lo]} may import only "
                    f"{', '.join(ONLY[LAYERS[lo]])}"
                )
        if name.startswith("_") and imported != importer:
            found.append(f"{where} imports the private name {name} from {imported}")
        if imported != importer:
            graph.add_edge(importer, imported)
    found += [f"import cycle: {' -> '.join([*c, c[0]])}" for c in nx.simple_cycles(graph)]
    return found


def allowed(folder: str) -> tuple[str, ...]:
    """The folders ``folder`` may import (itself aside)."""
    return ONLY.get(folder, LAYERS[: LAYERS.index(folder)])


def mermaid() -> str:
    """The layering as a mermaid flowchart: an arrow for each folder a folder may import,
    leaving out what it may import through another it imports, but for the ``ONLY`` folders,
    whose arrows are all drawn (docs/develop.md shows it)."""
    g = nx.DiGraph((a, b) for a in LAYERS if a not in ONLY for b in allowed(a))
    edges = [*nx.transitive_reduction(g).edges, *((a, b) for a in ONLY for b in ONLY[a])]
    edges.sort(key=lambda e: (LAYERS.index(e[0]), LAYERS.index(e[1])))
    return "\n".join(["flowchart TD", *(f"  {a} --> {b}" for a, b in reversed(edges))])


def test_develop_md_draws_this_table():
    text = (Path(buildkit.__file__).parents[1] / "docs" / "develop.md").read_text()
    assert f"```mermaid\n{mermaid()}\n```" in text, (
        "docs/develop.md's layering picture differs from tests/test_layering.py; paste:\n"
        + mermaid()
    )


def test_every_module_lives_in_a_layer():
    root = Path(buildkit.__file__).parent
    loose = [p.name for p in root.glob("*.py") if p.name != "__init__.py"] + [
        p.name
        for p in root.iterdir()
        if p.is_dir() and p.name not in (*LAYERS, "data", "__pycache__")
    ]
    assert loose == [], f"put these in a folder of {LAYERS}: {loose}"


def test_the_package_keeps_its_layering():
    assert violations(Path(buildkit.__file__).parent) == []


def test_the_check_catches_an_upward_import_a_private_name_and_a_cycle(tmp_path):
    pkg = tmp_path / "buildkit"
    for folder in ("store", "engine"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "a.py").write_text("def f():\n    from buildkit.engine import plan\n")
    (pkg / "quant").mkdir()
    (pkg / "quant" / "__init__.py").write_text("")
    (pkg / "engine" / "est.py").write_text("import buildkit.quant\n")
    (pkg / "engine" / "plan.py").write_text("from buildkit.engine.other import _hidden\n")
    (pkg / "engine" / "other.py").write_text("from . import plan\n_hidden = 1\n")
    found = violations(pkg)
    assert "buildkit.store.a (line 2) imports buildkit.engine.plan: store is below engine" in found
    assert (
        "buildkit.engine.est (line 1) imports buildkit.quant: engine may import only core, store"
        in found
    )
    assert any("private name _hidden" in f for f in found)
    assert any(f.startswith("import cycle:") and "buildkit.engine.plan" in f for f in found)


def test_present_reads_figures_never_the_store():
    """The card and tables are given what they show: nothing in present/ opens a store (the
    Artifact listing, a value publish passes in, is all it may take from store/)."""
    root = Path(buildkit.__file__).parent
    found = [
        f"{importer} (line {line}) imports {imported}"
        for importer, imported, _, line in imports(root)
        if importer.startswith("buildkit.present")
        and imported.startswith("buildkit.store")
        and imported != "buildkit.store.artifact"
    ]
    assert found == []
