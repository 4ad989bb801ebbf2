"""sanitize: the HF checkpoint -> exactly what mlx_lm's qwen3_5_moe sanitize produces.

Text keys become ``language_model.*``, fused experts split into switch_mlp
gate/up (gate first) and down, conv1d moves to [C, K, 1], offset norms become
``round_bf16(w + 1)``; the vision tower is kept (bf16) under mlx_vlm's
``vision_tower.*`` names; the MTP head is set aside, untouched, as output
``mtp``. Renames, splits and the conv1d move are byte views into the source
files; only the tensors whose bytes change are written to the store.
"""

from __future__ import annotations

from buildkit.engine.step import Context, Params, Slot, Step, register
from buildkit.formats.checkpoint import check_layout, load_config, scan_source
from buildkit.formats.convert import mlx_pieces, sanitize_tensor, view
from buildkit.formats.tensors import TensorInfo, nbytes
from buildkit.store.artifact import Artifact


class SanitizeParams(Params):
    pass


@register
class Sanitize(Step):
    kind = "sanitize"
    version = 1
    Params = SanitizeParams
    inputs = {"source": Slot()}
    outputs = ("model", "mtp")

    def run(self, ctx: Context, params: SanitizeParams, inputs) -> dict[str, Artifact]:
        src = inputs["source"][0]
        config = load_config(ctx.store, src)
        found = scan_source(ctx.store, src)
        check_layout(config, found)
        side_files = {k: v for k, v in src.files.items() if k != "model.safetensors.index.json"}
        model = Artifact(files=dict(side_files), meta={"config": config})
        mtp = Artifact(files={"config.json": src.files["config.json"]}, meta={"config": config})
        ctx.progress.start(len(found))
        for name in sorted(found):
            digest, info = found[name]
            if name.startswith("mtp."):
                mtp.tensors[name] = view(digest, info)
            else:
                for mlx_name, entry in sanitize_tensor(ctx.store, name, digest, info):
                    model.tensors[mlx_name] = entry
            ctx.progress.advance(1, info.nbytes)
        return {"model": model, "mtp": mtp}

    def estimate(self, params: SanitizeParams, inputs) -> dict[str, dict]:
        """What ``run`` makes of the source's layout: MLX names and shapes, the head aside."""
        src = inputs["source"][0]
        found = {n: (t["dtype"], tuple(t["shape"])) for n, t in src["tensors"].items()}
        check_layout(
            src["config"],
            {n: (None, TensorInfo(n, d, s, 0, nbytes(d, s))) for n, (d, s) in found.items()},
        )
        model, mtp = {}, {}
        for name, (dtype, shape) in sorted(found.items()):
            if name.startswith("mtp."):
                mtp[name] = {"dtype": dtype, "shape": shape}
                continue
            for mlx_name, mshape, _ in mlx_pieces(name, shape):
                model[mlx_name] = {"dtype": dtype, "shape": tuple(mshape)}
        config = src["config"]
        return {
            "model": {"config": config, "tensors": model},
            "mtp": {"config": config, "tensors": mtp},
        }
