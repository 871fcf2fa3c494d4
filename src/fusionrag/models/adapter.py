"""What the execution layer needs to know about a decoder's shape.

One place that reads a Hugging Face causal LM's structure (in the spirit of transformers'
``cache_utils``): head sizes, the decoder body's layers and attention modules, the rotary embedding.
``execution/`` asks a :class:`ModelAdapter` instead of walking ``model.model.layers`` itself. RoPE's
rotate-half lives in :mod:`fusionrag.models.rope`.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelAdapter:
    """Shapes, layers and rotary embedding of a transformers decoder of any supported family
    (:mod:`fusionrag.models.compat`): the body is the model's ``base_model`` (``model.model``,
    ``model.gpt_neox``), each layer's attention its ``self_attn`` (``attention`` in GPT-NeoX). Queries are
    not rebuilt here from a projection: the attention function receives them finished (normed, rotated, as
    each family does it) and hands them to a capture (:func:`fusionrag.execution.attention_hook.capture`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.num_heads: int = int(cfg.num_attention_heads)
        kv_heads = None if cfg.model_type in MULTI_HEAD_ONLY else getattr(cfg, "num_key_value_heads", None)
        self.num_kv_heads: int = int(kv_heads or cfg.num_attention_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def body(self) -> Any:
        """The decoder body (embeddings, layers, rotary embedding, final norm)."""
        return self.model.base_model

    @property
    def layers(self) -> Any:
        return self.body.layers

    @property
    def last_attention(self) -> Any:
        return self.attention(-1)

    def attention(self, layer: int = -1) -> Any:
        """Layer ``layer``'s attention module (negative: counted from the last)."""
        block = self.layers[layer]
        return getattr(block, "self_attn", None) or block.attention

    def rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the model's own rotary embedding at ``positions`` (``[1, n]``)."""
        return self.body.rotary_emb(like, position_ids=positions)

    def inv_freq(self) -> torch.Tensor:
        """The model's own rotary inverse frequencies (float64, CPU), including linear/llama3/YaRN scaling;
        ``rotary_dim / 2`` of them for a partial rotary embedding.

        Length-dependent rope types are refused or limited to the length where they are fixed (``models.compat``)."""
        return self.body.rotary_emb.inv_freq.detach().to(torch.float64).cpu()

    def attention_scale(self, layer: int = -1) -> float:
        """Layer ``layer``'s softmax scale (its own ``scaling`` where it has one, else ``head_dim ** -0.5``)."""
        scaling = getattr(self.attention(layer), "scaling", None)
        return float(scaling) if scaling is not None else self.head_dim ** -0.5

    def empty_kv_shape(self, num_layers: int) -> tuple[int, int, int, int]:
        """``[layers, kv_heads, 0, head_dim]``: an empty past."""
        return (num_layers, self.num_kv_heads, 0, self.head_dim)


#: Families without grouped-query attention: as many KV heads as query heads, whatever the config says.
MULTI_HEAD_ONLY = {"gpt_neox"}
