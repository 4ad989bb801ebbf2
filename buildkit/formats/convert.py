"""HF tensor -> MLX tensor entries: the per-tensor conversions sanitize and graft share.

Pure renames, the experts split and the conv1d move are *views* (byte ranges of
a source file named by its content digest); offset norms and the vision patch
embedding change bytes and are written to the store.
"""

from __future__ import annotations

from buildkit.core.lazy import lazy
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.tensors import TensorInfo, from_float32, from_mlx, to_float32, to_mlx

np = lazy("numpy", __name__)


def view(digest: str, info: TensorInfo, shape=None, slc=None) -> dict:
    v = {"file": digest, "tensor": info.name}
    if slc is not None:
        v["slice"] = list(slc)
    return {"dtype": info.dtype, "shape": list(shape or info.shape), "view": v}


def shift_norm(store, entry: dict) -> dict:
    """round(w + 1) in the tensor's own dtype, computed in float32 as mlx does."""
    w = store.read_tensor(entry)
    return store.put_tensor(
        entry["dtype"],
        from_float32(to_float32(w, entry["dtype"]) + np.float32(1.0), entry["dtype"]),
    )


def mlx_pieces(
    name: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...], tuple[int, int, int] | None]]:
    """(MLX name, shape, slice) of what one HF tensor becomes, from its name and shape alone
    (``buildkit estimate`` plans from headers with it; ``sanitize_tensor`` makes the entries)."""
    if ckpt.is_conv1d(name):
        C, one, K = shape
        return [(ckpt.mlx_name(name), (C, K, one), None)]
    if ckpt.is_patch_embed(name) and len(shape) == 5:
        o, c, t, h, w = shape
        return [(ckpt.mlx_name(name), (o, t, h, w, c), None)]
    return ckpt.split_experts(name, tuple(shape))


def sanitize_tensor(store, name: str, digest: str, info: TensorInfo) -> list[tuple[str, dict]]:
    """(MLX name, entry) pieces for one HF tensor of the trunk, vision tower or MTP head."""
    pieces = mlx_pieces(name, info.shape)
    if ckpt.is_offset_norm(name):
        return [(pieces[0][0], shift_norm(store, view(digest, info)))]
    if ckpt.is_patch_embed(name) and len(info.shape) == 5:
        w = store.read_tensor(view(digest, info))
        return [(pieces[0][0], store.put_tensor(info.dtype, w.transpose(0, 2, 3, 4, 1)))]
    return [(mlx, view(digest, info, shape, slc)) for mlx, shape, slc in pieces]


def mlx_layout(hf: str, raw: np.ndarray, dtype: str, slc, shape) -> np.ndarray:
    """The MLX-layout tensor computed from a raw source tensor the way mlx_lm does (verify and
    eval recompute references with it from the raw source)."""
    if ckpt.is_offset_norm(hf):
        return from_mlx(to_mlx(raw, dtype) + 1.0)[0]
    if ckpt.is_conv1d(hf):
        return np.ascontiguousarray(np.moveaxis(raw, 2, 1))  # mlx_lm: [C, 1, K] -> [C, K, 1]
    if ckpt.is_patch_embed(hf) and raw.ndim == 5:
        return raw.transpose(0, 2, 3, 4, 1)
    if slc is not None:
        axis, a, b = slc
        idx = [slice(None)] * raw.ndim
        idx[axis] = slice(a, b)
        raw = raw[tuple(idx)]
    return np.ascontiguousarray(raw).reshape(shape)
