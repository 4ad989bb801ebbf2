"""Manifests: TOML files that declare a variant as a DAG of steps.

A manifest names its ``steps`` and top-level values their params inherit (a param marked
``Inherit(top=NAME)`` takes the top-level ``NAME``: fetch's ``source``, quantize's ``recipe``);
``extends = "other"`` inherits another manifest's top level and steps, deep-merging whatever it
redefines. Everything is resolved here, when the manifest loads: inherited values and defaults
filled in, params validated by each step kind's pydantic model, inputs checked to name existing
steps. The graph never reads TOML.
"""

from __future__ import annotations

import copy
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from buildkit.core.errors import ManifestError, did_you_mean
from buildkit.engine.step import Inherit, Params, Step, get_step, kinds, markers

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class StepDecl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str
    inputs: dict[str, str | list[str]] = {}
    params: dict[str, Any] = {}


class ManifestDecl(BaseModel):
    """A manifest's own keys; any other top-level key must be one a registered kind's params
    inherit (``top_names``)."""

    model_config = ConfigDict(extra="allow")
    description: str = ""
    extends: str | None = None
    steps: dict[str, dict[str, Any]] = {}


def top_names() -> list[str]:
    """The top-level names some registered kind's params inherit, in registration order."""
    names = (m.top for cls in kinds().values() for m in markers(cls.Params, Inherit).values())
    return list(dict.fromkeys(n for n in names if n))


@dataclass(frozen=True)
class Ref:
    """An input reference: output ``output`` of node ``node`` (``node`` or ``node:output``)."""

    node: str
    output: str = "out"

    def __str__(self) -> str:
        return self.node if self.output == "out" else f"{self.node}:{self.output}"


@dataclass
class Node:
    name: str
    kind: str
    step: Step
    params: Params
    inputs: dict[str, list[Ref]]
    file: str  # the manifest file that last defined this step


@dataclass
class Manifest:
    name: str
    file: Path
    description: str
    source: str | None  # the top-level ``source`` (or ``--source``)
    description_from: str = ""  # the manifest (stem) that wrote the description: this or a parent
    nodes: dict[str, Node] = field(default_factory=dict)
    chain: list[str] = field(default_factory=list)  # files, child first


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into ``base``, tables recursively. A ``rules`` table is ordered (first
    match wins) and the more specific file wins: ``over``'s rules come first, in its order,
    then ``base``'s that it does not redefine."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k == "rules" and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**copy.deepcopy(v), **{p: r for p, r in out[k].items() if p not in v}}
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


KEY_PART = re.compile(r'"[^"]*"|\'[^\']*\'|[^.\s"\']+')


def _line_key(line: str) -> list[str] | None:
    """The dotted key a ``key = value`` line defines, as parts (``a."b.c"`` -> ['a', 'b.c'])."""
    if line.lstrip().startswith(("[", "#")) or "=" not in line:
        return None
    return [k.strip("\"'") for k in KEY_PART.findall(line.split("=", 1)[0])] or None


def locate(file: Path, toml_path: list[str]) -> tuple[str, str]:
    """Best-effort ('file:line', source line with a caret) for a dotted TOML path.

    Finds the deepest table header on the path, then below it the key line that
    covers most of the rest of the path (``params.bits = ...`` or an inline table).
    """
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return str(file), ""
    found = None
    for depth in range(len(toml_path), -1, -1):
        if depth:
            header = "[" + ".".join(toml_path[:depth]) + "]"
            start = next(
                (i for i, line in enumerate(lines) if line.replace(" ", "") == header), None
            )
            if start is None:
                continue
        else:
            start = -1
        rest, covered = toml_path[depth:], 0
        found = start if depth else None
        for j in range(start + 1, len(lines)):
            if lines[j].lstrip().startswith("["):
                break
            key = _line_key(lines[j])
            if key and len(key) > covered and rest[: len(key)] == key:
                found, covered = j, len(key)
        if found is not None:
            break
    if found is None:  # a table only defined through sub-tables: [recipe] as [recipe.roles]
        prefix = "[" + ".".join(toml_path) + "."
        found = next(
            (i for i, line in enumerate(lines) if line.replace(" ", "").startswith(prefix)), None
        )
    if found is None:
        return str(file), ""
    text = lines[found]
    indent = len(text) - len(text.lstrip())
    return (
        f"{file}:{found + 1}",
        f"\n    {text}\n    {' ' * indent}{'^' * max(1, len(text.strip()))}",
    )


def _invalid(err: dict) -> str:
    """A pydantic error as one line: what is wrong and, for a scalar, the value given."""
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    return msg if isinstance(got, (dict, list)) else f"{msg} (got {got!r})"


def error_at(file: Path, toml_path: list[str], msg: str) -> ManifestError:
    """A ManifestError naming the file, line and dotted TOML path, with the line and a caret."""
    loc, snippet = locate(file, toml_path)
    return ManifestError(loc, ".".join(toml_path), msg + snippet)


def find_manifest(name_or_path: str, search_dir: Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or "/" in name_or_path:
        if p.exists():
            return p
        raise ManifestError(name_or_path, "", "no such manifest file")
    cand = search_dir / f"{name_or_path}.toml"
    if cand.exists():
        return cand
    known = sorted(x.stem for x in search_dir.glob("*.toml"))
    raise ManifestError(
        str(cand),
        "",
        f"no manifest named {name_or_path!r}{did_you_mean(name_or_path, known)}; "
        f"known: {', '.join(known) or '(none)'}",
    )


def _read_toml(file: Path) -> dict:
    try:
        text = file.read_text()
    except OSError as e:
        raise ManifestError(str(file), "", f"cannot read: {e.strerror}") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(str(file), "", f"invalid TOML: {e}") from e


def _decl(file: Path, raw: dict) -> ManifestDecl:
    try:
        decl = ManifestDecl.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise error_at(file, [str(x) for x in err["loc"]], _invalid(err)) from None
    allowed = ["description", "extends", *top_names(), "steps"]
    for key in decl.model_extra or {}:
        if key not in allowed:
            msg = f"unknown key{did_you_mean(key, allowed)}; allowed: {', '.join(allowed)}"
            raise error_at(file, [key], msg)
    return decl


def _top(raw: dict) -> dict:
    """The top-level values params inherit: everything but the manifest's own keys."""
    return {k: v for k, v in raw.items() if k not in ManifestDecl.model_fields}


def _load_chain(file: Path, seen: list[Path]) -> tuple[dict, dict[str, Path], list[str]]:
    """Merged raw manifest, the file that last defined each step, and the extends chain."""
    file = file.resolve()
    if file in seen:
        cycle = " -> ".join(p.stem for p in [*seen, file])
        raise error_at(
            seen[-1], ["extends"], f"extends loop: {cycle}; a manifest cannot extend itself"
        )
    decl = _decl(file, _read_toml(file))
    raw = {
        **decl.model_dump(include=set(ManifestDecl.model_fields)),
        "top": _top(decl.model_dump()),
    }
    raw["description_from"] = file.stem
    origin = {s: file for s in raw["steps"]}
    chain = [str(file)]
    if decl.extends:
        try:
            parent_file = find_manifest(decl.extends, file.parent)
        except ManifestError as e:
            raise error_at(file, ["extends"], f"unknown parent: {e}") from None
        parent, p_origin, p_chain = _load_chain(parent_file, [*seen, file])
        merged = {
            "description": decl.description or parent["description"],
            "description_from": file.stem if decl.description else parent["description_from"],
            "top": deep_merge(parent["top"], raw["top"]),
            "steps": {},
        }
        for name in [*parent["steps"], *(s for s in raw["steps"] if s not in parent["steps"])]:
            if name in raw["steps"] and name in parent["steps"]:
                merged["steps"][name] = deep_merge(parent["steps"][name], raw["steps"][name])
            else:
                merged["steps"][name] = raw["steps"].get(name, parent["steps"].get(name))
        return merged, {**p_origin, **origin}, chain + p_chain
    return raw, origin, chain


def _depth(table: dict, path: list[str]) -> int:
    """How many leading parts of ``path`` the nested ``table`` defines."""
    n = 0
    for k in path:
        if not isinstance(table, dict) or k not in table:
            break
        table, n = table[k], n + 1
    return n


def _defines(table: dict, path: list[str]) -> bool:
    return _depth(table, path) == len(path)


def _top_file(chain: list[str], path: list[str]) -> Path:
    """The file of the extends chain (child first) that defines most of a top-level path."""
    depths = [(_depth(_read_toml(Path(f)), path), -i, f) for i, f in enumerate(chain)]
    return Path(max(depths)[2])


def parse_ref(s: str) -> Ref:
    node, _, output = s.partition(":")
    return Ref(node, output or "out")


def load(
    name_or_path: str, manifests_dir: str | Path = "manifests", source: str | None = None
) -> Manifest:
    """Load, merge and validate a manifest; ``source`` overrides the manifest's source."""
    file = find_manifest(name_or_path, Path(manifests_dir))
    raw, origin, chain = _load_chain(file, [])
    top = {**raw["top"], **({"source": source} if source is not None else {})}
    m = Manifest(
        name=file.stem,
        file=file,
        description=raw["description"],
        description_from=raw["description_from"],
        source=top.get("source"),
        chain=chain,
    )
    if not raw["steps"]:
        raise error_at(file, ["steps"], "a manifest needs at least one step")
    for name, body in raw["steps"].items():
        f = origin[name]
        where = ["steps", name]
        if not NAME_RE.match(name):
            raise error_at(f, where, "step names use letters, digits, '_', '-', '.'")
        decl = _declaration(f, where, body)
        step = get_step(decl.kind)
        p = _params(f, where, decl, step, top, chain)
        m.nodes[name] = Node(name, decl.kind, step, p, _inputs(f, where, decl, step), str(f))
    _check_refs(m)
    _inherit_from_inputs(m)
    return m


def _declaration(f: Path, where: list[str], body: dict) -> StepDecl:
    """A step's table as a ``StepDecl`` of a registered kind, or the error at its TOML path."""
    try:
        decl = StepDecl.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [*where, *(str(x) for x in err["loc"])]
        if err["type"] == "extra_forbidden":
            msg = (
                f"unknown key{did_you_mean(loc[-1], StepDecl.model_fields)}; "
                "a step has kind, inputs, params"
            )
        elif err["type"] == "missing":
            msg = "missing required key"
        else:
            msg = _invalid(err)
        raise error_at(f, loc, msg) from None
    registry = kinds()
    if decl.kind not in registry:
        raise error_at(
            f,
            [*where, "kind"],
            f"unknown step kind {decl.kind!r}{did_you_mean(decl.kind, registry)}; "
            f"known kinds: {', '.join(sorted(registry))}",
        )
    return decl


def _params(f: Path, where: list[str], decl: StepDecl, step, top: dict, chain: list) -> Params:
    """A step's params with the top-level values it inherits filled in, validated by its kind."""
    params = dict(decl.params)
    inherits = markers(step.Params, Inherit)
    for name, inh in inherits.items():
        if inh.top is None or inh.top not in top:
            continue
        own, val = params.get(name), top[inh.top]
        if isinstance(val, dict) and isinstance(own, dict | None):  # else validation says why
            params[name] = deep_merge(val, own or {})
        elif own is None:
            params[name] = val
    try:
        return step.Params.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [*where, "params", *(str(x) for x in err["loc"])]
        inh = inherits.get(loc[3]) if len(loc) > 3 else None
        if inh and inh.top and not _defines(decl.params, loc[3:]):
            # the top-level table is to blame
            loc = [inh.top, *loc[4:]]
            f = _top_file(chain, loc)
        if err["type"] == "extra_forbidden":
            msg = (
                f"unknown param{did_you_mean(loc[-1], step.Params.model_fields)} "
                f"for kind {decl.kind!r}; known: {', '.join(step.Params.model_fields)}"
            )
        elif err["type"] == "missing":
            msg = f"missing required param for kind {decl.kind!r}"
        else:
            msg = _invalid(err)
        raise error_at(f, loc, msg) from None


def _inputs(f: Path, where: list[str], decl: StepDecl, step) -> dict[str, list[Ref]]:
    """A step's inputs as node references, each slot one its kind has, the required ones set."""
    inputs: dict[str, list[Ref]] = {}
    for slot, val in decl.inputs.items():
        if slot not in step.inputs:
            raise error_at(
                f,
                [*where, "inputs", slot],
                f"kind {decl.kind!r} has no input {slot!r}{did_you_mean(slot, step.inputs)}; "
                f"its inputs: {', '.join(step.inputs) or '(none)'}",
            )
        refs = [val] if isinstance(val, str) else list(val)
        if len(refs) != 1 and not step.inputs[slot].many:
            raise error_at(f, [*where, "inputs", slot], "takes exactly one node reference")
        inputs[slot] = [parse_ref(r) for r in refs]
    for slot, spec in step.inputs.items():
        if spec.required and not inputs.get(slot):
            raise error_at(f, [*where, "inputs"], f"missing input {slot!r} for kind {decl.kind!r}")
    return inputs


def _check_refs(m: Manifest) -> None:
    """Every input names a step of the manifest and an output that step's kind has."""
    for node in m.nodes.values():
        for slot, refs in node.inputs.items():
            for r in refs:
                if r.node not in m.nodes:
                    raise error_at(
                        Path(node.file),
                        ["steps", node.name, "inputs", slot],
                        f"input {str(r)!r} names no step{did_you_mean(r.node, m.nodes)}; "
                        f"steps: {', '.join(m.nodes)}",
                    )
                producer = m.nodes[r.node].step
                if r.output not in producer.outputs:
                    raise error_at(
                        Path(node.file),
                        ["steps", node.name, "inputs", slot],
                        f"step {r.node!r} ({producer.kind}) has no output {r.output!r}; "
                        f"its outputs: {', '.join(producer.outputs)}",
                    )


def _inherit_from_inputs(m: Manifest) -> None:
    """A param marked ``Inherit(slot=...)`` and left unset takes the same param of the step in
    that input slot (sensitivity's text: its calibration's), else its ``fallback``; resolved at
    load like every other param, producers first."""
    for name in _order(m):
        node = m.nodes[name]
        for field_name, inh in markers(node.step.Params, Inherit).items():
            if inh.slot is None or getattr(node.params, field_name) is not None:
                continue
            refs = node.inputs.get(inh.slot)
            got = getattr(m.nodes[refs[0].node].params, field_name, None) if refs else None
            update = {field_name: got if got is not None else inh.fallback}
            node.params = node.params.model_copy(update=update)


def _order(m: Manifest) -> list[str]:
    """The nodes, each after the nodes its inputs name (cycles are the graph's to report)."""
    done: dict[str, None] = {}

    def visit(name: str, seen: tuple) -> None:
        if name in done or name in seen:
            return
        for refs in m.nodes[name].inputs.values():
            for r in refs:
                visit(r.node, (*seen, name))
        done[name] = None

    for name in m.nodes:
        visit(name, ())
    return list(done)
