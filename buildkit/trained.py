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
from typing import NamedTuple

from . import keys
from .errors import SourceError
from .fixture import FixtureSpec, _plan, generate
from .tensors import read_header, read_tensor

DATA = Path(__file__).parent / "data" / "trained"
SPEC = FixtureSpec(vocab=2048)  # the generator's default shape with a larger vocabulary


class Trained(NamedTuple):
    """A named trained fixture: its shipped files and the shape they were trained in."""

    data: Path
    spec: FixtureSpec
    about: str


# The first is the default (``fixture:trained``); the others are ``fixture:trained=NAME``.
FIXTURES: dict[str, Trained] = {
    "kjv": Trained(DATA, SPEC, "King James Bible; 8 experts, top-2, 4.0 MB"),
    "austen": Trained(
        Path(__file__).parent / "data" / "trained-austen",
        # shaped like the real model: routed experts 88% of the text weights, top-4 of 48
        FixtureSpec(vocab=1024, experts=48, experts_per_tok=4),
        "Jane Austen's six novels; 48 experts, top-4, routed experts 88% of the weights",
    ),
}
DEFAULT = "kjv"


def get(name: str | None = None) -> Trained:
    """The trained fixture called ``name`` (the default when None); ``SourceError`` naming the
    known ones otherwise."""
    name = DEFAULT if name is None else name
    if name not in FIXTURES:
        known = ", ".join(f"{n} ({f.about})" for n, f in FIXTURES.items())
        raise SourceError(f"no trained fixture {name!r}; the known ones: {known}")
    return FIXTURES[name]


# Routed rows an expert gets per input dimension in the real model's calibration: 4096 tokens
# (calibrate's default max_tokens) x top-8 / 256 experts / 2048 hidden = 0.0625.
REAL_ROWS_PER_INPUT = 4096 * 8 / 256 / 2048


def calibration_tokens(spec: FixtureSpec) -> int:
    """Calibration tokens (calibrate's ``params.max_tokens``) that give ``spec``'s experts the
    real model's routed rows per input: tokens x top-k / experts / hidden = 0.0625."""
    return round(REAL_ROWS_PER_INPUT * spec.experts * spec.hidden / spec.experts_per_tok)


def write_trained(
    out: str | Path,
    data: Path = DATA,
    progress: Callable[[str], None] | None = None,
    spec: FixtureSpec = SPEC,
) -> Path:
    """Write the trained checkpoint in full Hugging Face layout to ``out`` and return its path.

    ``data`` and ``spec`` are one fixture's (``FIXTURES``; the default's unless given).
    Deterministic: the same data gives byte-identical files. Raises ``FileExistsError`` if
    ``out`` exists and is not an empty directory, ``SourceError`` if ``data`` lacks a tensor.
    """
    header = read_header(data / "weights.safetensors")
    want = {t.name for t, _ in _plan(spec) if not t.name.startswith("model.visual.")}
    missing, extra = sorted(want - set(header.tensors)), sorted(set(header.tensors) - want)
    bad = [n for n, i in header.tensors.items() if i.dtype != "BF16"]
    if missing or extra or bad:
        raise SourceError(
            f"{data / 'weights.safetensors'}: missing {missing[:4]}, unexpected {extra[:4]}, "
            f"not BF16 {bad[:4]}; rerun training/train_fixture.py"
        )
    weights = {n: read_tensor(i, header.path) for n, i in header.tensors.items()}
    tokenizer = (data / "tokenizer.json").read_text()
    return generate(out, spec, progress, tokenizer=tokenizer, weights=weights)


def data_digest(data: Path = DATA) -> str:
    """Short digest of the shipped files: a changed ``data`` is written anew, never reused."""
    files = {
        p.name: keys.blob_digest(p.read_bytes()) for p in sorted(data.iterdir()) if p.is_file()
    }
    return keys.short(keys.digest_json("trained", files), 16)
