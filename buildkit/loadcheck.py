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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import keys, lazy
from .errors import StepError
from .store import Store

VERSION = 1
QUANT_KEYS = ("quantization", "quantization_config")
MODULE = "mlx_lm.utils"  # what the check imports: ~1 s, mostly transformers


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


def what_is_read(store: Store, config: dict, tensors: dict[str, dict]) -> tuple[dict, dict[str, dict]]:
    """The config and tensors mlx_lm reads of a model, as far as the store knows (else all)."""
    modules = _modules(store, config)
    if modules is None:
        return config, tensors
    read = {k: v for k, v in tensors.items() if _module(k) in modules}
    cfg = {
        k: {p: q for p, q in v.items() if not isinstance(q, dict) or p in modules} if k in QUANT_KEYS and isinstance(v, dict) else v
        for k, v in config.items()
    }
    return cfg, read


def memo_key(store: Store, config: dict, tensors: dict[str, dict], writer: dict) -> tuple[str, int]:
    """The key of a passed check of this model and how many of its tensors mlx_lm reads.

    The key covers what mlx_lm reads and ``writer``, the code that wrote the files."""
    cfg, read = what_is_read(store, config, tensors)
    return keys.digest_json("loadcheck", [VERSION, _versions(), writer, cfg, read]), len(read)


@dataclass
class Lookup:
    """What the store knows of this model's check: its key, how many tensors mlx_lm reads, and
    the record of a passed check mlx_lm would repeat (None: the check has to run)."""

    key: str
    n_read: int
    record: dict | None


def lookup(store: Store, config: dict, tensors: dict[str, dict], writer: dict) -> Lookup:
    key, n_read = memo_key(store, config, tensors, writer)
    return Lookup(key, n_read, store.get_memo("loadcheck", key))


def warm() -> None:
    """Import mlx_lm on a spare thread (~1.2 s, mostly transformers) for a check to come."""
    lazy.import_ahead([MODULE])


def check(
    store: Store, path: Path, config: dict, tensors: dict[str, dict], writer: dict, found: Lookup, log: Callable[[str], None]
) -> bool:
    """Check the model at ``path`` unless mlx_lm has loaded the same bytes before; True if run.

    ``config`` and ``tensors`` (name -> store entry) describe what ``path`` holds; ``writer``
    names the code that wrote it (a step kind and version); ``found`` is ``lookup``'s answer
    for them, asked before the files were written (to import mlx_lm meanwhile, or not)."""
    if found.record is not None:
        log(f"load check: not run again: the {found.n_read} of {len(tensors)} tensors mlx_lm reads (its model has no "
            f"module for the rest) and the config it reads are those of a model it loaded before "
            f"({found.record.get('shape')} logits, finite)")
        return False
    key = found.key
    res = check_loads(path)
    names = res["parameters"]
    if names <= set(tensors):  # loaded as published: no tensor renamed or merged
        arch = _arch_key(config)
        store.put_memo("loadcheck-modules", arch, {"modules": sorted({_module(n) for n in names})})
        key, _ = memo_key(store, config, tensors, writer)
    log(f"load check: mlx_lm loaded the model and ran a token in {res['dtype']}: {res['logits_shape']} logits, finite")
    store.put_memo("loadcheck", key, {"shape": res["logits_shape"]})
    return True


class _Streamed:
    """A decoder layer that runs once, evaluates its output and lets its weights go."""

    def __init__(self, layer):
        self.__dict__["layer"] = layer

    def __getattr__(self, name):
        return getattr(self.__dict__["layer"], name)

    def __call__(self, *args, **kwargs):
        import mlx.core as mx

        out = self.__dict__.pop("layer")(*args, **kwargs)
        mx.eval(out)
        return out


def check_loads(path: Path) -> dict:
    """Load with mlx_lm (the real client) and run a forward pass; logits must be finite.

    The model is loaded lazily (mlx_lm's strict load still checks every key and shape) and
    the pass is evaluated layer by layer, each layer's weights read just before it runs and
    freed just after: memory is one layer plus embeddings and head, not the model.

    On the CPU the pass runs in float32: mlx emulates bfloat16 arithmetic there, about four
    times slower (bench/RESULTS.md). The floating-point parameters (norms, scales, biases) are widened as they are read; packed
    weights are untouched, and bfloat16 has float32's exponent range, so a value that
    overflows one overflows the other. On a GPU the model runs as mlx_lm runs it.
    Returns the logits' shape and dtype and the names of the loaded model's parameters.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path, lazy=True)
        names = {k for k, _ in tree_flatten(model.parameters())}
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)  # floating-point parameters only (mlx's default predicate)
        for m in model.modules():
            if isinstance(m.get("layers"), list):
                m["layers"][:] = [_Streamed(layer) for layer in m["layers"]]
        logits = model(mx.array([[1]]))  # one token: mlx on CPU costs ~2 s a token on a 2 GB model
        mx.eval(logits)
    except Exception as e:  # any failure to load is a failed publish, with mlx_lm's words
        raise StepError(f"mlx_lm cannot load the published model: {type(e).__name__}: {e}") from e
    if not bool(mx.isfinite(logits).all().item()):
        raise StepError("mlx_lm loads the published model but its logits are not finite")
    return {"logits_shape": list(logits.shape), "dtype": str(logits.dtype).removeprefix("mlx.core."), "parameters": names}
