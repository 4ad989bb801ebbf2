"""Texts: where a text is, how it is read, split into calibration and held-out lines,
tokenized with the source's own tokenizer and cut into windows.

calibrate, sensitivity, reference (eval's text) and ``buildkit eval`` all read their texts
here, so one text means the same tokens to each of them.
"""

from __future__ import annotations

from pathlib import Path

from buildkit.core.errors import StepError, UsageError
from buildkit.core.lazy import lazy

np = lazy("numpy", __name__)

BUILTIN = "builtin:"
DEFAULT = "builtin:calibration.txt"


def text_path(spec: str, project_root: Path) -> Path:
    """``builtin:NAME`` is a file shipped in ``buildkit/data``; anything else a project path."""
    if spec.startswith(BUILTIN):
        path = Path(__file__).parents[1] / "data" / spec[len(BUILTIN) :]
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = project_root / path
    if not path.is_file():
        raise UsageError(
            f"text {spec!r}: no such file ({path}); point params.text at a UTF-8 text file "
            "(a project path), or use builtin:calibration.txt"
        )
    return path


def read(path: Path) -> str:
    """The text of a UTF-8 file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StepError(f"text {path}: not UTF-8 ({e}); give a UTF-8 file") from None


def name(spec: str) -> str:
    """How a card names a text: a builtin one by its name (its content is buildkit's own), a
    project file as such (its path is not in any key, only its content)."""
    return spec if spec.startswith(BUILTIN) else "a project file"


def split_lines(text: str, heldout_every: int) -> tuple[list[str], list[str]]:
    """(calibration, held-out) lines: the leading ``#`` header and blank lines are dropped,
    then every ``heldout_every``-th remaining line is held out."""
    lines = text.splitlines()
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    calib = [ln for i, ln in enumerate(lines) if i % heldout_every != heldout_every - 1]
    held = [ln for i, ln in enumerate(lines) if i % heldout_every == heldout_every - 1]
    return calib, held


def lines(path: Path, heldout_every: int) -> tuple[list[str], list[str]]:
    """A calibration text's (calibration lines, held-out lines), both non-empty."""
    calib, held = split_lines(read(path), heldout_every)
    if not calib or not held:
        raise StepError(
            f"calibration text {path}: {len(calib)} calibration and {len(held)} held-out "
            f"lines; it needs at least {heldout_every} non-blank lines"
        )
    return calib, held


def tokenize(tokenizer_json: bytes, lines: list[str], limit: int) -> list[int]:
    """Token ids of the lines joined by newlines, at most ``limit`` of them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode())
    return tok.encode("\n".join(lines), add_special_tokens=False).ids[:limit]


def whole_tokens(text: str, tokenizer_json: bytes, max_tokens: int) -> tuple[list[int], int]:
    """(the first ``max_tokens`` token ids of a whole text, every line and character of it, as
    the source's tokenizer reads it; the text's full token count)."""
    tokens = tokenize(tokenizer_json, [text], len(text.encode("utf-8")) + 1)
    if len(tokens) < 2:
        raise StepError(f"the text has {len(tokens)} tokens; evaluation needs at least 2")
    return tokens[:max_tokens], len(tokens)


def heldout_tokens(
    text: str, heldout_every: int, tokenizer_json: bytes, max_tokens: int
) -> list[int]:
    """The held-out lines of a text (calibration's split), tokenized with the source's tokenizer."""
    _, held = split_lines(text, heldout_every)
    tokens = tokenize(tokenizer_json, held, max_tokens)
    if len(tokens) < 2:
        raise StepError(
            f"the text has {len(held)} held-out lines, {len(tokens)} tokens; evaluation needs more"
        )
    return tokens


def batches(ids: list[int], seq_len: int) -> list[np.ndarray]:
    """Windows of ``seq_len`` tokens as one [B, seq_len] batch, plus the remainder."""
    n = len(ids) // seq_len * seq_len
    out = [np.array(ids[:n], dtype=np.int32).reshape(-1, seq_len)] if n else []
    if len(ids) > n:
        out.append(np.array([ids[n:]], dtype=np.int32))
    return out


def windows(tokens: list[int], seq_len: int) -> list[np.ndarray]:
    """The token ids in batches [B, L] to grade: windows of ``seq_len``, then the remainder
    (if 2 or more tokens: a window of one has nothing to predict)."""
    out = [b for b in batches(tokens, seq_len) if b.shape[1] >= 2]
    if not out:
        raise UsageError(f"{len(tokens)} tokens: too few to evaluate (need at least 2)")
    return out
