"""Where a model's weights come from: the store (a step's input artifacts) or a directory
(``buildkit eval``: an MLX directory, or a bf16 source in Hugging Face layout converted
tensor by tensor as sanitize does). Both name tensors as MLX does and read them one at a
time, or in blocks of rows, as numpy storage arrays (``forward`` widens them)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from buildkit.core import keys
from buildkit.core.errors import SourceError, UsageError
from buildkit.core.lazy import lazy
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.convert import (
    mlx_layout,  # the conversion sanitize does, as verify recomputes it
)
from buildkit.formats.tensors import read_header, read_row_blocks, read_tensor

np = lazy("numpy", __name__)

HEAD = ckpt.HEAD_PREFIX  # the MTP head's tensors


class Weights:
    """A model's config, its quantization (as mlx_lm reads it from config.json) and its
    tensors by MLX name, read one at a time as numpy storage arrays."""

    config: dict
    quantization: dict | None
    names: dict[str, str]  # MLX name -> safetensors dtype

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def iter_rows(self, name: str, rows: int, pick=None) -> Iterator[np.ndarray]:
        """A tensor in blocks of ``rows`` along its first axis, read one block at a time;
        ``pick`` (sorted row ids, or None) the rows the reader keeps: the others may hold
        anything (stored tensors are read whole to be checked; a view of a file skips a block
        with none of them; a made one makes only those)."""
        whole = self.read(name)
        for a in range(0, max(whole.shape[0], 1), rows):
            yield whole[a : a + rows]

    def has_head(self) -> bool:
        return any(n.startswith(HEAD) for n in self.names)

    def prefetch(self, prefix: str) -> None:
        """A hint: the tensors under ``prefix`` are read soon (``Store.prefetch``)."""

    def content_id(self, name: str) -> str | None:
        """The tensor's digest as the store names a tensor (equal digests, equal bytes): hashed
        as it is read, a block at a time, once; or None where it cannot be known."""
        hashed = self.__dict__.setdefault("_hashed", {})
        if name not in hashed:
            h = keys.tensor_hasher(self.names[name], self.shapes[name])
            rows = max(1, (64 << 20) // max(nbytes(self, name) // max(self.shapes[name][0], 1), 1))
            for block in self.iter_rows(name, rows) if self.shapes[name] else [self.read(name)]:
                h.update(memoryview(np.ascontiguousarray(block)).cast("B"))
            hashed[name] = keys.finish(h)
        return hashed[name]

    def tokenizer_json(self) -> bytes:
        raise SourceError("no tokenizer.json")

    def bytes(self, part: Callable[[str], bool] = lambda n: True) -> int:
        return sum(nbytes(self, n) for n in self.names if part(n))


def same_tensors(a: Weights, b: Weights, prefix: str) -> bool:
    """Whether ``a`` and ``b`` hold the same tensors under ``prefix``, byte for byte, as their
    ``content_id`` says (where it knows nothing, they are not taken to be the same)."""
    names = sorted(n for n in a.names if n.startswith(prefix))
    if not names or names != sorted(n for n in b.names if n.startswith(prefix)):
        return False
    if any(a.names[n] != b.names[n] or a.shapes[n] != b.shapes[n] for n in names):
        return False  # told apart without a read
    return all((d := a.content_id(n)) is not None and d == b.content_id(n) for n in names)


def nbytes(w: Weights, name: str) -> int:
    return int(np.prod(w.shapes[name])) * {"BF16": 2, "F16": 2, "F32": 4, "U32": 4, "I32": 4}.get(
        w.names[name], 4
    )


class Swapped(Weights):
    """``base`` with some tensors in float32 made a block of rows at a time
    (``blocks[name](rows, pick)`` yields them, only the rows picked made): a sensitivity
    candidate, read as the forward pass reads any model, so a 2 GB lm_head or a layer's
    experts are never whole."""

    def __init__(self, base: Weights, blocks: dict[str, Callable[..., Iterator[np.ndarray]]]):
        self.base, self.blocks = base, blocks
        self.config, self.quantization = base.config, base.quantization
        self.names = base.names | dict.fromkeys(blocks, "F32")
        self.shapes = base.shapes

    def content_id(self, name):
        return None if name in self.blocks else self.base.content_id(name)

    def prefetch(self, prefix):
        self.base.prefetch(prefix)

    def read(self, name):
        if name in self.blocks:
            return np.concatenate(list(self.blocks[name](max(self.shapes[name][0], 1), None)))
        return self.base.read(name)

    def iter_rows(self, name, rows, pick=None):
        if name in self.blocks:
            yield from self.blocks[name](rows, pick)
        else:
            yield from self.base.iter_rows(name, rows, pick)

    def tokenizer_json(self):
        return self.base.tokenizer_json()


class StoreWeights(Weights):
    """Artifacts in the store (sanitize:model, graft, quantize, requantize)."""

    def __init__(
        self, store, arts, config: dict, quantization: dict | None, tokenizer: str | None = None
    ):
        self.store, self.config, self.quantization, self.tok = (
            store,
            config,
            quantization,
            tokenizer,
        )
        self.entries = {k: v for a in arts for k, v in a.tensors.items()}
        self.names = {k: v["dtype"] for k, v in self.entries.items()}
        self.shapes = {k: v["shape"] for k, v in self.entries.items()}

    def read(self, name):
        return self.store.read_tensor(self.entries[name])

    def prefetch(self, prefix):
        self.store.prefetch(e for n, e in self.entries.items() if n.startswith(prefix))

    def content_id(self, name):
        # a stored tensor's entry has it; a view of a source file (sanitize's) is hashed
        return self.entries[name].get("digest") or super().content_id(name)

    def iter_rows(self, name, rows, pick=None):
        e = self.entries[name]
        row = nbytes(self, name) // max(e["shape"][0], 1) if e["shape"] else 1
        yield from self.store.iter_rows(e, rows * max(row, 1), pick)

    def tokenizer_json(self):
        if self.tok is None:
            raise SourceError(
                "the source artifact has no tokenizer.json; "
                "evaluation tokenizes with the source's own"
            )
        return self.store.get_blob(self.tok)


class DirWeights(Weights):
    """A directory of safetensors shards: an MLX model, or (``hf=True``) a Hugging Face bf16
    checkpoint whose tensors are converted to the MLX layout as they are read."""

    def __init__(self, path: Path, hf: bool | None = None):
        self.path = Path(path)
        try:
            self.config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UsageError(
                f"{self.path}: no readable config.json ({e}); point at a model directory"
            ) from None
        self.quantization = self.config.get("quantization")
        self.where: dict[str, tuple] = {}  # MLX name -> (hf name, path, info, slice, shape)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{self.path}: no *.safetensors files")
        for f in files:
            for name, info in read_header(f).tensors.items():
                if hf is None:
                    hf = (
                        name.startswith(("model.language_model.", "mtp."))
                        or name == "lm_head.weight"
                    )
                if not hf:
                    self.where[name] = (None, f, info, None, tuple(info.shape))
                elif not name.startswith("model.visual."):
                    for mlx, shape, slc in ckpt.split_experts(name, info.shape):
                        self.where[mlx] = (name, f, info, slc, shape)
        self.hf = bool(hf)
        self.names = {k: v[2].dtype for k, v in self.where.items()}
        self.shapes = {k: v[4] for k, v in self.where.items()}

    def read(self, name):
        hf, path, info, slc, shape = self.where[name]
        raw = read_tensor(info, path)
        return raw if hf is None else mlx_layout(hf, raw, info.dtype, slc, shape)

    def iter_rows(self, name, rows, pick=None):
        hf, path, info, slc, shape = self.where[name]
        moved = hf is not None and (
            ckpt.is_offset_norm(hf) or ckpt.is_conv1d(hf) or ckpt.is_patch_embed(hf)
        )
        if moved or not shape or (slc is not None and slc[0] == 0):
            yield from super().iter_rows(name, rows, pick)  # small tensors, converted whole
            return
        for arr in read_row_blocks(info, path, shape[0], rows, slc, pick):
            yield arr.reshape(arr.shape[0], *shape[1:])

    def tokenizer_json(self):
        p = self.path / "tokenizer.json"
        if not p.is_file():
            raise UsageError(
                f"{self.path}: no tokenizer.json; evaluation tokenizes with the source's own"
            )
        return p.read_bytes()
