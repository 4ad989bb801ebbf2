"""formats: the bytes of a model on disk.

safetensors headers and tensors (``tensors``), the qwen3_5_moe Hugging Face checkpoint layout
(``checkpoint``) and the Hugging Face -> MLX names and sanitize rules (``convert``).
May import core.
"""
