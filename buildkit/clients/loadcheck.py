"""The load check: mlx_lm, the real client of a build, loads the published model and runs it.

A check that passed is remembered in the store, keyed by what mlx_lm reads: the versions of
mlx and mlx_lm, config.json and the tensors of the modules its model has. mlx_lm's model has
no module for the MTP head or the vision tower (its ``sanitize`` drops them), so a build that
changes only those, such as new MTP bits, presents mlx_lm with the bytes of a model it has
loaded before, and the check is not run again. On the real model that saves reading the whole
published model a second time and a forward pass.

Which modules the model has is learnt from mlx_lm itself, on the first check of an
architecture (config.json without its quantization; the mlx and mlx_lm versions), and is only
trusted when every parameter of the loaded model is a published tensor of the same name, that
is when mlx_lm loaded the tensors as they were published rather than renaming or merging them.
Until then, and whenever that does not hold, the key covers every tensor and the whole config.
The records are a cache: ``buildkit gc`` removes them and the next build checks again.

mlx_vlm, the client of the vision tower and of the MTP drafter, is checked in the same step
when it is importable (else a logged note): its model runs an image prompt through the
processor files, the chat template and the vision tower; for an MTP model its drafter loads
from ``mtp/``, keeps the published norms unshifted and drafts a token. Each part is remembered
by what it reads: the model by all but the head (mlx_vlm drops the head too), the drafter by
the head, the trunk's embeddings and lm_head it binds to, and the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from buildkit.core import keys, lazy
from buildkit.core.errors import StepError
from buildkit.core.requires import importable
from buildkit.formats import tensors
from buildkit.formats.checkpoint import DRAFTER_DIR, HEAD_PREFIX
from buildkit.store.store import Store

VERSION = 1
QUANT_KEYS = ("quantization", "quantization_config")
MODULE = "mlx_lm.utils"  # what the check imports: slow, mostly transformers
VLM_MODULES = ("mlx_vlm.utils", "mlx_vlm.speculative.drafters")
IMAGE_SIDE = 64  # pixels: a 4x4 grid of 16-pixel patches, 4 image tokens after the 2x2 merge
BOUND = ("language_model.model.embed_tokens", "language_model.lm_head")  # what the drafter binds to
BLOCK = 16 << 20  # bytes: a module larger runs alone, an embedding or linear one in such blocks


def _versions() -> dict[str, str]:
    return {d: metadata.version(d) for d in ("mlx", "mlx-lm")}


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _arch_key(config: dict) -> str:
    arch = {k: v for k, v in config.items() if k not in QUANT_KEYS}
    return keys.digest_json("loadcheck-modules", [VERSION, _versions(), arch])


def _modules(store: Store, config: dict) -> set[str] | None:
    rec = store.get_memo("loadcheck-modules", _arch_key(config))
    return None if rec is None else set(rec["modules"])


def what_is_read(
    store: Store, config: dict, tensors: dict[str, dict]
) -> tuple[dict, dict[str, dict]]:
    """The config and tensors mlx_lm reads of a model, as far as the store knows (else all)."""
    modules = _modules(store, config)
    if modules is None:
        return config, tensors
    read = {k: v for k, v in tensors.items() if _module(k) in modules}
    cfg = {
        k: {p: q for p, q in v.items() if not isinstance(q, dict) or p in modules}
        if k in QUANT_KEYS and isinstance(v, dict)
        else v
        for k, v in config.items()
    }
    return cfg, read


def memo_key(store: Store, config: dict, tensors: dict[str, dict], writer: dict) -> tuple[str, int]:
    """The key of a passed check of this model and how many of its tensors mlx_lm reads.

    The key covers what mlx_lm reads and ``writer``, the code that wrote the files."""
    cfg, read = what_is_read(store, config, tensors)
    return keys.digest_json("loadcheck", [VERSION, _versions(), writer, cfg, read]), len(read)


def vlm_importable() -> bool:
    return importable("mlx_vlm")


def vlm_keys(
    config: dict, tensors: dict[str, dict], writer: dict, files: dict[str, str] | None = None
) -> dict[str, str]:
    """Memo keys of the mlx_vlm parts this model needs: ``model`` (all but the head, the config
    without the head's entries, the side files: tokenizer, template, processor configs) and,
    for a model with an MTP head, ``drafter``."""
    versions = {d: metadata.version(d) for d in ("mlx", "mlx-vlm")}
    body = {k: v for k, v in tensors.items() if not k.startswith(HEAD_PREFIX)}
    cfg = {
        k: {p: q for p, q in v.items() if not p.startswith(HEAD_PREFIX)}
        if k in QUANT_KEYS and isinstance(v, dict)
        else v
        for k, v in config.items()
    }
    out = {
        "model": keys.digest_json(
            "loadcheck-vlm", [VERSION, versions, writer, cfg, body, files or {}]
        )
    }
    if len(body) < len(tensors):
        read = {
            k: v for k, v in tensors.items() if k.startswith(HEAD_PREFIX) or _module(k) in BOUND
        }
        out["drafter"] = keys.digest_json(
            "loadcheck-drafter", [VERSION, versions, writer, config, read]
        )
    return out


@dataclass
class Lookup:
    """What the store knows of this model's check: its key, how many tensors mlx_lm reads, and
    the record of a passed check mlx_lm would repeat (None: the check has to run); the same for
    each mlx_vlm part, ``vlm`` (empty when mlx_vlm is not importable)."""

    key: str
    n_read: int
    record: dict | None
    vlm: dict[str, tuple[str, dict | None]] = field(default_factory=dict)
    image: bool = True  # False: the source lacks what an image prompt needs; mlx_vlm runs text

    @property
    def to_run(self) -> list[str]:
        """The modules the parts still to run import."""
        vlm = any(rec is None for _, rec in self.vlm.values())
        return ([MODULE] if self.record is None else []) + (list(VLM_MODULES) if vlm else [])


def lookup(
    store: Store,
    config: dict,
    tensors: dict[str, dict],
    writer: dict,
    files: dict[str, str] | None = None,
    image: bool = True,
) -> Lookup:
    """``files``: the side files published with the model (name -> digest); ``image``: whether
    they hold what an image prompt needs (else mlx_vlm's part runs a text prompt)."""
    key, n_read = memo_key(store, config, tensors, writer)
    vlm = {}
    if vlm_importable():
        files = (files or {}) | {"image prompt": image}
        vlm = {
            part: (k, store.get_memo(f"loadcheck-{part}", k))
            for part, k in vlm_keys(config, tensors, writer, files).items()
        }
    return Lookup(key, n_read, store.get_memo("loadcheck", key), vlm, image)


_warming: list = []  # the futures of warm's imports, waited for before the check imports


def warm(modules: list[str] | None = None) -> None:
    """Import mlx_lm (and mlx_vlm) on a spare thread (slow: mostly transformers) for a check to
    come."""
    _warming.append(lazy.import_ahead(modules or [MODULE]))


def _imported() -> None:
    # Importing a package while another thread is still initialising it can hand back the
    # half-made module (mlx_vlm's circular imports do): let the spare thread finish first.
    while _warming:
        with contextlib.suppress(Exception):
            _warming.pop().result()


def check(
    store: Store,
    path: Path,
    config: dict,
    tensors: dict[str, dict],
    writer: dict,
    found: Lookup,
    log: Callable[[str], None],
) -> bool:
    """Check the model at ``path`` unless mlx_lm has loaded the same bytes before; True if run.

    ``config`` and ``tensors`` (name -> store entry) describe what ``path`` holds; ``writer``
    names the code that wrote it (a step kind and version); ``found`` is ``lookup``'s answer
    for them, asked before the files were written (to import mlx_lm meanwhile, or not)."""
    _imported()
    ran = _check_mlx_lm(store, path, config, tensors, writer, found, log)
    return _check_vlm(store, path, found, log) or ran


def _check_mlx_lm(
    store: Store,
    path: Path,
    config: dict,
    tensors: dict[str, dict],
    writer: dict,
    found: Lookup,
    log,
) -> bool:
    if found.record is not None:
        log(
            f"load check: not run again: the {found.n_read} of {len(tensors)} tensors mlx_lm reads "
            f"(its model has no module for the rest) and the config it reads are those of a model "
            f"it loaded before ({found.record.get('shape')} logits, finite)"
        )
        return False
    key = found.key
    res = check_loads(path)
    names = res["parameters"]
    if names <= set(tensors):  # loaded as published: no tensor renamed or merged
        arch = _arch_key(config)
        store.put_memo("loadcheck-modules", arch, {"modules": sorted({_module(n) for n in names})})
        key, _ = memo_key(store, config, tensors, writer)
    log(
        f"load check: mlx_lm loaded the model and ran a token in {res['dtype']}: "
        f"{res['logits_shape']} logits, finite"
    )
    store.put_memo("loadcheck", key, {"shape": res["logits_shape"]})
    return True


class _Streamed:
    """A module that runs once: its output is evaluated and its weights let go."""

    def __init__(self, module, name: str = ""):
        self.__dict__.update(module=module, name=name)

    def __getattr__(self, attr):
        if "module" not in self.__dict__:
            raise AttributeError(f"{self.__dict__['name']} has run and let its weights go")
        return getattr(self.__dict__["module"], attr)

    def __call__(self, *args, **kwargs):
        import mlx.core as mx

        module = self.__dict__.pop("module", None)
        if module is None:  # the check streams each module once: this model runs one twice
            raise RuntimeError(
                f"{self.__dict__['name']} ran twice in one pass; its weights are gone"
            )
        out = module(*args, **kwargs)
        mx.eval(out)
        return out


def _load_rows(module, infos: dict, rows) -> None:
    """Give ``module`` the published rows ``rows`` (sorted numbers along the first axis) of each
    parameter in ``infos`` (name -> (file, TensorInfo)), in the dtype the parameter has now."""
    import mlx.core as mx
    import numpy as np

    params = {}
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)  # consecutive rows, one read
    for k, (file, info) in infos.items():
        parts = [tensors.read_slice(info, file, 0, int(r[0]), int(r[-1]) + 1) for r in runs]
        params[k] = tensors.to_mlx(np.concatenate(parts), info.dtype).astype(module[k].dtype)
    module.update(params)
    mx.eval(module.parameters())


class _Experts:
    """A mixture of experts' stacked projections (mlx's SwitchGLU: gate, up and down, each
    [experts, ...]) run with only the experts its tokens are routed to, read from the published
    file. The indices are renumbered over those experts, so each token meets the same expert
    weights on whatever path the module's own code takes, and the output is the whole module's
    bit for bit; the other experts are never read (a token reads 8 of the real model's 256,
    where a whole projection is ~0.2 GB)."""

    def __init__(self, module, name: str, projs: dict[str, dict]):
        unread = {key: {k: module[key][k] for k in infos} for key, infos in projs.items()}
        self.__dict__.update(module=module, name=name, projs=projs, unread=unread)

    def __getattr__(self, attr):
        return getattr(self.__dict__["module"], attr)

    def __call__(self, x, indices, *args, **kwargs):
        import mlx.core as mx
        import numpy as np

        d = self.__dict__
        ids = np.array(indices)
        experts, inverse = np.unique(ids, return_inverse=True)
        try:
            for key, infos in d["projs"].items():
                _load_rows(d["module"][key], infos, experts)
            renumbered = mx.array(inverse.reshape(ids.shape).astype(ids.dtype))
            out = d["module"](x, renumbered, *args, **kwargs)
            mx.eval(out)
        finally:  # the experts go; the projections' shapes are the published ones again
            for key, params in d["unread"].items():
                d["module"][key].update(params)
        return out


def _expert_projections(module, name: str, published: dict) -> dict[str, dict] | None:
    """A SwitchGLU-like module's stacked projections (child key -> its parameters' published
    file and place), if each is published under its name and shape; else None."""
    import mlx.core as mx

    projs = {
        key: child
        for key, child in module.children().items()
        if type(child).__name__.endswith("SwitchLinear")
    }
    if not projs:
        return None
    out = {}
    for key, child in projs.items():
        params = {k: v for k, v in child.items() if isinstance(v, mx.array)}
        infos = {k: published.get(f"{name}.{key}.{k}") for k in params}
        if not all(
            info is not None and info[1].shape == tuple(params[k].shape)
            for k, info in infos.items()
        ):
            return None
        out[key] = infos
    return out


class _Rows:
    """An embedding or linear layer run from the published file in blocks of rows: an embedding
    reads only the rows of its tokens, a linear layer (or ``as_linear``) one block at a time.
    Each block goes through the module's own code, in the dtype its parameters have now (float32
    on the CPU), so the output is the whole layer's, bit for bit; the whole is never held."""

    def __init__(self, module, name: str, infos: dict, block: int):
        rows = next(iter(infos.values()))[1].shape[0]
        per_row = sum(info.nbytes for _, info in infos.values()) // rows
        self.__dict__.update(
            module=module, name=name, infos=infos, rows=rows, step=max(1, block // per_row)
        )
        self.__dict__["unread"] = {k: module[k] for k in infos}  # lazy: they hold no data

    def __getattr__(self, attr):
        return getattr(self.__dict__["module"], attr)

    def _load(self, rows) -> None:
        _load_rows(self.__dict__["module"], self.__dict__["infos"], rows)

    def __call__(self, x):
        import mlx.core as mx
        import mlx.nn as nn
        import numpy as np

        module = self.__dict__["module"]
        if not isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            return self._blocks("__call__", x)
        ids = np.array(x)
        rows, inverse = np.unique(ids, return_inverse=True)
        try:
            self._load(rows)
            out = module(mx.array(inverse.reshape(ids.shape).astype(np.int32)))
            mx.eval(out)
        finally:  # the rows go; the module's shapes and dtypes are the published ones again
            module.update(self.__dict__["unread"])
        return out

    def as_linear(self, x):
        return self._blocks("as_linear", x)

    def _blocks(self, method: str, x):
        import mlx.core as mx
        import numpy as np

        d, outs = self.__dict__, []
        try:
            for start in range(0, d["rows"], d["step"]):
                self._load(np.arange(start, min(start + d["step"], d["rows"])))
                outs.append(getattr(d["module"], method)(x))
                mx.eval(outs[-1])
        finally:
            d["module"].update(d["unread"])
        return mx.concatenate(outs, axis=-1)


def _published(path: Path) -> dict[str, tuple[Path, tensors.TensorInfo]]:
    """Each published tensor's file and place in it, from the safetensors headers."""
    files = sorted(path.glob("*.safetensors"))
    return {n: (f, info) for f in files for n, info in tensors.read_header(f).tensors.items()}


def _stream(model, path: Path, block: int) -> None:
    """Make a forward pass of ``model`` hold one module's weights at a time, not the model's.

    Each module of a list (decoder layers, vision blocks), and any module of more than
    ``block`` bytes of parameters (at the real model's scale a routed-expert projection,
    ~0.2 GB), runs once, is evaluated and lets its weights go. Such a module that is an
    embedding or linear layer published under its name and shape (embed_tokens and lm_head,
    ~0.5 and 1 GB, 2 GB in float32; the larger projections) is run from the file in blocks of
    ``block`` bytes instead, and may run more than once. A mixture of experts published
    under its names and shapes reads only the experts its tokens are routed to (``_Experts``):
    the routed experts are ~80% of the real model, and a check's few tokens reach a few."""
    import mlx.core as mx
    import mlx.nn as nn

    published = _published(path)
    for prefix, parent in model.named_modules():  # mixtures of experts: the routed ones only
        for key, child in list(parent.items()):
            if isinstance(child, nn.Module):
                name = f"{prefix}.{key}" if prefix else key
                projs = _expert_projections(child, name, published)
                if projs is not None:
                    parent[key] = _Experts(child, name, projs)
    for prefix, parent in model.named_modules():
        for key, child in list(parent.items()):
            for i, m in enumerate(child) if isinstance(child, list) else [(None, child)]:
                if not isinstance(m, nn.Module) or _has_modules(m):
                    continue
                name = ".".join(p for p in (prefix, key, None if i is None else str(i)) if p)
                params = {k: v for k, v in m.items() if isinstance(v, mx.array)}
                size = sum(v.nbytes for v in params.values())
                if size <= block:
                    continue
                infos = {k: published.get(f"{name}.{k}") for k in params}
                rows = isinstance(
                    m, nn.Linear | nn.QuantizedLinear | nn.Embedding | nn.QuantizedEmbedding
                ) and all(
                    info is not None
                    and info[1].shape == tuple(params[k].shape)
                    and info[1].shape[0] == params["weight"].shape[0]
                    for k, info in infos.items()
                )
                wrapped = _Rows(m, name, infos, block) if rows else _Streamed(m, name)
                if i is None:
                    parent[key] = wrapped
                else:
                    child[i] = wrapped
    for prefix, parent in model.named_modules():  # stacks: decoder layers, vision blocks
        for key, child in parent.items():
            if isinstance(child, list):
                child[:] = [
                    _Streamed(m, ".".join(p for p in (prefix, key, str(i)) if p))
                    if isinstance(m, nn.Module)
                    else m
                    for i, m in enumerate(child)
                ]


def _has_modules(m) -> bool:
    from mlx.utils import tree_flatten

    return len(tree_flatten(m.children())) > 0


def check_loads(path: Path, block: int = BLOCK) -> dict:
    """Load with mlx_lm (the real client) and run a forward pass; logits must be finite.

    The model is loaded lazily (mlx_lm's strict load still checks every key and shape) and
    the pass is streamed (``_stream``): each module's weights are read just before it runs and
    freed just after, the embedding and the head in blocks of rows, so memory is about the
    largest module or ``block`` bytes, not the model, whatever the vocabulary.

    On the CPU the pass runs in float32: mlx emulates bfloat16 arithmetic there, about four
    times slower (measured before RESULTS.md kept only the latest: `git log -S emulates
    bench/RESULTS.md`). The floating-point parameters (norms, scales, biases, bf16
    weights) are widened as they are read; packed weights are untouched, and bfloat16 has
    float32's exponent range, so a value that overflows one overflows the other. On a GPU the
    model runs as mlx_lm runs it.
    Returns the logits (their shape and dtype) and the names of the loaded model's parameters.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path, lazy=True)
        names = {k for k, _ in tree_flatten(model.parameters())}
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)  # floating-point parameters only (mlx's default predicate)
        _stream(model, path, block)
        logits = model(mx.array([[1]]))  # one token: each costs seconds on the CPU
        mx.eval(logits)
    except Exception as e:  # any failure to load is a failed publish, with mlx_lm's words
        raise StepError(f"mlx_lm cannot load the published model: {type(e).__name__}: {e}") from e
    if not bool(mx.isfinite(logits).all().item()):
        raise StepError("mlx_lm loads the published model but its logits are not finite")
    return {
        "logits": logits,
        "logits_shape": list(logits.shape),
        "dtype": str(logits.dtype).removeprefix("mlx.core."),
        "parameters": names,
    }


def _check_vlm(store: Store, path: Path, found: Lookup, log: Callable[[str], None]) -> bool:
    if not found.vlm:
        log(
            "client check: mlx_vlm is not installed: the image prompt and the MTP drafter are not "
            "checked (install mlx-vlm to check them)"
        )
        return False
    ran = False
    for part, (key, record) in found.vlm.items():
        what = (
            ("image prompt" if found.image else "text prompt")
            if part == "model"
            else f"MTP drafter {DRAFTER_DIR}/"
        )
        if record is not None:
            log(
                f"client check (mlx_vlm, {what}): not run again: mlx_vlm read the same bytes "
                f"before ({record['summary']})"
            )
            continue
        res = check_vlm_loads(path, found.image) if part == "model" else check_drafter_loads(path)
        log(f"client check (mlx_vlm, {what}): {res['summary']}")
        store.put_memo(f"loadcheck-{part}", key, {"summary": res["summary"]})
        ran = True
    return ran


def _test_image():
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE]
    rgb = np.stack([x * 4, y * 4, (x + y) * 2], axis=-1) % 256
    return Image.fromarray(rgb.astype(np.uint8))


def check_vlm_loads(path: Path, image: bool = True, block: int = BLOCK) -> dict:
    """Load with mlx_vlm and run an image prompt: the chat template must place the image, the
    processor make pixels of it, the tokenizer's image token match ``image_token_id``, and the
    vision tower and the language model give finite logits on the prompt's image span
    (``_image_span``; ``image=False``: a text prompt).
    Streamed, vision tower included, in float32 on the CPU, as ``check_loads``. Returns a
    summary and the logits."""
    import mlx.core as mx
    from mlx_vlm.utils import load

    try:
        model, processor = load(str(path), lazy=True)
        inputs, n_prompt, n_image = _vlm_inputs(processor, model.config, image)
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)
        _stream(model, path, block)
        extra = {
            k: v
            for k, v in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        ids = inputs["input_ids"]
        out = model(ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra)
        logits = getattr(out, "logits", out)
        mx.eval(logits)
    except StepError:
        raise
    except Exception as e:
        raise StepError(
            f"mlx_vlm cannot run {'an image' if image else 'a text'} prompt on the published "
            f"model: {type(e).__name__}: {e}"
        ) from e
    if not bool(mx.isfinite(logits).all().item()):
        raise StepError(
            "mlx_vlm runs a prompt on the published model but its logits are not finite"
        )
    if not image:
        return {
            "summary": f"{list(logits.shape)} logits, finite "
            "(no image: the source lacks processor files)",
            "logits": logits,
        }
    grid = inputs["image_grid_thw"].tolist()[0]
    return {
        "summary": f"{IMAGE_SIDE}x{IMAGE_SIDE} image as a {grid} patch grid, "
        f"{n_image} image tokens in a {n_prompt}-token templated prompt; its image span run: "
        f"{list(logits.shape)} logits, finite",
        "logits": logits,
    }


def _vlm_inputs(processor, cfg, image: bool) -> tuple[dict, int, int]:
    """(mlx_vlm's model inputs, the templated prompt's tokens, its image tokens) for the test
    image's prompt (its image span only) or, without ``image``, a text prompt."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    image_token = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", None)
    if image:
        prompt = apply_chat_template(processor, cfg, "Describe the image.", num_images=1)
        inputs = prepare_inputs(
            processor, images=[_test_image()], prompts=prompt, image_token_index=image_token
        )
    else:
        inputs = prepare_inputs(processor, prompts="Hello")
    ids = inputs["input_ids"]
    n_image = int((ids == image_token).sum().item()) if image_token is not None else 0
    if image and n_image == 0:
        raise StepError(
            f"the image prompt holds no image token (id {image_token}): check the chat "
            "template, preprocessor_config.json and the tokenizer's <|image_pad|> against "
            "config.json"
        )
    if image:  # the forward runs the image's span: on a CPU each text token costs seconds
        return _image_span(inputs, image_token), ids.shape[-1], n_image
    return inputs, ids.shape[-1], n_image


def _image_span(inputs: dict, image_token: int) -> dict:
    """The templated prompt cut to its image: the image tokens and the token on each side of
    them (the vision start and end markers), with the same pixels. The vision tower's features
    and the language model's image positions are the whole prompt's; the template's text (28
    tokens of the 32 here, each seconds of CPU through the real model) is not run."""
    import mlx.core as mx
    import numpy as np

    where = np.flatnonzero(np.array(inputs["input_ids"][0]) == image_token)
    lo, hi = max(int(where[0]) - 1, 0), int(where[-1]) + 2
    out = dict(inputs)
    for k in ("input_ids", "attention_mask"):
        if out.get(k) is not None:
            out[k] = mx.array(inputs[k][:, lo:hi])
    return out


def check_drafter_loads(path: Path, block: int = BLOCK) -> dict:
    """Load the MTP head from ``path/mtp`` with mlx_vlm's drafter loader, check that its norms are
    the published ones (mlx_vlm did not shift them again), bind it to the model and draft a
    token. Lazily and streamed, as ``check_loads``: the head's experts are 0.7 GB in the real
    model and a token reads 8 of its 256."""
    import mlx.core as mx
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    where = path / DRAFTER_DIR
    try:
        drafter, kind = load_drafter(str(where), kind="mtp", lazy=True)
        if kind != "mtp":
            raise StepError(f"mlx_vlm takes {where} for a {kind!r} drafter, not 'mtp'")
        # the file's norms under the names the drafter's loader maps them to (it strips a
        # Hugging Face ``mtp.``), read alone: the whole head is 0.7 GB in the real model
        shard = where / "model.safetensors"
        published = {
            k.removeprefix("mtp."): tensors.to_mlx(tensors.read_tensor(info, shard), info.dtype)
            for k, info in tensors.read_header(shard).tensors.items()
            if k.endswith(".weight") and "norm" in k.rsplit(".", 2)[-2]
        }
        params = dict(_flatten(drafter.parameters()))
        norms = sorted(published)
        moved = [k for k in norms if not bool(mx.array_equal(params[k], published[k]).item())]
        if moved:
            raise StepError(
                f"mlx_vlm changes {len(moved)} of the drafter's norms as it loads them "
                f"({', '.join(sorted(moved))}): "
                "it takes them for Hugging Face offsets and shifts them again"
            )
        _stream(drafter, where, block)  # its routed experts: the ones its token goes to
        target = load_model(path, lazy=True)
        _stream(target, path, block)  # the drafter runs the target's embeddings and lm_head
        drafter.reset(target)
        hidden = mx.ones((1, 1, drafter.fc.weight.shape[0]), dtype=mx.float32)
        logits = drafter._lm_head_fn(drafter._forward_tokens(mx.array([[1]]), hidden, mx.int32))
        mx.eval(logits)
    except StepError:
        raise
    except Exception as e:
        raise StepError(
            f"mlx_vlm cannot load or run the MTP drafter in {where}: {type(e).__name__}: {e}"
        ) from e
    if not bool(mx.isfinite(logits).all().item()):
        raise StepError(f"mlx_vlm's MTP drafter from {where} drafts non-finite logits")
    return {
        "summary": f"loaded as kind 'mtp', {len(norms)} norms as published, drafted a token: "
        f"{list(logits.shape)} logits, finite",
        "logits": logits,
    }


def _flatten(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)
