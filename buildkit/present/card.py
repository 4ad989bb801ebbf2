"""The model card: what a published directory is, how it was made and checked, how well it
does (every figure with its interval) and how to use it. Publish passes in what it shows."""

from __future__ import annotations

import json

from buildkit.formats.checkpoint import DRAFTER_DIR, HEAD_PREFIX
from buildkit.grade import stats
from buildkit.present.tables import eval_table, pm
from buildkit.store.artifact import Artifact


def card_origin(params, source: dict) -> tuple[str | None, str]:
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
    if source.get("type") == "trained":
        return None, (
            "Built from buildkit's small **trained test checkpoint** (`qwen3_5_moe` layout, "
            "trained on a public-domain text): not a real model."
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
        "| tensors | bits | "
        + " | ".join(f"sensitivity at {'bf16' if c == 16 else c}" for c in cand)
        + " |",
        "|---|---|" + "---|" * len(cand),
    ]
    for name, s in b["sensitivity"].items():
        lines.append(
            f"| {name} | {'bf16' if b['bits'][name] == 16 else b['bits'][name]} | "
            + " | ".join(str(s.get(str(c), "")) for c in cand)
            + " |"
        )
    return lines


def model_card(
    variant: str,
    params,
    cfg: dict | None,
    parts: list[Artifact],
    reports: list[dict],
    bpw: float,
    n_tensors: int,
    source: dict,
    evals: dict | None = None,
) -> str:
    """The card's Markdown. ``params`` are publish's (tags, description, base_model)."""
    names = [n for a in parts for n in a.tensors]
    has_mtp = any(n.startswith(HEAD_PREFIX) for n in names)
    has_vision = any(n.startswith("vision_tower.") for n in names)
    lines = front_matter(variant, params, source, has_mtp, has_vision)
    lines += [
        f"- bits per weight (stored bits / source weights): **{bpw:.3f}**",
        f"- tensors: {n_tensors}"
        + (f" (includes the MTP head `{HEAD_PREFIX}*`)" if has_mtp else ""),
    ]
    lines += role_table(parts)
    for a in parts:
        lines += budget_lines(a.meta.get("budget"))
    lines += verification(reports)
    if evals:
        lines += ["", "## Evaluation", "", *eval_table(evals)]
        lines += drafting_lines(evals)
    return "\n".join(lines + usage(cfg is not None, has_vision, has_mtp)) + "\n"


def front_matter(variant: str, params, source: dict, has_mtp: bool, has_vision: bool):
    """The Hub's metadata block, the title and what the model was built from."""
    tags = [*params.tags, *(["mtp"] if has_mtp else []), *(["vision"] if has_vision else [])]
    base, origin = card_origin(params, source)
    return [
        "---",
        *([f"base_model: {base}"] if base else []),
        "library_name: mlx",
        f"pipeline_tag: {'image-text-to-text' if has_vision else 'text-generation'}",
        "tags:",
        *[f"- {t}" for t in dict.fromkeys(tags)],
        "---",
        "",
        f"# {variant}",
        "",
        params.description
        or f"MLX build of {base or 'a qwen3_5_moe checkpoint'}, variant `{variant}`, "
        "made with buildkit.",
        "",
        origin,
        "",
    ]


def role_table(parts: list[Artifact]) -> list[str]:
    lines = [
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
    return lines


def verification(reports: list[dict]) -> list[str]:
    if not reports:
        return []
    lines = ["", "## Verification", "", "| check | result | figure |", "|---|---|---|"]
    for rep in reports:
        for name, r in rep.get("checks", {}).items():
            lines.append(
                f"| {name} | {'pass' if r['ok'] else 'FAIL'} | "
                f"`{json.dumps(r['figure'], default=str)}` |"
            )
    return lines


def usage(quantized: bool, has_vision: bool, has_mtp: bool) -> list[str]:
    """The card's "Use" section: each client that loads this directory, and how."""
    if not quantized:
        return []
    lines = ["", "## Use", "", *(use_vlm(has_mtp) if has_vision else [])]
    lines += [
        "```python",
        "from mlx_lm import load, generate",
        "",
        'model, tokenizer = load("path/to/this/model")',
        'print(generate(model, tokenizer, prompt="Hello", max_tokens=32))',
        "```",
    ]
    return lines + (use_mtp() if has_mtp else [])


def use_vlm(has_mtp: bool) -> list[str]:
    return [
        "The vision tower is kept: use **mlx_vlm** for image (and text) prompts. LM Studio routes",
        "a config with `vision_config` to mlx_vlm too.",
        "",
        "```sh",
        "python -m mlx_vlm.generate --model path/to/this/model --image photo.jpg "
        '--prompt "Describe this image." --max-tokens 100',
        'python -m mlx_vlm.generate --model path/to/this/model --prompt "Hello" --max-tokens 32',
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


def use_mtp() -> list[str]:
    return [
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


def _f2(x: float) -> str:
    return f"{x:.2f}"


def drafting_lines(evals: dict) -> list[str]:
    """The card's drafting section: the published line format (a depth with too few tries
    says so, not a rate), tokens per cycle and modelled speedup with their intervals (none
    beyond the last measured depth), the best draft length only where it is decided, and
    mlx_vlm's own run if there was one."""
    dm = evals.get("drafts_by_depth")
    if not dm:
        return []
    ci = evals.get("ci95") or {}
    acc = evals.get("acceptance")
    depths = ", ".join(
        f"d{i}={a}/{n}" if n >= stats.MIN_DRAFTS else f"d{i}: too few drafts ({n})"
        for i, (a, n) in enumerate(dm, 1)
    )
    on = f" on {evals.get('tokens', '?')} tokens of {evals['text']}" if evals.get("text") else ""
    head = f"{pm(acc, ci.get('acceptance'), '{:.1%}'.format)} acceptance" if acc else "drafts"
    lines = ["", "## Speculative decoding (MTP head)", "", f"Teacher-forced{on}: {head} "]
    lines[-1] += f"(depth 1; by depth: {depths})."
    lines += ["", *depth_table(evals), *speculative_row(evals.get("speculative"))]
    lines += ["", best_line(evals), *speculative_lines(evals.get("speculative"))]
    return lines


def depth_table(evals: dict) -> list[str]:
    """Tokens per verify cycle and modelled speedup per draft length, ± half-widths."""
    tpc, costs = evals.get("tokens_per_cycle") or [], evals.get("verify_cost") or []
    ci = evals.get("ci95") or {}

    def row(vals, cis, fmt):
        return [
            "not measured" if v is None else pm(v, (cis or [None] * len(vals))[k], fmt)
            for k, v in enumerate(vals)
        ]

    lines = [
        "| drafts per cycle | " + " | ".join(str(i) for i in range(1, len(tpc) + 1)) + " |",
        "|---|" + "---|" * len(tpc),
        "| tokens per verify cycle | "
        + " | ".join(row(tpc, ci.get("tokens_per_cycle"), _f2))
        + " |",
    ]
    if costs:
        speed = evals.get("modelled_speedup") or []
        lines.append(
            "| modelled speedup (tokens per cycle / verify cost "
            f"{'/'.join(f'{c:g}' for c in costs)}) | "
            + " | ".join(row(speed, ci.get("modelled_speedup"), lambda x: f"{x:.2f}x"))
            + " |"
        )
    return lines


def best_line(evals: dict) -> str:
    """Drafting pays where tokens per cycle exceed the verify cost; the best length if decided."""
    best = evals.get("best_drafts")
    measured = sum(t is not None for t in evals.get("tokens_per_cycle") or [])
    if best:
        speed = evals["modelled_speedup"][best - 1]
        said = f"Best modelled draft length of the measured 1-{measured}: {best} ({speed:.2f}x)."
    else:
        said = f"Best modelled draft length: {evals.get('undecided') or 'not decided'}."
    return (
        "Drafting pays where tokens per cycle exceed the verify cost (a cycle verifying drafts "
        "on a mixture-of-experts model costs more than a plain decode step: each draft position "
        f"routes its own experts). {said}"
    )


def speculative_row(spec: dict | None) -> list[str]:
    if not spec or "skipped" in spec:
        return []
    return [
        "| mlx_vlm, float32: tokens per round | "
        + " | ".join("-" if x is None else f"{x:.2f}" for x in spec["tokens_per_round"])
        + " |"
    ]


def speculative_lines(spec: dict | None) -> list[str]:
    """mlx_vlm's own speculative run: counters, the lossless check, bf16 divergence; or why it
    was not possible at this size."""
    if not spec:
        return []
    if skipped := spec.get("skipped"):
        return [
            "",
            "mlx_vlm's own speculative generation with `mtp/` was not possible at this size "
            f"when this was built ({skipped}); the figures above are teacher-forced.",
        ]
    ok = "identical to" if spec["lossless"] else "DIFFERENT from"
    wall = (
        ", ".join(f"{x:.2f}x" for x in spec["wall_ratio_cpu"])
        if "wall_ratio_cpu" in spec
        else "not kept in a build (`buildkit eval --speculative` measures it)"
    )
    return [
        "",
        f"mlx_vlm's own speculative generation with `mtp/` (greedy, float32, "
        f"{spec['prompts']} prompts of {spec['prompt_tokens']} tokens, "
        f"{spec['max_tokens']} new tokens each, draft lengths 1-{len(spec['rounds'])}): "
        f"output {ok} plain greedy decoding; rounds {spec['rounds']}, accepted "
        f"{spec['accepted']}, drafted {spec['drafted']}; wall-clock against plain decoding "
        f"on a CPU (not a Metal figure): {wall}{bf16_tail(spec)}",
    ]


def bf16_tail(spec: dict) -> str:
    """The end of the mlx_vlm sentence: the bf16 divergence, or why it was not run."""
    if spec.get("stopped_early"):
        return f". Stopped early: {spec['stopped_early']}."
    if spec.get("bf16_divergent_prompts") is None:
        return "."
    after = (
        f" (after {spec['bf16_tokens_before_divergence']:.1f} tokens on average)"
        if spec.get("bf16_tokens_before_divergence") is not None
        else ""
    )
    return (
        f". In bf16, {spec['bf16_divergent_prompts']} of {spec['prompts']} prompts diverge "
        f"from plain greedy{after}: batched verification and single-token decoding round "
        "differently near ties."
    )
