"""Refuse models whose cached keys cannot be moved to new positions by a rotation.

KV reuse relies on one identity: a RoPE key computed at position ``p`` and rotated by
``delta`` equals the key computed at ``p + delta``. That holds for plain, linear and
Llama-3 rope (all are ``angle = position * inv_freq`` with fixed ``inv_freq``) but not
for sliding-window attention (a reused token may have seen tokens it must not see),
ALiBi / learned absolute positions (no rotation to undo), or length-dependent rope
scaling (dynamic NTK, longrope, yarn: the frequencies depend on the sequence length).
"""

from __future__ import annotations

from typing import Any

from fusionrag.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "mistral", "qwen3"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


def rope_type_of(config: Any) -> str:
    """The rope type, read from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict):
        return str(params.get("rope_type") or params.get("type") or "default")
    return "default"


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` with the reason if ``config`` cannot be served."""
    model_type = getattr(config, "model_type", "?")
    name = f"model type '{model_type}'"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} is not supported: fusionrag serves RoPE decoder models of the "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} families. Models with ALiBi or learned "
            "absolute positions cannot have their KV re-positioned by rotation."
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"{name} uses sliding-window layers ({sorted(set(layer_types))}); a reused chunk's KV would "
            "have attended outside the window, so KV reuse is unsound for it."
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise UnsupportedModelError(
            f"{name} has sliding_window={config.sliding_window}; KV reuse is unsound with sliding windows."
        )
    rope_type = rope_type_of(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{name} uses rope scaling '{rope_type}', whose frequencies depend on sequence length; "
            f"supported rope types: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}."
        )
    if getattr(config, "position_embedding_type", "rope") not in ("rope", None):
        raise UnsupportedModelError(f"{name} does not use rotary position embeddings.")
