"""estimate: a variant's size and bits per weight from config.json and safetensors headers.

No tensor data is read. The plan is the build's own: each HF tensor becomes the MLX tensors
sanitize (or graft, for the MTP head) would make (``convert.mlx_pieces``), every quantize and
requantize node of the manifest assigns their roles with ``quantize.assign_roles``, and a
quantized role stores what ``mx.quantize`` stores (``quantize.output_shapes``). The sum is
the published model's tensor bytes (the safetensors payloads, headers not counted).

Bits per weight are counted the way the clients count them: bytes x 8 over source parameters,
with the vision tower (mlx_vlm loads it) and without (mlx_lm drops it); neither loads the MTP
head, which is reported on its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from buildkit.core.errors import SourceError, UsageError
from buildkit.engine.source import HF_RE, parse_fixture, source_kind, trained_name
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.checkpoint import check_layout
from buildkit.formats.convert import mlx_pieces
from buildkit.formats.tensors import TensorInfo, nbytes, read_header
from buildkit.quant import budget
from buildkit.quant.quantize import assign_roles, output_shapes

PARTS = ("language_model", "vision_tower", "mtp")


def source_layout(source: str) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """(config.json, HF name -> (dtype, shape)) of a source, from headers only.

    A directory: its config.json and each shard's header. ``hf://org/repo@rev``: config.json
    from the Hub and the shards' headers through ``HfApi.get_safetensors_metadata`` (range
    reads of the headers; no weights are downloaded). ``fixture:...``: the generator's plan.
    """
    kind = source_kind(source)
    if kind in ("fixture", "trained"):
        from buildkit.fixtures.generated import layout
        from buildkit.fixtures.trained import get

        try:
            spec = parse_fixture(source) if kind == "fixture" else get(trained_name(source)).spec
        except ValueError as e:
            raise UsageError(str(e)) from None
        config, shapes = layout(spec)
        return config, {n: ("BF16", tuple(s)) for n, s in shapes.items()}
    if kind == "hf":
        from huggingface_hub import HfApi, hf_hub_download

        m = HF_RE.match(source)
        if not m:
            raise UsageError(f"expected hf://org/repo@revision, got {source!r}")
        from buildkit.store.hub import explain

        repo, rev = m["repo"], m["rev"]
        try:
            config = json.loads(
                Path(hf_hub_download(repo, "config.json", revision=rev)).read_text()
            )
            meta = HfApi().get_safetensors_metadata(repo, revision=rev)
        except Exception as e:  # hub errors come in many types: each says what to do
            raise explain(e, f"cannot estimate from {source}", repo, rev) from e
        found = {}
        for fm in meta.files_metadata.values():
            for name, t in fm.tensors.items():
                found[name] = (t.dtype, tuple(t.shape))
        return config, found
    root = Path(source)
    if not (root / "config.json").is_file():
        raise SourceError(f"{root}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        config = json.loads((root / "config.json").read_text())
    except ValueError as e:
        raise SourceError(f"{root / 'config.json'}: not valid JSON ({e})") from e
    found = {}
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise SourceError(f"{root}: no *.safetensors files")
    for f in shards:
        for name, info in read_header(f).tensors.items():
            if name in found:
                raise SourceError(f"tensor {name!r} appears in two shards ({f.name} is the second)")
            found[name] = (info.dtype, tuple(info.shape))
    return config, found


def _node_inputs(m, node, mlx_tensors: dict[str, dict]) -> dict[str, dict]:
    """The MLX tensors a quantize/requantize node receives: sanitize's model (the trunk and
    the vision tower) or a graft (the head)."""
    ref = node.inputs["model"][0]
    producer = m.nodes[ref.node]
    if producer.kind == "sanitize" and ref.output == "model":
        return {k: v for k, v in mlx_tensors.items() if ckpt.model_part(k) != "mtp"}
    if producer.kind == "graft":
        return {k: v for k, v in mlx_tensors.items() if ckpt.model_part(k) == "mtp"}
    raise UsageError(
        f"step {node.name!r}: estimate follows quantize over sanitize:model and requantize over "
        f"graft; its input {ref.node!r} is a {producer.kind!r} step"
    )


def _budget(node, given: dict[str, dict], roles: dict[str, str]) -> dict | None:
    """A node's bits-per-weight budget, if it has one: its target and the range it can reach.
    The bits per layer are planned at build time, from measured sensitivities."""
    recipe = node.params.recipe
    if recipe.target_bpw is None:
        return None
    names = [n for n in budget.routed_weights(given) if recipe.roles[roles[n]].budget_bits]
    if not names:
        return None
    measured = {"groups": budget.groups_of(names, "tensor"), "sensitivity": {}}
    lo, hi = budget.reachable(given, roles, recipe.roles, measured)
    return {
        "step": node.name,
        "target_bpw": recipe.target_bpw,
        "lowest_bpw": round(lo, 4),
        "highest_bpw": round(hi, 4),
        "tensors": len(names),
    }


def estimate(m) -> dict:
    """The estimate of a loaded manifest (``manifest.load``) from its source's headers."""
    if not m.source:
        raise UsageError(f"{m.name}: no source; pass --source")
    config, found = source_layout(m.source)
    check_layout(
        config, {n: (None, TensorInfo(n, d, s, 0, nbytes(d, s))) for n, (d, s) in found.items()}
    )
    mlx_tensors: dict[str, dict] = {}
    for hf, (dtype, shape) in found.items():
        for name, mshape, _ in mlx_pieces(hf, shape):
            mlx_tensors[name] = {"dtype": dtype, "shape": tuple(mshape)}
    if not any(ckpt.model_part(k) == "mtp" for k in mlx_tensors) and any(
        n.kind == "graft" for n in m.nodes.values()
    ):
        raise SourceError(f"{m.name} grafts an MTP head but the source has no mtp.* tensors")

    roles_rows: list[dict] = []
    budgets: list[dict] = []
    parts = {p: {"params": 0, "bytes": 0} for p in PARTS}
    tensors = 0
    for node in m.nodes.values():
        if node.kind not in ("quantize", "requantize"):
            continue
        given = _node_inputs(m, node, mlx_tensors)
        roles = assign_roles(sorted(given), node.params)
        if b := _budget(node, given, roles):
            budgets.append(b)
        roles_rows += _role_rows(node, given, roles, parts)
        tensors += len(roles)
    return _summary(m, parts, tensors, roles_rows, budgets)


def _role_rows(node, given: dict, roles: dict[str, str], parts: dict) -> list[dict]:
    """One quantizing node's rows, a role each, largest first; each tensor's params and the
    bytes quantize stores for it are also added to its part of the model in ``parts``."""
    rows: dict[str, dict] = {}
    for name, role_name in sorted(roles.items()):
        role = node.params.recipe.roles[role_name]
        t = given[name]
        n = math.prod(t["shape"])
        # what quantize stores for it (a shape it cannot quantize refused as quantize does)
        size = sum(nbytes(d, s) for d, s in output_shapes(name, t, role).values())
        row = rows.setdefault(
            role_name,
            {
                "step": node.name,
                "role": role_name,
                "bits": None if role.passthrough else role.bits,
                "group_size": None if role.passthrough else role.group_size,
                "tensors": 0,
                "params": 0,
                "bytes": 0,
            },
        )
        row["tensors"] += 1
        row["params"] += n
        row["bytes"] += size
        part = parts[ckpt.model_part(name)]
        part["params"] += n
        part["bytes"] += size
    return sorted(rows.values(), key=lambda r: -r["bytes"])


def _summary(m, parts: dict, tensors: int, roles_rows: list, budgets: list) -> dict:
    def bpw(names) -> float:
        p = sum(parts[n]["params"] for n in names)
        return round(8 * sum(parts[n]["bytes"] for n in names) / p, 4) if p else 0.0

    for name, part in parts.items():
        part["bits_per_weight"] = bpw([name])
    total_bytes = sum(p["bytes"] for p in parts.values())
    out = {
        "variant": m.name,
        "source": m.source,
        "bits_per_weight": bpw(["language_model", "vision_tower"]),  # as mlx_vlm counts
        "bits_per_weight_text": bpw(["language_model"]),  # as mlx_lm counts
        "bytes": total_bytes,  # every published tensor, the head's too
        "bytes_without_head": total_bytes - parts["mtp"]["bytes"],
        "params": sum(p["params"] for p in parts.values()),
        "tensors": tensors,
        "parts": parts,
        "roles": roles_rows,
        "budgets": budgets,
    }
    if not parts["mtp"]["params"]:
        del parts["mtp"]
    return out


def render(e: dict) -> str:
    """The estimate as a table for people."""
    lines = [
        f"{e['variant']} from {e['source']} "
        "(config.json and safetensors headers; no tensor data read)",
        "",
        f"{'step':12} {'role':18} {'bits':>4} {'group':>5} "
        f"{'tensors':>7} {'params':>16} {'bytes':>16}",
    ]
    for r in e["roles"]:
        bits = "bf16" if r["bits"] is None else str(r["bits"])
        group = "" if r["group_size"] is None else str(r["group_size"])
        lines.append(
            f"{r['step']:12} {r['role']:18} {bits:>4} {group:>5} {r['tensors']:>7} "
            f"{r['params']:>16,} {r['bytes']:>16,}"
        )
    for b in e.get("budgets", []):
        lines += [
            "",
            f"{b['step']}: a budget of {b['target_bpw']} bits per weight over its tensors "
            f"(reachable {b['lowest_bpw']:.3f} to {b['highest_bpw']:.3f}) gives the "
            f"{b['tensors']} routed-expert tensors their bits at build time, per layer by "
            "measured sensitivity; the rows above count them at their role's bits"
            + (
                ""
                if b["lowest_bpw"] <= b["target_bpw"]
                else "; the target is below the lowest reachable and the build will refuse it"
            ),
        ]
    lines += ["", f"{'part':18} {'params':>16} {'bytes':>16} {'bits/weight':>11}"]
    for name, p in e["parts"].items():
        lines.append(
            f"{name:18} {p['params']:>16,} {p['bytes']:>16,} {p['bits_per_weight']:>11.3f}"
        )
    lines += [
        "",
        f"bits per weight: {e['bits_per_weight']:.3f} with the vision tower (as mlx_vlm counts), "
        f"{e['bits_per_weight_text']:.3f} text only (as mlx_lm counts)",
        f"size: {e['bytes'] / 1e9:.2f} GB ({e['bytes']:,} bytes of tensors)"
        + (
            f"; without the MTP head {e['bytes_without_head'] / 1e9:.2f} GB, the head "
            f"{e['parts']['mtp']['bytes'] / 1e9:.2f} GB"
            if "mtp" in e["parts"]
            else ""
        ),
    ]
    return "\n".join(lines)
