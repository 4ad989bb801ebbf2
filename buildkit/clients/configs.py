"""What each client needs beside the weights: mlx_vlm's drafter config and image-prompt files."""

from __future__ import annotations

from buildkit.formats.checkpoint import HEAD_PREFIX

PROCESSOR_FILES = ("preprocessor_config.json",)


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


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
