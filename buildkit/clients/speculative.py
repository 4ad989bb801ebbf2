"""Speculative decoding as users run it: mlx_vlm's own generation with the published ``mtp/``
drafter, greedy, against plain greedy decoding on the same prompts.

For each draft length 1..depth (``draft_block_size`` = drafts + 1), every prompt is generated
with the drafter and compared token for token with plain greedy decoding, in float32 (model
and drafter cast as loaded): greedy speculative decoding is lossless, so any difference is a
defect of the directory (a graft or a requantization that breaks the head's agreement with
the trunk shows as fewer accepted drafts, never as other text). mlx_vlm's counters
(``speculative_stats_snapshot``/``speculative_stats_since``) give rounds, accepted and drafted;
tokens per round = (accepted + rounds) / rounds, as mlx_vlm prints it. The wall-clock ratio
(plain time / speculative time) is this machine's CPU figure, not a Metal one. Then, in the
directory's own bf16, how many prompts diverge from plain greedy and after how many tokens:
batched verification and single-token decoding round differently near ties.

mlx_vlm loads the whole model, so the run is decided before anything is loaded
(``memory_decision``): from the tensors' sizes, what the run holds at its peak (``run_bytes``)
against what the machine gives (``available_memory``). A run that does not fit is not started
and the caller records why. A head that accepts none of its drafts on the first prompt stops
the run there: the rest would only repeat plain decoding (``stopped_early``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from buildkit.core.errors import StepError, UsageError
from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import DRAFTER_DIR, HEAD_PREFIX
from buildkit.formats.tensors import header_bytes, nbytes

np = lazy("numpy", __name__)

# what publish does not copy from the source (it writes its own config, index and card)
SKIP_SOURCE_FILES = {"config.json", "model.safetensors.index.json", "README.md", ".gitattributes"}
GB = 1e9
# the run's recorded figures: 2, a head that accepts nothing stops after one prompt
VERSION = 2
HALF_FLOATS = ("BF16", "F16")  # cast to float32 as loaded: their bytes twice over, once more
# mlx_vlm's imports, the processor, caches and activations of a few short prompts, with room:
# the trained fixture's run adds ~20 MB of RSS above its imports, which take more address space
# (what an ``--as`` limit counts) than memory
RUN_OVERHEAD = 768 << 20
MEMORY_ENV = "BUILDKIT_MEMORY"  # bytes the real-client run may use, below what the machine has


class SpeculativeParams(BaseModel):
    """How much of the eval text the speculative run uses. Kept small: it decodes token by
    token and is a check that the client drafts and stays lossless; the statistics are the
    teacher-forced figures' (docs/evaluation.md, "The real client")."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(default=2, ge=1)
    prompt_tokens: int = Field(default=32, ge=2)
    max_tokens: int = Field(default=16, ge=1)  # new tokens per prompt
    bf16: bool = False  # also measure divergence in the directory's own bf16 (a second load)


def prompt_ids(tokens: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, evenly spaced over the text's tokens."""
    if len(tokens) < length:
        raise UsageError(
            f"the eval text has {len(tokens)} tokens; a speculative prompt needs {length}"
        )
    starts = np.linspace(0, len(tokens) - length, n).astype(int)
    return [list(tokens[s : s + length]) for s in starts]


def _greedy(model, processor, prompt: str, max_tokens: int, **kw) -> list[int]:
    from mlx_vlm import stream_generate

    return [
        int(r.token)
        for r in stream_generate(
            model, processor, prompt, max_tokens=max_tokens, temperature=0.0, **kw
        )
    ]


def _load(model_dir: Path, float32: bool):
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters import load_drafter

    drafter_dir = model_dir / DRAFTER_DIR
    if not (drafter_dir / "config.json").is_file():
        raise UsageError(
            f"{model_dir}: no drafter directory {DRAFTER_DIR}/ (an MTP variant publishes one)"
        )
    model, processor = load(str(model_dir))
    drafter, kind = load_drafter(str(drafter_dir), kind="mtp")
    if float32:
        model.set_dtype(mx.float32)
        drafter.set_dtype(mx.float32)
    return model, processor, drafter, kind


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- whether the run fits, decided before anything is loaded ---------------------------


def run_bytes(entries: dict[str, dict]) -> dict:
    """What the run holds at its peak, from the model's tensor entries (dtype, shape) alone:
    every tensor as stored, a float32 copy of each bf16/f16 one (the model is cast as loaded),
    the head again as the drafter (cast the same way), and ``RUN_OVERHEAD``."""

    def sizes(names) -> tuple[int, int]:
        got = [
            (nbytes(entries[n]["dtype"], entries[n]["shape"]), entries[n]["dtype"]) for n in names
        ]
        return sum(b for b, _ in got), sum(b for b, d in got if d in HALF_FLOATS)

    model, model_half = sizes(entries)
    head, head_half = sizes([n for n in entries if n.startswith(HEAD_PREFIX)])
    need = model + 2 * model_half + head + 2 * head_half + RUN_OVERHEAD
    return {"model_bytes": model, "needed_bytes": need}


def _cgroup_free() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), if it sets a limit."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        d = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (d / "memory.max").read_text().strip()
        return None if limit == "max" else int(limit) - int((d / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def available_memory() -> tuple[int, str]:
    """(bytes a run may still take, what says so): the least of the machine's available
    memory, this process's cgroup limit, its address-space limit (``prlimit --as``) and
    ``BUILDKIT_MEMORY``."""
    found = []
    if (env := os.environ.get(MEMORY_ENV)) is not None:
        try:
            found.append((int(float(env)), f"{MEMORY_ENV}={env}"))
        except ValueError:
            raise UsageError(f"{MEMORY_ENV}={env!r} is not a number of bytes") from None
    import psutil  # MemAvailable on Linux, the VM's free + inactive pages on macOS

    found.append((psutil.virtual_memory().available, "the machine's available memory"))
    if (cg := _cgroup_free()) is not None:
        found.append((cg, "the cgroup's memory.max"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = psutil.Process().memory_info().vms
        found.append((soft - used, "the address-space limit (RLIMIT_AS)"))
    return min(found)


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.01 * GB else f"{n / 1e6:.1f} MB"


def memory_decision(entries: dict[str, dict], have: tuple[int, str] | None = None) -> dict:
    """Whether mlx_vlm's run of the model ``entries`` fits: ``run_bytes`` and, when it does
    not, ``skipped`` saying why (``have``: bytes and what says so; the machine's by default)."""
    need = run_bytes(entries)
    free, where = have if have is not None else available_memory()
    if need["needed_bytes"] <= free:
        return need
    return need | {
        "skipped": (
            f"mlx_vlm loads the whole model: its run needs ~{_size(need['needed_bytes'])} "
            f"(the {_size(need['model_bytes'])} model, float32 copies of its bf16 tensors "
            f"and the drafter) and {where} leaves {_size(max(free, 0))}"
        )
    }


# ---- the run ----------------------------------------------------------------------------


def _counts(drafter, snap) -> tuple[int, int, int]:
    from mlx_vlm.speculative.common import speculative_stats_since

    rounds, accepted, drafted = speculative_stats_since(drafter, snap)
    return rounds or 0, accepted or 0, drafted or 0


def _depth(model, processor, drafter, kind, prompts, k, p, plain, clock) -> tuple:
    """Draft length ``k`` over the prompts (plain greedy made as first needed, into ``plain``);
    (outputs, counts, seconds, stop reason): a head that accepts none of the first prompt's
    drafts at one draft a round stops at once (deeper, a first prompt's bad luck is no proof)."""
    from mlx_vlm.speculative.common import speculative_stats_snapshot

    spec = {"draft_model": drafter, "draft_kind": kind, "draft_block_size": k + 1}
    snap = speculative_stats_snapshot(drafter)
    got, dt = [], 0.0
    for i, q in enumerate(prompts):
        if i not in plain:
            t0 = time.perf_counter()
            plain[i] = _greedy(model, processor, q, p.max_tokens)
            clock[0] += time.perf_counter() - t0
        t0 = time.perf_counter()
        got.append(_greedy(model, processor, q, p.max_tokens, **spec))
        dt += time.perf_counter() - t0
        rounds, accepted, drafted = _counts(drafter, snap)
        if k == 1 and i == 0 and drafted and not accepted:
            why = (
                f"the head accepted none of its {drafted} drafts on the first prompt at "
                f"{k} draft(s) a round: the other prompts, longer drafts and the bf16 pass "
                "would only repeat plain decoding, and were not run"
            )
            return got, (rounds, accepted, drafted), dt, why
    return got, _counts(drafter, snap), dt, None


def run(model_dir: Path, prompts: list[str], depth: int, p: SpeculativeParams) -> dict:
    """The speculative figures of an MLX directory with a drafter in ``mtp/``; ``positions``:
    the token positions the model ran (prefills, decode steps and verified drafts), the run's
    work."""
    import mlx.core as mx

    model, processor, drafter, kind = _load(Path(model_dir), float32=True)
    _greedy(model, processor, prompts[0], 2)  # warm both paths before timing
    _greedy(
        model, processor, prompts[0], 2, draft_model=drafter, draft_kind=kind, draft_block_size=2
    )
    plain: dict[int, list[int]] = {}
    clock = [0.0]  # plain decoding's seconds, of the prompts run so far
    out = {k: [] for k in ("rounds", "accepted", "drafted", "tokens_per_round", "wall_ratio_cpu")}
    mismatches, stopped, work = [], None, 0
    for k in range(1, depth + 1):
        got, (rounds, accepted, drafted), dt, stopped = _depth(
            model, processor, drafter, kind, prompts, k, p, plain, clock
        )
        out["rounds"].append(rounds)
        out["accepted"].append(accepted)
        out["drafted"].append(drafted)
        out["tokens_per_round"].append((accepted + rounds) / rounds if rounds else None)
        out["wall_ratio_cpu"].append(clock[0] / dt)
        work += len(got) * p.prompt_tokens + rounds * (k + 1)
        for i, (a, b) in enumerate(zip(plain.values(), got, strict=False)):
            if (at := first_difference(a, b)) is not None:
                mismatches.append(
                    f"prompt {i}, {k} draft(s): token {at} is {b[at : at + 1]} "
                    f"where plain greedy gives {a[at : at + 1]}"
                )
        if stopped:
            break
    work += sum(p.prompt_tokens + len(a) for a in plain.values())
    del model, drafter
    mx.clear_cache()
    out |= {
        "lossless": not mismatches,
        "mismatches": mismatches,
        "prompts": len(plain),
        "prompt_tokens": p.prompt_tokens,
        "max_tokens": p.max_tokens,
        "bf16_divergent_prompts": None,
        "bf16_tokens_before_divergence": None,
    }
    if stopped:
        out["stopped_early"] = stopped
    elif p.bf16:
        at, more = _bf16(model_dir, prompts, depth, p)
        out["bf16_divergent_prompts"] = len(at)
        out["bf16_tokens_before_divergence"] = float(np.mean(at)) if at else None
        work += more
    out["positions"] = work
    return out


def _bf16(model_dir: Path, prompts: list[str], depth: int, p: SpeculativeParams):
    """(where each diverging prompt first differs, positions run) of the directory's own bf16."""
    import mlx.core as mx

    model, processor, drafter, kind = _load(Path(model_dir), float32=False)
    at, work = [], 0
    for q in prompts:
        a = _greedy(model, processor, q, p.max_tokens)
        b = _greedy(
            model,
            processor,
            q,
            p.max_tokens,
            draft_model=drafter,
            draft_kind=kind,
            draft_block_size=depth + 1,
        )
        work += 2 * p.prompt_tokens + len(a) + len(b)
        if (i := first_difference(a, b)) is not None:
            at.append(i)
    del model, drafter
    mx.clear_cache()
    return at, work


def decode_prompts(tokenizer_json: bytes, ids: list[list[int]]) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode())
    return [tok.decode(x, skip_special_tokens=False) for x in ids]


# ---- a directory from the store, laid out as publish lays it out ----------------------


def _write_safetensors(store, path: Path, entries: list[tuple[str, dict]]) -> None:
    """A safetensors file of store tensor entries (name, entry), each copied a block of rows
    at a time: memory is a block, never the model."""
    from buildkit.store.packs import FORMAT

    items = [(n, e["dtype"], tuple(e["shape"])) for n, e in entries]
    with open(path, "wb") as f:
        f.write(header_bytes(items, FORMAT))
        for _, e in entries:
            for block in store.iter_rows(e):
                f.write(memoryview(np.ascontiguousarray(block).reshape(-1).view("u1")))


def write_dir(store, parts: list, source, dest: Path) -> None:
    """An MLX directory of the model ``parts`` (store artifacts) with the source artifact's
    config and side files, and the head as the drafter ``mtp/``: publish's layout, in one shard
    per directory, written a block at a time, for mlx_vlm to load."""
    from buildkit.clients.configs import drafter_config
    from buildkit.quant.quantize import quantization_config

    tensors = sorted({k: v for a in parts for k, v in a.tensors.items()}.items())
    config = json.loads(store.get_blob(source.files["config.json"]))
    if q := quantization_config(parts):
        config["quantization"] = config["quantization_config"] = q
    dest.mkdir(parents=True)
    for name, digest in source.files.items():
        if name not in SKIP_SOURCE_FILES and "/" not in name and name != "config.json":
            (dest / name).write_bytes(store.get_blob(digest))
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _write_safetensors(store, dest / "model.safetensors", tensors)
    head = [(k.removeprefix(HEAD_PREFIX), e) for k, e in tensors if k.startswith(HEAD_PREFIX)]
    if not head:
        raise StepError("speculative: the model has no MTP head (language_model.mtp.* tensors)")
    (dest / DRAFTER_DIR).mkdir()
    _write_safetensors(store, dest / DRAFTER_DIR / "model.safetensors", head)
    (dest / DRAFTER_DIR / "config.json").write_text(
        json.dumps(drafter_config(config), indent=2, sort_keys=True)
    )


@contextlib.contextmanager
def staged(store, parts: list, source, tmp_root: Path):
    """A temporary directory (``write_dir``), removed afterwards."""
    tmp_root.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="speculative-", dir=tmp_root))
    try:
        write_dir(store, parts, source, d / "model")
        yield d / "model"
    finally:
        shutil.rmtree(d, ignore_errors=True)
