"""publish: materialize an MLX model directory from artifacts, checked, then swapped in atomically.

Writes shards ``model-0000K-of-0000N.safetensors`` (metadata format=mlx) by
size, one part of the model (language model, MTP head, vision tower) at a time,
tensors sorted by name and streamed one at a time from the store;
``model.safetensors.index.json``; ``config.json`` with the ``quantization``
(and ``quantization_config``) defaults plus per-path overrides as mlx_lm reads
them; the tokenizer and other side files of the source; ``verify.json``; ``eval.json``
(the eval nodes' figures, also a table in the card); and a model card. The directory is built
beside the target, checked (index parity,
metadata, mlx_lm load with finite logits), then exchanged with the old one in
one rename, so a reader never sees a mix of old and new shards.

Shards are not written again when their bytes exist: quantizing steps write their tensors as
packs, store objects in the shape of the shards planned here (``packs.py``), and a shard that
is a pack is hard-linked from the store; a shard an earlier publish wrote (the same header and
store entries, in order) is linked from that file. Either is linked only while its stat shows
it unchanged (else it is hashed first). Since parts never share a shard, xl-mtp links xl's
shards and the head's pack; only the drafter directory's copy of the head is written.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from .. import checkpoint as ckpt
from .. import keys, loadcheck, packs
from ..allocator import libc
from ..artifact import Artifact
from ..errors import StepError, UsageError
from ..fsio import DirectFile, drop_idle_write_buffers, file_ident, fsync_dir, settle
from ..store import Store
from ..tensors import nbytes, read_header
from .base import Context, Params, Slot, Step, register

STAMP = ".buildkit-publish.json"
COPY_CHUNK = 8 << 20
SKIP_SOURCE_FILES = {"config.json", "model.safetensors.index.json", "README.md", ".gitattributes"}
HEAD_PREFIX, DRAFTER_DIR = ckpt.HEAD_PREFIX, ckpt.DRAFTER_DIR
DRAFTER_SHARD = f"{DRAFTER_DIR}/model.safetensors"
PROCESSOR_FILES = ("preprocessor_config.json",)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class PublishParams(Params):
    out: str = "out/{variant}"  # where to write; not part of the key (``--out`` overrides)
    max_shard_bytes: int = Field(default=5 << 30, ge=1 << 20)
    base_model: str | None = (
        None  # default: the hf:// source's repo; none for a fixture or a directory
    )
    description: str = ""
    tags: list[str] = Field(default_factory=lambda: ["mlx", "quantized", "qwen3_5_moe"])
    load_check: bool = True  # load the result with mlx_lm and check logits are finite


def out_dir(params: PublishParams, ctx: Context) -> Path:
    p = ctx.options.out_dir or Path(params.out.format(variant=ctx.variant))
    return p if p.is_absolute() else ctx.options.project_root / p


def copy_entry(store, entry: dict, sink, buf: bytearray) -> int:
    """A tensor's bytes to ``sink``: a store object through ``buf``; a view (a passthrough
    tensor as its source lies: the bf16 lm_head is 1 GB in the real model) in blocks of rows,
    so memory stays a block, not the tensor."""
    if "view" not in entry:
        return store.copy_tensor(entry, sink, buf)
    done = 0
    for block in store.iter_rows(entry, len(buf)):
        data = memoryview(block.reshape(-1).view("u1"))
        sink(data)
        done += len(data)
    return done


def quantization_config(parts: list[Artifact]) -> dict | None:
    """Defaults from the quantization covering the most parameters, per-path entries for the
    rest."""
    per_path: dict[str, dict] = {}
    weight = Counter()
    for a in parts:
        q = a.meta.get("quantization", {})
        per_path.update(q)
        for role in a.meta.get("role_table", {}).values():
            if not role.get("passthrough"):
                weight[
                    json.dumps(
                        {
                            k: role.get(k, d)
                            for k, d in (("group_size", 64), ("bits", None), ("mode", "affine"))
                        },
                        sort_keys=True,
                    )
                ] += role["params"]
    if not per_path:
        return None
    default = json.loads(weight.most_common(1)[0][0]) if weight else next(iter(per_path.values()))
    cfg = dict(default)
    for path in sorted(per_path):
        if per_path[path] != default:
            cfg[path] = per_path[path]
    return cfg


def drafter_config(config: dict) -> dict:
    """config.json of the drafter directory, as mlx_vlm's own MTP split writes it
    (``model_type: qwen3_5_mtp``), with the head's per-path quantization under its own paths.

    mlx_vlm takes the drafter's unprefixed keys as MLX layout and its norms as already
    shifted; only ``mtp.``-prefixed keys are taken for Hugging Face layout and shifted again."""
    tc = config["text_config"]
    out = {
        "model_type": "qwen3_5_mtp",
        "text_config": tc,
        "block_size": int(tc.get("mtp_num_hidden_layers", 1)) + 2,
        "tie_word_embeddings": bool(tc.get("tie_word_embeddings", False)),
    }
    q = config.get("quantization")
    if q:
        head = {k: v for k, v in q.items() if not isinstance(v, dict)}
        head |= {
            k.removeprefix(HEAD_PREFIX): v
            for k, v in q.items()
            if isinstance(v, dict) and k.startswith(HEAD_PREFIX)
        }
        out["quantization"] = out["quantization_config"] = head
    return out


def missing_for_images(config: dict, files: dict[str, str], tokenizer_config: dict) -> list[str]:
    """What an mlx_vlm image prompt needs that a source with a vision tower does not carry."""
    if "vision_config" not in config:
        return []
    missing = [f for f in PROCESSOR_FILES if f not in files]
    if not any(f in files for f in CHAT_TEMPLATE_FILES) and "chat_template" not in tokenizer_config:
        missing.append("a chat template (chat_template.jinja)")
    return missing


def merge_reports(reports: list[dict]) -> dict:
    """One report from several verify nodes; a scoped node's checks are named with their scope."""
    checks = {}
    for rep in reports:
        scope = rep.get("scope", "all")
        for name, r in rep.get("checks", {}).items():
            checks[name if scope == "all" else f"{name} ({scope})"] = r
    return {"ok": all(r["ok"] for r in checks.values()), "checks": checks}


def merge_evals(reports: list[dict]) -> dict:
    """One eval.json from several eval nodes: the model's figures (a head-scoped node's
    acceptance joins the trunk's), and each labelled node's (a baseline) under its label."""
    out: dict = {}
    for rep in reports:
        figures = {k: v for k, v in rep.items() if k not in ("scope", "label")}
        if rep.get("label"):
            out.setdefault("others", {})[rep["label"]] = figures
        else:
            if rep.get("scope") == "head":
                figures = {k: v for k, v in figures.items() if k != "tokens"}
            for name, d in figures.pop("domains", {}).items():  # a head's acceptance joins
                out.setdefault("domains", {}).setdefault(name, {}).update(d)
            out.update(figures)
    return out


EVAL_ROWS = (  # (key, what it is, format)
    ("kld_mean", "KL divergence KL(p_bf16 ‖ p_model), mean", "{:.5f}"),
    ("kld_median", "KL divergence, median", "{:.5f}"),
    ("kld_p99", "KL divergence, 99th percentile", "{:.5f}"),
    ("top1_agreement", "top-1 agreement with bf16", "{:.2%}"),
    ("ppl_model", "perplexity, this model", "{:.3f}"),
    ("ppl_source", "perplexity, bf16 source", "{:.3f}"),
    ("acceptance", "MTP draft acceptance, depth 1 (this head on this trunk)", "{:.2%}"),
    ("acceptance_source", "MTP draft acceptance, depth 1 (bf16 head on bf16 trunk)", "{:.2%}"),
)


def eval_table(evals: dict) -> list[str]:
    """The card's evaluation table: this model, then each labelled comparison, as columns."""
    cols = [("this model", evals), *sorted(evals.get("others", {}).items())]
    text = f" of {evals['text']}" if evals.get("text") else ""
    lines = [
        f"On {evals.get('positions', '?')} positions of the held-out lines{text} "
        f"({evals.get('tokens', '?')} tokens), next-token distributions against the bf16 source, "
        "both run with mlx_lm's classes in float32.",
        "",
        "| figure | " + " | ".join(c for c, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for key, what, fmt in EVAL_ROWS:
        if any(key in f for _, f in cols):
            lines.append(
                f"| {what} | "
                + " | ".join(fmt.format(f[key]) if f.get(key) is not None else "" for _, f in cols)
                + " |"
            )
    return lines + domain_table(evals)


DOMAIN_COLUMNS = (  # (key, heading, format)
    ("tokens", "tokens", "{}"),
    ("kld_mean", "KLD mean", "{:.5f}"),
    ("top1_agreement", "top-1", "{:.2%}"),
    ("acceptance", "MTP acceptance", "{:.2%}"),
)


def domain_table(evals: dict) -> list[str]:
    """Per domain text (graded whole): this model's figures and, for each labelled comparison
    that graded the same domains (a data-agnostic baseline), this model's KLD as a ratio of
    its."""
    domains = evals.get("domains") or {}
    if not domains:
        return []
    cols = [c for c in DOMAIN_COLUMNS if any(c[0] in d for d in domains.values())]
    others = [(lab, o["domains"]) for lab, o in sorted(evals.get("others", {}).items())]
    others = [(lab, d) for lab, d in others if d]
    lines = [
        "",
        "Per domain, each text graded whole (calibration skew: a data-aware model's error "
        "where its calibration text says little):",
        "",
        "| domain | "
        + " | ".join(h for _, h, _ in cols)
        + "".join(f" | KLD / {lab}" for lab, _ in others)
        + " |",
        "|---|" + "---|" * (len(cols) + len(others)),
    ]
    for name, d in sorted(domains.items()):
        cells = [fmt.format(d[k]) if d.get(k) is not None else "" for k, _, fmt in cols]
        for _, od in others:
            base = (od.get(name) or {}).get("kld_mean")
            ok = base and d.get("kld_mean") is not None
            cells.append(f"{d['kld_mean'] / base:.3f}" if ok else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def exchange(src: Path, dst: Path) -> None:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE), else rename aside."""
    fn = getattr(libc(), "renameat2", None)
    if fn is not None:
        AT_FDCWD, RENAME_EXCHANGE = -100, 2
        if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_EXCHANGE) == 0:
            return
    aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    os.rename(dst, aside)
    os.rename(src, dst)
    os.rename(aside, src)


LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)")


def clear_leftovers(dest: Path) -> None:
    """Remove the temp and set-aside directories that killed publishes left beside ``dest``."""
    for p in dest.parent.glob(f".{glob.escape(dest.name)}.*-*"):
        m = LEFTOVER.fullmatch(p.name)
        if m and m["name"] == dest.name and not _alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        pass
    return True


def write_synced(path: Path, data: bytes) -> None:
    """A small file, through the page cache, fsynced before it is closed."""
    with DirectFile(path, direct=False) as f:
        f.write(data)


def card_origin(params: PublishParams, source: dict) -> tuple[str | None, str]:
    """(base_model for the card's metadata, a line saying what the model was built from)."""
    if params.base_model:
        return params.base_model, f"Built from `{params.base_model}`."
    if source.get("type") == "hf":
        return source[
            "repo"
        ], f"Built from `{source['repo']}` at revision `{source.get('revision')}`."
    if source.get("type") == "fixture":
        return None, (
            "Built from a **generated test fixture** (`qwen3_5_moe` layout, random weights, "
            f"spec `{json.dumps(source.get('spec'), sort_keys=True)}`): not a real model."
        )
    return None, "Built from a local checkpoint directory."


def budget_lines(b: dict | None) -> list[str]:
    """The card's account of a bits-per-weight budget: target, result, and each budgeted
    group's bits and measured sensitivity at every candidate bits."""
    if not b:
        return []
    cand = sorted({int(k) for s in b["sensitivity"].values() for k in s})
    lines = [
        "",
        "## Bits-per-weight budget",
        "",
        f"Target **{b['target_bpw']}** bits per weight (this part), "
        f"planned **{b['bits_per_weight']}**. Sensitivity: {b['measure']}; "
        "bits chosen to make the summed sensitivity least within the budget.",
        "",
        "| routed experts | bits | " + " | ".join(f"sensitivity at {c}" for c in cand) + " |",
        "|---|---|" + "---|" * len(cand),
    ]
    for name, s in b["sensitivity"].items():
        lines.append(
            f"| {name} | {b['bits'][name]} | "
            + " | ".join(str(s.get(str(c), "")) for c in cand)
            + " |"
        )
    return lines


def model_card(
    ctx: Context,
    params: PublishParams,
    cfg: dict | None,
    parts: list[Artifact],
    reports: list[dict],
    bpw: float,
    n_tensors: int,
    source: dict,
    evals: dict | None = None,
) -> str:
    names = [n for a in parts for n in a.tensors]
    has_mtp = any(n.startswith(HEAD_PREFIX) for n in names)
    has_vision = any(n.startswith("vision_tower.") for n in names)
    tags = list(
        dict.fromkeys(
            [*params.tags, *(["mtp"] if has_mtp else []), *(["vision"] if has_vision else [])]
        )
    )
    base, origin = card_origin(params, source)
    lines = [
        "---",
        *([f"base_model: {base}"] if base else []),
        "library_name: mlx",
        f"pipeline_tag: {'image-text-to-text' if has_vision else 'text-generation'}",
        "tags:",
        *[f"- {t}" for t in tags],
        "---",
        "",
        f"# {ctx.variant}",
        "",
        params.description
        or f"MLX build of {base or 'a qwen3_5_moe checkpoint'}, variant `{ctx.variant}`, "
        "made with buildkit.",
        "",
        origin,
        "",
        f"- bits per weight (stored bits / source weights): **{bpw:.3f}**",
        f"- tensors: {n_tensors}"
        + (f" (includes the MTP head `{HEAD_PREFIX}*`)" if has_mtp else ""),
        "",
        "## Quantization by role",
        "",
        "| part | role | bits | group size | tensors | weights |",
        "|---|---|---|---|---|---|",
    ]
    for a in parts:
        part = "mtp head" if any(n.startswith(HEAD_PREFIX) for n in a.tensors) else "trunk"
        for role, row in sorted(a.meta.get("role_table", {}).items()):
            bits = "passthrough" if row.get("passthrough") else str(row.get("bits"))
            extra = " (calibrated)" if row.get("calibrated") else ""
            gs = "" if row.get("passthrough") else str(row.get("group_size", 64))
            lines.append(
                f"| {part} | {role}{extra} | {bits} | {gs} | {row['tensors']} | {row['params']:,} |"
            )
    for a in parts:
        lines += budget_lines(a.meta.get("budget"))
    if reports:
        lines += ["", "## Verification", "", "| check | result | figure |", "|---|---|---|"]
        for rep in reports:
            for name, r in rep.get("checks", {}).items():
                lines.append(
                    f"| {name} | {'pass' if r['ok'] else 'FAIL'} | "
                    f"`{json.dumps(r['figure'], default=str)}` |"
                )
    if evals:
        lines += ["", "## Evaluation", "", *eval_table(evals)]
    return "\n".join(lines + usage(cfg is not None, has_vision, has_mtp)) + "\n"


def usage(quantized: bool, has_vision: bool, has_mtp: bool) -> list[str]:
    """The card's "Use" section: each client that loads this directory, and how."""
    if not quantized:
        return []
    lines = ["", "## Use", ""]
    if has_vision:
        lines += [
            "The vision tower is kept: use **mlx_vlm** for image (and text) prompts. "
            "LM Studio routes",
            "a config with `vision_config` to mlx_vlm too.",
            "",
            "```sh",
            "python -m mlx_vlm.generate --model path/to/this/model --image photo.jpg "
            '--prompt "Describe this image." --max-tokens 100',
            "python -m mlx_vlm.generate --model path/to/this/model "
            '--prompt "Hello" --max-tokens 32',
            "```",
            "",
            "```python",
            "from mlx_vlm import load, generate",
            "from mlx_vlm.prompt_utils import apply_chat_template",
            "",
            'model, processor = load("path/to/this/model")',
            "prompt = apply_chat_template(processor, model.config, "
            '"Describe this image.", num_images=1)',
            'print(generate(model, processor, prompt, image=["photo.jpg"], max_tokens=100).text)',
            "```",
            "",
            "**mlx_lm** loads the text model alone (it drops the vision tower"
            + (" and the MTP head)" if has_mtp else ")")
            + ":",
            "",
        ]
    lines += [
        "```python",
        "from mlx_lm import load, generate",
        "",
        'model, tokenizer = load("path/to/this/model")',
        'print(generate(model, tokenizer, prompt="Hello", max_tokens=32))',
        "```",
    ]
    if has_mtp:
        lines += [
            "",
            "## Speculative decoding with the MTP head",
            "",
            f"The native multi-token-prediction head is published twice, with the same bytes: "
            f"as `{HEAD_PREFIX}*`",
            f"in this directory's shards (for oMLX) and "
            f"as a standalone mlx_vlm drafter in `{DRAFTER_DIR}/`.",
            "All seven head norms are stored already shifted (runtime weight `1 + w`), in both.",
            "",
            "- **oMLX**: set `mtp_enabled: true` for this model. "
            "Use an oMLX release that decides the head's",
            "  norm convention for the whole head (`mtp_head_norm_convention`), "
            "the `pre_fc` norms with the",
            "  rest of it: older releases decide each norm alone by its mean and "
            "shift again a correctly",
            "  shifted norm whose mean is below 0.5, "
            "as the real model's `pre_fc` norms are (0.49 and 0.27),",
            "  which costs much of the draft acceptance.",
            f"- **mlx_vlm**: pass the drafter directory, "
            f"`--draft-model path/to/this/model/{DRAFTER_DIR} --draft-kind mtp`:",
            "",
            "```sh",
            f"python -m mlx_vlm.generate --model path/to/this/model "
            f"--draft-model path/to/this/model/{DRAFTER_DIR} \\",
            '    --draft-kind mtp --prompt "Hello" --max-tokens 64',
            "```",
            "",
            "- **LM Studio** (mlx-engine) and plain mlx_lm ignore the head: "
            "the model runs without drafting.",
        ]
    return lines


@dataclass
class Staged:
    """A model written by ``Publish._stage`` into ``tmp``, checked, waiting to be swapped in."""

    dest: Path
    tmp: Path
    parts: list[Artifact]
    tensors: dict[str, dict]
    config: dict
    made: Path | None = None  # the outermost directory _stage created
    art: Artifact | None = None
    load_check: loadcheck.Lookup | None = None
    shards: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (digest, stat)
    linked: int = 0  # shards hard-linked (a pack, or an earlier publish's) rather than written
    source: dict = field(default_factory=dict)  # what fetch says the source was (for the card)


@register
class Publish(Step):
    kind = "publish"
    version = 3  # 3: the drafter directory mtp/ for MTP variants
    Params = PublishParams
    inputs = {
        "model": Slot(many=True),
        "source": Slot(),
        "report": Slot(required=False, many=True),
        "eval": Slot(required=False, many=True),  # eval nodes: eval.json and the card's table
    }

    @property
    def writer(self) -> dict:
        return {self.kind: self.version}

    def key_params(self, params: PublishParams, inputs=None) -> dict:
        return params.model_dump(mode="json", exclude={"out"})

    def check_request(self, params: PublishParams, ctx: Context) -> None:
        dest = out_dir(params, ctx)
        for d in [dest, *dest.parents]:
            if d.exists() and not d.is_dir():
                where = "it" if d == dest else f"{d}"
                raise UsageError(
                    f"Cannot publish to {dest}: {where} is a file, not a directory. "
                    "Pass --out with a directory path."
                )
        if dest.is_dir() and not (dest / STAMP).exists() and any(dest.iterdir()):
            raise UsageError(
                f"Cannot publish to {dest}: it exists and was not written by buildkit. "
                "Delete it or pass --out with a new path."
            )

    def outdated(
        self, params: PublishParams, outputs: dict[str, Artifact], ctx: Context
    ) -> str | None:
        out = out_dir(params, ctx)
        want = outputs["out"].digest
        try:
            stamp = json.loads((out / STAMP).read_text())
        except (OSError, ValueError):
            return f"output directory {out} is missing or was not written by buildkit"
        if stamp.get("artifact") != want:
            return f"output directory {out} holds another build"
        for name, size in outputs["out"].meta["sizes"].items():
            try:
                if (out / name).stat().st_size != size:
                    return f"{out / name} was modified"
            except FileNotFoundError:
                return f"{out / name} is missing"
        return None

    def watch(self, params: PublishParams, ctx: Context):
        out = out_dir(params, ctx)
        return [], [out, *sorted(out.rglob("*"))]

    def _stage(self, ctx: Context, params: PublishParams, inputs) -> Staged:
        """Everything but the verify reports: shards, index, config and side files in a temp
        directory beside the target, checked (index parity, mlx_lm load)."""
        store = ctx.store
        parts: list[Artifact] = inputs["model"]
        tensors: dict[str, dict] = {}
        for a in parts:
            for k, v in a.tensors.items():
                if k in tensors and tensors[k] != v:
                    raise StepError(
                        f"tensor {k!r} is produced by two model inputs with different bytes"
                    )
                tensors[k] = v
        src = inputs["source"][0]
        config = json.loads(store.get_blob(src.files["config.json"]))
        qcfg = quantization_config(parts)
        if qcfg:
            config["quantization"] = qcfg
            config["quantization_config"] = qcfg
        dest = out_dir(params, ctx)
        self.check_request(
            params, ctx
        )  # again: the directory may have changed since the build began
        made = next(
            (d for d in reversed(dest.parents) if not d.exists()), None
        )  # to undo on _discard
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        clear_leftovers(dest)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        staged = Staged(dest, tmp, parts, tensors, config, made, source=src.meta.get("source", {}))
        tok_cfg = (
            json.loads(store.get_blob(src.files["tokenizer_config.json"]))
            if "tokenizer_config.json" in src.files
            else {}
        )
        missing = missing_for_images(config, src.files, tok_cfg)
        if missing:
            ctx.log(
                f"warning: the source has a vision tower (vision_config) "
                f"but no {' and no '.join(missing)}: "
                "mlx_vlm loads the model but cannot run an image prompt; add them to the source"
            )
        try:
            if params.load_check:
                side = {
                    k: v
                    for k, v in src.files.items()
                    if k not in SKIP_SOURCE_FILES and "/" not in k
                }
                staged.load_check = loadcheck.lookup(
                    store, config, tensors, self.writer, side, image=not missing
                )
                if staged.load_check.to_run:
                    loadcheck.warm(staged.load_check.to_run)  # while the shards are written
            staged.art = self._write(ctx, params, staged, src)
            drop_idle_write_buffers()  # all written; the load check, a build's memory peak, is next
            self._check(ctx, staged, params)
        except BaseException:
            self._discard(staged)
            raise
        return staged

    def _discard(self, prepared: Staged | None) -> None:
        if prepared is None:
            return
        shutil.rmtree(prepared.tmp, ignore_errors=True)
        if prepared.made is not None and not prepared.dest.exists():  # directories _stage created
            for d in [prepared.dest.parent, *prepared.dest.parent.parents]:
                if d == prepared.made.parent:
                    break
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if empty

    def run(self, ctx: Context, params: PublishParams, inputs) -> dict[str, Artifact]:
        reports = (
            [merge_reports([r.meta.get("report", {}) for r in inputs.get("report", [])])]
            if inputs.get("report")
            else []
        )
        failed = [k for rep in reports for k, r in rep.get("checks", {}).items() if not r["ok"]]
        staged: Staged | None = None
        try:
            if failed:
                raise StepError(f"refusing to publish: verify failed {', '.join(failed)}")
            staged = self._stage(ctx, params, inputs)
            art, tmp, dest = staged.art, staged.tmp, staged.dest
            files = {}
            if reports:
                files["verify.json"] = json.dumps(reports[0], indent=2, sort_keys=True).encode()
            evals = merge_evals([e.meta.get("report", {}) for e in inputs.get("eval", [])])
            if evals:
                files["eval.json"] = json.dumps(evals, indent=2, sort_keys=True).encode()
            files["README.md"] = model_card(
                ctx,
                params,
                staged.config.get("quantization"),
                staged.parts,
                reports,
                art.meta["bits_per_weight"],
                len(staged.tensors),
                staged.source,
                evals,
            ).encode()
            self._put_files(ctx.store, tmp, art, files)
            write_synced(
                tmp / STAMP, json.dumps({"artifact": art.digest, "variant": ctx.variant}).encode()
            )
            fsync_dir(tmp)
            with ctx.store.lock(
                keys.digest_json("publish", str(dest))
            ):  # one swap at a time per dir
                if dest.exists():
                    exchange(tmp, dest)
                else:
                    os.rename(tmp, dest)
                fsync_dir(dest.parent)
        finally:
            self._discard(staged)
        remember_shards(ctx.store, dest, staged.shards)
        linked = (
            f" ({staged.linked} of {len(staged.shards)} shards hard-linked, not written)"
            if staged.linked
            else ""
        )
        ctx.log(f"published {len(staged.tensors)} tensors to {dest}{linked}")
        return {"out": art}

    def _write(self, ctx, params, staged: Staged, src) -> Artifact:
        store, tmp, tensors, parts = ctx.store, staged.tmp, staged.tensors, staged.parts
        shards = packs.plan_shards(
            {k: (e["dtype"], e["shape"]) for k, e in tensors.items()}, params.max_shard_bytes
        )
        n = len(shards)
        weight_map, meta_shards, sizes = {}, {}, {}
        total = 0
        buf = bytearray(COPY_CHUNK)  # one buffer for every tensor: no fresh pages per tensor
        head = sorted(k for k in tensors if k.startswith(HEAD_PREFIX))
        ctx.progress.start(len(tensors) + len(head))
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            weight_map.update(dict.fromkeys(names, fname))
            total += self._shard(ctx, staged, fname, [(k, tensors[k]) for k in names], buf)
        if head:  # the same store entries under the drafter's names: mlx_vlm's standalone layout
            (tmp / DRAFTER_DIR).mkdir()
            self._shard(
                ctx,
                staged,
                DRAFTER_SHARD,
                [(k.removeprefix(HEAD_PREFIX), tensors[k]) for k in head],
                buf,
            )
        for fname, (digest, ident) in staged.shards.items():
            meta_shards[fname], sizes[fname] = digest, ident[2]
        files: dict[str, bytes] = {
            "model.safetensors.index.json": json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2,
            ).encode(),
            "config.json": json.dumps(staged.config, indent=2, sort_keys=True).encode(),
        }
        if head:
            files[f"{DRAFTER_DIR}/config.json"] = json.dumps(
                drafter_config(staged.config), indent=2, sort_keys=True
            ).encode()
        for name, digest in sorted(src.files.items()):
            if name not in SKIP_SOURCE_FILES and "/" not in name:
                files[name] = store.get_blob(digest)
        params_total = sum(
            r["params"] for a in parts for r in a.meta.get("role_table", {}).values()
        )
        bpw = sum(
            a.meta.get("bits_per_weight", 0)
            * sum(r["params"] for r in a.meta.get("role_table", {}).values())
            for a in parts
        ) / max(params_total, 1)
        art = Artifact(
            meta={"shards": meta_shards, "bits_per_weight": round(bpw, 4), "sizes": sizes}
        )
        self._put_files(store, tmp, art, files)
        return art

    def _shard(
        self, ctx, staged: Staged, fname: str, items: list[tuple[str, dict]], buf: bytearray
    ) -> int:
        """Write (or hard-link) one shard of ``items`` (name, store entry) at ``fname``; its body's
        bytes."""
        store, path = ctx.store, staged.tmp / fname
        head = packs.shard_header([(k, e["dtype"], e["shape"]) for k, e in items])
        body = sum(nbytes(e["dtype"], e["shape"]) for _, e in items)
        # what the shard's bytes follow from: the code writing them, its header, its tensors
        plan = keys.digest_json(
            "shard", [self.writer, keys.blob_digest(head), [e for _, e in items]]
        )
        digest = link_pack(store, items, head, body, path) or link_shard(store, plan, path)
        if digest is not None:
            staged.linked += 1
            ctx.progress.advance(len(items), len(head) + body)
        else:
            h = keys.blob_hasher()
            with DirectFile(path) as f:  # past the page cache: see DirectFile
                f.write(head)
                h.update(head)

                def sink(chunk, f=f, h=h):
                    f.write(chunk)
                    h.update(chunk)

                for _, e in items:
                    ctx.progress.advance(1, copy_entry(store, e, sink, buf))
            digest = keys.finish(h)
            with contextlib.suppress(OSError):  # refused (some network file systems): the
                settle(path)  # record is racy, and the next link hashes the file first
            store.put_memo("shard", plan, {"digest": digest})
        staged.shards[fname] = (digest, file_ident(path))
        return body

    @staticmethod
    def _put_files(store, tmp: Path, art: Artifact, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            _safe_name(name)
            write_synced(tmp / name, data)
            art.files[name] = store.put_blob(data)
            art.meta["sizes"][name] = len(data)

    def _check(self, ctx: Context, staged: Staged, params: PublishParams) -> None:
        tmp, tensors = staged.tmp, staged.tensors
        idx = json.loads((tmp / "model.safetensors.index.json").read_text())
        seen: dict[str, str] = {}
        total = 0
        for shard in sorted(set(idx["weight_map"].values())):
            h = read_header(tmp / shard)
            if h.metadata.get("format") != "mlx":
                raise StepError(
                    f"{shard}: metadata format is {h.metadata.get('format')!r}, expected 'mlx'"
                )
            end = max((t.end for t in h.tensors.values()), default=0)
            if (size := (tmp / shard).stat().st_size) != end:  # e.g. padding left by a direct write
                raise StepError(f"{shard}: {size} bytes where its header accounts for {end}")
            for k, info in h.tensors.items():
                if k in seen:
                    raise StepError(f"tensor {k!r} is in both {seen[k]} and {shard}")
                seen[k] = shard
                total += info.nbytes
        if seen != idx["weight_map"] or set(seen) != set(tensors):
            raise StepError("index weight_map does not match the shards' contents")
        if total != idx["metadata"]["total_size"]:
            raise StepError(
                f"index total_size {idx['metadata']['total_size']} != {total} bytes in shards"
            )
        head = {k.removeprefix(HEAD_PREFIX) for k in tensors if k.startswith(HEAD_PREFIX)}
        if head:
            h = read_header(tmp / DRAFTER_SHARD)
            if h.metadata.get("format") != "mlx" or set(h.tensors) != head:
                raise StepError(
                    f"{DRAFTER_SHARD} does not hold the {len(head)} head tensors "
                    "under the drafter's names"
                )
        if params.load_check:
            loadcheck.check(
                ctx.store, tmp, staged.config, tensors, self.writer, staged.load_check, ctx.log
            )


def link_pack(store: Store, items: list[tuple[str, dict]], head: bytes, body: int, path: Path):
    """Hard-link, at ``path``, the pack that is this shard (``packs.py``: quantize wrote its
    tensors as this shard, under these names, in this order) while its stat vouches for its
    bytes (else it is hashed first); its digest, or None."""
    files = {e.get("pack", {}).get("file") for _, e in items}
    if len(files) != 1 or None in files or any(e["pack"]["tensor"] != k for k, e in items):
        return None
    (digest,) = files
    # by stat, else hashed: a pack written through a published link (same inode) is not linked
    pack = store.sources.find(digest)
    if pack is None:
        return None
    try:
        with open(pack, "rb") as f:
            if os.fstat(f.fileno()).st_size != len(head) + body or f.read(len(head)) != head:
                return None  # planned with another shard size (max_shard_bytes), say
        os.link(pack, path)
    except OSError:  # gone meanwhile, EXDEV, EMLINK, ...: the shard is written instead
        return None
    return digest


def link_shard(store: Store, plan: str, path: Path) -> str | None:
    """Hard-link, at ``path``, a file an earlier publish wrote from the same ``plan`` (header and
    store entries) and that is unchanged since (by stat, else by its hash); its digest, or None
    (never written, gone, changed, or on another file system: the shard is written instead)."""
    rec = store.get_memo("shard", plan) or {}
    old = store.sources.find(rec["digest"]) if "digest" in rec else None  # by stat, else hashed
    if old is None:
        return None
    try:
        os.link(old, path)
    except OSError:  # EXDEV, EPERM, EMLINK, ... or the file went meanwhile
        return None
    return rec["digest"]


def remember_shards(store: Store, dest: Path, shards: dict[str, tuple[str, list[int]]]) -> None:
    """Record the published shards for ``link_shard``. Each one's stat was taken in the private
    temp directory; since then the swap has made it public and removing the old directory may
    have unlinked a hard link to it, which changes only its ctime. A write by anyone else would
    have moved its mtime (which ``settle`` put in the past) to the present, and such a shard is
    not recorded."""
    for fname, (digest, ident) in shards.items():
        with contextlib.suppress(OSError):
            now = file_ident(dest / fname)
            if now[:4] == ident[:4]:  # device, inode, size, mtime
                store.sources.remember(dest / fname, digest, now)


def _safe_name(name: str) -> None:
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or name.startswith("/"):
        raise StepError(
            f"refusing to write {name!r}: file names must stay inside the output directory"
        )
