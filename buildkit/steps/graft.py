"""graft: put an MTP head (native or from a donor) into the MLX layout of a trunk.

``mtp.*`` becomes ``language_model.mtp.*``; the fused ``experts.gate_up_proj``
splits into gate (first half of rows) and up; the seven offset norms are
written shifted, ``round_bf16(w + 1)``, exactly once. A donor head must agree
with the trunk on every field of ``checkpoint.head_signature``; a mismatch is
refused with each differing field listed.
"""

from __future__ import annotations

from buildkit.core.errors import SourceError
from buildkit.engine.step import Context, Params, Slot, Step, register
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.convert import mlx_pieces, sanitize_tensor
from buildkit.formats.tensors import TensorInfo
from buildkit.store.artifact import Artifact


class GraftParams(Params):
    pass


def check_compatible(trunk_cfg: dict, head_cfg: dict) -> dict:
    a, b = ckpt.head_signature(trunk_cfg), ckpt.head_signature(head_cfg)
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    if diff:
        lines = "; ".join(f"{k}: trunk {x} vs head {y}" for k, (x, y) in sorted(diff.items()))
        raise SourceError(
            f"MTP head is incompatible with the trunk ({len(diff)} field(s) differ): {lines}"
        )
    return a


@register
class Graft(Step):
    kind = "graft"
    version = 1
    Params = GraftParams
    inputs = {"head": Slot(), "trunk": Slot()}

    def run(self, ctx: Context, params: GraftParams, inputs) -> dict[str, Artifact]:
        head, trunk = inputs["head"][0], inputs["trunk"][0]
        signature = check_compatible(trunk.meta["config"], head.meta["config"])
        if not head.tensors:
            raise SourceError(
                "the head artifact holds no mtp.* tensors (config has mtp_num_hidden_layers = 0?)"
            )
        out = Artifact(meta={"signature": signature, "fused": {}})
        ctx.progress.start(len(head.tensors))
        for name, entry in sorted(head.tensors.items()):
            v = entry["view"]
            info = TensorInfo(v["tensor"], entry["dtype"], tuple(entry["shape"]), 0, 0)
            pieces = sanitize_tensor(ctx.store, name, v["file"], info)
            for mlx_name, e in pieces:
                out.tensors[mlx_name] = e
            if len(pieces) > 1:
                out.meta["fused"][name] = [p[0] for p in pieces]
            ctx.progress.advance(1)
        ctx.log(f"{len(head.tensors)} head tensors -> {len(out.tensors)} (fused experts split)")
        return {"out": out}

    def estimate(self, params: GraftParams, inputs) -> dict[str, dict]:
        """The head's MLX names and shapes, as ``run`` makes them (fused experts split)."""
        head = inputs["head"][0]
        if not head["tensors"]:
            raise SourceError("graft: the source has no mtp.* tensors (no MTP head to graft)")
        tensors = {}
        for name, t in sorted(head["tensors"].items()):
            for mlx_name, mshape, _ in mlx_pieces(name, tuple(t["shape"])):
                tensors[mlx_name] = {"dtype": t["dtype"], "shape": tuple(mshape)}
        return {"out": {"config": head["config"], "tensors": tensors}}
