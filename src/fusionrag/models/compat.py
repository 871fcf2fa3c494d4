"""Which model families fusionrag serves, and why it refuses the others.

KV reuse relies on one identity: a RoPE key computed at position ``p`` and rotated by ``delta`` equals the
key computed at ``p + delta``. It holds for every rotary embedding whose angle is ``position * inv_freq``
with a fixed ``inv_freq`` (plain, linear, Llama-3, YaRN: YaRN's magnitude factor scales a key, which a
rotation keeps), over the whole head or its first ``rotary_dim`` dimensions (partial rotary: GPT-NeoX,
StableLM, Phi-4-mini); everything else in a layer (fused projections, norms before or after the
projection, multipliers, a mixture of experts) is the model's own code and needs nothing of us.

Where it holds only up to a length, the model is served up to that length (:func:`exact_context_limit`,
enforced per request): a sliding window equals full attention on a prompt no longer than the window
(Mistral-7B-v0.1, Qwen2 with ``use_sliding_window``); ``longrope`` switches to its long factors past
``original_max_position_embeddings`` (Phi-3-128k). It does not hold, and the model is refused, for
dynamic NTK scaling (the frequencies follow the sequence length, and vLLM's and transformers' versions
differ), ALiBi or learned absolute positions (no rotation to undo), and models that mix sliding and global
layers with soft-capped logits and two rope bases (Gemma 2 and 3).
"""

from __future__ import annotations

from typing import Any

from fusionrag.errors import UnsupportedModelError

#: Families served (``config.model_type``): exact at ratio 1 in both engines (tests/models/test_families.py).
SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "granite", "olmo2", "stablelm",
                         "gpt_neox"}
#: Rope types whose angles are ``position * inv_freq`` with fixed frequencies (``longrope``: up to its original length).
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}
#: Families refused on purpose, and why (said in one line at load).
REFUSED_FAMILIES = {
    "gemma2": "Gemma 2 alternates sliding-window (4096) and global layers and soft-caps its attention logits; "
              "fusionrag's attention paths do not soft-cap, so recomputed tokens would not match the model",
    "gemma3": "Gemma 3 mixes sliding-window and global layers with two rope bases (local 10k, global 1M); a stored "
              "chunk's keys would need a rotation per layer kind, which fusionrag does not keep",
    "gemma3_text": "Gemma 3 mixes sliding-window and global layers with two rope bases (local 10k, global 1M); a "
                   "stored chunk's keys would need a rotation per layer kind, which fusionrag does not keep",
}


def rope_parameters(config: Any) -> dict:
    """The rope parameters, from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def rope_type_of(config: Any) -> str:
    params = rope_parameters(config)
    return str(params.get("rope_type") or params.get("type") or "default")


def sliding_window_of(config: Any) -> int | None:
    """The attention window any layer of the model applies (None: every layer is global)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # transformers 5 says per layer (Qwen2: the layers from max_window_layers on, if enabled)
        return int(window) if window and "sliding_attention" in layer_types else None
    return int(window) if window and getattr(config, "use_sliding_window", True) else None


def exact_context_limit(config: Any) -> int | None:
    """The longest prompt (tokens) on which reuse is exact for this model, or None when there is no limit:
    the sliding window, and ``longrope``'s original length."""
    limits = []
    window = sliding_window_of(config)
    if window:
        limits.append(window)
    if rope_type_of(config) == "longrope":
        original = rope_parameters(config).get("original_max_position_embeddings") or \
            getattr(config, "original_max_position_embeddings", None)
        if original:
            limits.append(int(original))
    return min(limits) if limits else None


def limit_reason(config: Any) -> str:
    """Why :func:`exact_context_limit` is what it is, in words for an error message."""
    window = sliding_window_of(config)
    if window and window == exact_context_limit(config):
        return f"its attention window of {window} tokens (sliding-window layers equal full attention only within it)"
    return (f"its rope's original length of {exact_context_limit(config)} tokens (longrope switches to its long "
            "factors beyond it, which would change every stored chunk's rotation)")


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` with the reason if ``config`` cannot be served."""
    model_type = getattr(config, "model_type", "?")
    name = f"model type '{model_type}'"
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedModelError(f"{name} is not supported: {REFUSED_FAMILIES[model_type]}.")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} is not supported: fusionrag serves RoPE decoder models of the "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} families. Models with ALiBi or learned "
            "absolute positions cannot have their KV re-positioned by rotation."
        )
    rope_type = rope_type_of(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{name} uses rope scaling '{rope_type}', whose frequencies depend on sequence length; "
            f"supported rope types: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}."
        )
    if getattr(config, "position_embedding_type", "rope") not in ("rope", None):
        raise UnsupportedModelError(f"{name} does not use rotary position embeddings.")
