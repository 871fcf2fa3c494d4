"""What the execution layer needs to know about a decoder's shape and its last attention layer.

One place that reads a Hugging Face causal LM's structure (in the spirit of transformers'
``cache_utils``): head sizes, a layer's query projection and per-head norm (the last layer's
for selection), the rotary embedding, the decoder body's layers. ``execution/`` asks a
:class:`ModelAdapter` instead of walking ``model.model.layers`` itself, so a family with another
layout needs one new adapter, not edits across the passes. RoPE's rotate-half lives in :mod:`fusionrag.models.rope`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from fusionrag.models.rope import rotate_half


class ModelAdapter:
    """Shapes and attention inputs of a Llama-style decoder (Llama, Qwen2, Qwen3, Mistral)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.num_heads: int = int(cfg.num_attention_heads)
        self.num_kv_heads: int = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def body(self) -> Any:
        """The decoder body (embeddings, layers, rotary embedding, final norm)."""
        return self.model.model

    @property
    def layers(self) -> Any:
        return self.body.layers

    @property
    def last_attention(self) -> Any:
        return self.layers[-1].self_attn

    def attention(self, layer: int = -1) -> Any:
        """Layer ``layer``'s attention module (negative: counted from the last)."""
        return self.layers[layer].self_attn

    def rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the model's own rotary embedding at ``positions`` (``[1, n]``)."""
        return self.body.rotary_emb(like, position_ids=positions)

    def inv_freq(self) -> torch.Tensor:
        """The model's own rotary inverse frequencies (float64, CPU), including linear/llama3 scaling.

        Dynamic rope types, which mutate ``inv_freq`` with the length, are refused (``models.compat``)."""
        return self.body.rotary_emb.inv_freq.detach().to(torch.float64).cpu()

    def attention_scale(self, layer: int = -1) -> float:
        """Layer ``layer``'s softmax scale (its own ``scaling`` where it has one, else ``head_dim ** -0.5``)."""
        scaling = getattr(self.attention(layer), "scaling", None)
        return float(scaling) if scaling is not None else self.head_dim ** -0.5

    @contextmanager
    def capture_queries(self, layer: int = -1) -> Iterator[list[torch.Tensor]]:
        """Collect layer ``layer``'s raw ``q_proj`` outputs (``[1, n, heads*head_dim]``) while inside."""
        captured: list[torch.Tensor] = []
        handle = self.attention(layer).q_proj.register_forward_hook(
            lambda _m, _i, out: captured.append(out.detach()))
        try:
            yield captured
        finally:
            handle.remove()

    def capture_last_queries(self) -> AbstractContextManager[list[torch.Tensor]]:
        """:meth:`capture_queries` of the last layer."""
        return self.capture_queries(-1)

    def finish_queries(self, q_proj_out: torch.Tensor, positions: torch.Tensor, layer: int = -1) -> torch.Tensor:
        """Raw ``q_proj`` output of layer ``layer`` -> post-norm, post-RoPE queries ``[heads, n, head_dim]`` (fp32),
        exactly as the layer computes them (Qwen3 normalises each head before RoPE)."""
        q = q_proj_out.reshape(1, -1, self.num_heads, self.head_dim)
        q_norm = getattr(self.attention(layer), "q_norm", None)
        if q_norm is not None:
            q = q_norm(q)
        q = q.transpose(1, 2)  # [1, heads, n, d]
        cos, sin = self.rotary(q, positions.reshape(1, -1).to(q.device))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * cos + rotate_half(q) * sin)[0].float()

    def empty_kv_shape(self, num_layers: int) -> tuple[int, int, int, int]:
        """``[layers, kv_heads, 0, head_dim]``: an empty past."""
        return (num_layers, self.num_kv_heads, 0, self.head_dim)
