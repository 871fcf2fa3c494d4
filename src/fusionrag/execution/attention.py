"""Last-layer attention, recomputed from captured queries and cached keys.

Query-guided selection (FusionRAG) and Cache-Craft scoring need attention weights that
sdpa never materialises. Rather than switching the whole model to eager attention, we
capture the layer's queries where its attention function receives them (already normed and
rotated by the model's own code, whatever the family: :func:`attention_hook.capture`) and
recompute ``softmax(q k^T * scale)`` against the keys we hold.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from fusionrag.execution import attention_hook
from fusionrag.models.registry import LoadedModel


def capture_queries(lm: LoadedModel, layer: int = -1) -> AbstractContextManager[list[torch.Tensor]]:
    """Collect layer ``layer``'s queries (``[heads, n, head_dim]`` fp32, normed and rotated) while inside."""
    return attention_hook.capture(layer % lm.num_layers)


def attention_probs(queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention ``[heads, n, T]`` of ``queries [heads, n, d]`` over ``keys [kv_heads, T, d]``.

    ``allowed`` (``[n, T]`` booleans) marks visible keys; grouped-query heads share keys.
    """
    groups = queries.shape[0] // keys.shape[0]
    k = keys.float().repeat_interleave(groups, dim=0)
    scores = torch.matmul(queries, k.to(queries.device).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed.to(scores.device)[None], torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)


def attention_scale(lm: LoadedModel, layer: int = -1) -> float:
    """Layer ``layer``'s softmax scale (the last by default)."""
    return lm.adapter.attention_scale(layer)


def prefill_with_context_attention(
    lm: LoadedModel, ids: torch.Tensor, past, context_start: int = 0
):
    """Prefill ``ids`` right after ``past`` and score each new token's attention to the context.

    Returns the segment's KV and, per new token, the last layer's attention mass (summed
    over heads) on past positions ``>= context_start`` (e.g. the neighbour chunks, not
    ``S``). This is the simplified Cache-Craft signal: tokens that drew much from the
    preceding chunks are the ones whose reused KV goes most stale in another context.
    Both come back on the CPU, where the store writes them.
    """
    from fusionrag.execution.forward import prefill, visibility

    with capture_queries(lm) as captured:
        kv, _ = prefill(lm, ids, past=past)
    n = len(kv)
    device = lm.device
    positions = torch.arange(kv.base_position, kv.base_position + n, device=device)
    queries = captured[-1]
    past_len = 0 if past is None else len(past)
    last = kv.keys[-1].float()
    keys = last if past is None else torch.cat([past.keys[-1].to(device).float(), last], dim=1)
    past_positions = torch.arange(kv.base_position - past_len, kv.base_position, device=device)
    allowed = visibility(past_positions, None, positions)
    probs = attention_probs(queries, keys, allowed, attention_scale(lm))  # [heads, n, past+n]
    scores = probs[:, :, context_start:past_len].sum(dim=(0, 2))
    return kv.to(device="cpu"), scores.cpu()
