"""The trained fixture: a small qwen3_5_moe checkpoint whose trunk and MTP head learnt real text.

``buildkit/data/trained/`` holds what training/train_fixture.py wrote: the text and ``mtp.*``
tensors in Hugging Face names, shapes and bf16 (``weights.safetensors``), the tokenizer trained
on the same corpus, a few held-out lines and the figures measured (``meta.json``). Everything
else (config, generation config, tokenizer config, shards, index, the vision tower's random
weights) comes from ``fixture.generate`` with ``SPEC``, so the layout is the generator's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import keys
from .errors import SourceError
from .fixture import FixtureSpec, _plan, generate
from .tensors import read_header, read_tensor

DATA = Path(__file__).parent / "data" / "trained"
SPEC = FixtureSpec(vocab=2048)  # the generator's default shape with a larger vocabulary


def write_trained(
    out: str | Path, data: Path = DATA, progress: Callable[[str], None] | None = None
) -> Path:
    """Write the trained checkpoint in full Hugging Face layout to ``out`` and return its path.

    Deterministic: the same data gives byte-identical files. Raises ``FileExistsError`` if
    ``out`` exists and is not an empty directory, ``SourceError`` if ``data`` lacks a tensor.
    """
    header = read_header(data / "weights.safetensors")
    want = {t.name for t, _ in _plan(SPEC) if not t.name.startswith("model.visual.")}
    missing, extra = sorted(want - set(header.tensors)), sorted(set(header.tensors) - want)
    bad = [n for n, i in header.tensors.items() if i.dtype != "BF16"]
    if missing or extra or bad:
        raise SourceError(
            f"{data / 'weights.safetensors'}: missing {missing[:4]}, unexpected {extra[:4]}, "
            f"not BF16 {bad[:4]}; rerun training/train_fixture.py"
        )
    weights = {n: read_tensor(i, header.path) for n, i in header.tensors.items()}
    tokenizer = (data / "tokenizer.json").read_text()
    return generate(out, SPEC, progress, tokenizer=tokenizer, weights=weights)


def data_digest(data: Path = DATA) -> str:
    """Short digest of the shipped files: a changed ``data`` is written anew, never reused."""
    files = {
        p.name: keys.blob_digest(p.read_bytes()) for p in sorted(data.iterdir()) if p.is_file()
    }
    return keys.short(keys.digest_json("trained", files), 16)
