"""One forward pass of new tokens on top of reused KV, at explicit positions.

Every pass gets an explicit additive float mask (``finfo.min`` for "not visible"),
never a boolean one and never the library's implicit causal mask: with reused and
sparsely recomputed KV, "causal" is not "earlier in the cache", and transformers'
mask helpers also infer packed sequences from gaps in ``position_ids``. A 4D mask is
used as given, so what each token sees is exactly what this module says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel


def to_dynamic_cache(kv: KV | None) -> DynamicCache:
    """A transformers cache holding a *copy* of ``kv`` (the forward appends to it in place)."""
    if kv is None or len(kv) == 0:
        return DynamicCache()
    data = [(kv.keys[i].unsqueeze(0), kv.values[i].unsqueeze(0)) for i in range(kv.num_layers)]
    return DynamicCache(ddp_cache_data=data)  # DynamicLayer.update concatenates: a fresh tensor


def cache_tail(cache: DynamicCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``n`` tokens' keys and values of every layer, stacked ``[L, H, n, D]``."""
    keys = torch.stack([layer.keys[0, :, -n:] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, -n:] for layer in cache.layers])
    return keys, values


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Booleans -> additive mask (0 visible, finfo.min hidden): ``[q, kv]`` -> ``[1, 1, q, kv]``,
    ``[B, q, kv]`` -> ``[B, 1, q, kv]`` (one mask per batch row, shared by the heads)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    hidden = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    mask = torch.where(allowed, zero, hidden)
    return mask[None, None] if mask.dim() == 2 else mask[:, None]


def visibility(
    past_positions: torch.Tensor, past_hidden: torch.Tensor | None, new_positions: torch.Tensor
) -> torch.Tensor:
    """Which keys each new token may attend to: every position at or before its own.

    ``past_hidden`` marks past slots whose KV is stale because the same token is being
    recomputed in this pass (its fresh copy is among the new tokens instead).
    """
    past_ok = past_positions[None, :] <= new_positions[:, None]
    if past_hidden is not None:
        past_ok &= ~past_hidden[None, :]
    new_ok = new_positions[None, :] <= new_positions[:, None]
    return torch.cat([past_ok, new_ok], dim=1)


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [n_kept, vocab] for the kept positions
    keys: torch.Tensor  # [L, H, n, D] fresh KV of the new tokens, in input order
    values: torch.Tensor
    cache: DynamicCache  # past + new tokens (for continuing, e.g. decoding)


def forward(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    past: KV | DynamicCache | None = None,
    past_positions: torch.Tensor | None = None,
    past_hidden: torch.Tensor | None = None,
    logits_to_keep: int = 1,
) -> ForwardResult:
    """Run ``input_ids`` at ``positions`` on top of ``past``.

    ``past_positions`` defaults to ``0..len(past)-1`` (an assembled cache starting at 0).
    A ``DynamicCache`` past is extended in place (used by decoding); a ``KV`` past is
    copied, so shared caches are never modified.
    """
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if isinstance(past, DynamicCache):
        cache = past
        past_len = cache.get_seq_length()
    else:
        cache = to_dynamic_cache(past)
        past_len = 0 if past is None else len(past)
    if past_positions is None:
        past_positions = torch.arange(past_len)
    allowed = visibility(past_positions, past_hidden, positions)
    out = lm.model(
        input_ids=input_ids[None],
        position_ids=positions[None],
        attention_mask=additive_mask(allowed, lm.model.dtype),
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    keys, values = cache_tail(cache, input_ids.numel())
    return ForwardResult(out.logits[0].float(), keys, values, cache)


def prefill(lm: LoadedModel, input_ids: torch.Tensor, past: KV | None = None, start: int | None = None,
            logits_to_keep: int = 1) -> tuple[KV, torch.Tensor]:
    """KV of a contiguous segment computed on top of ``past`` (consecutive positions).

    The segment starts right after ``past`` unless ``start`` says otherwise. Returns the
    segment's own KV (not including ``past``) and the kept logits.
    """
    past_len = 0 if past is None else len(past)
    after_past = 0 if past is None else past.base_position + past_len
    base = after_past if start is None else start
    n = int(torch.as_tensor(input_ids).numel())
    past_positions = None if past is None else torch.arange(past.base_position, past.base_position + past_len)
    res = forward(lm, input_ids, torch.arange(base, base + n), past, past_positions,
                  logits_to_keep=logits_to_keep)
    return KV(res.keys, res.values, base), res.logits


def forward_first_layers(
    lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, past: KV | None, n_layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh KV of the first ``n_layers`` layers only (CacheBlend's cheap probe).

    Runs the embedding and the first decoder layers by hand (the model's own modules, in
    its own order), causal over ``past`` + the new tokens. Returns ``[n_layers, H, n, D]``.
    """
    body = lm.model.model
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(1, -1)
    past_len = 0 if past is None else len(past)
    cache = to_dynamic_cache(None if past is None else KV(past.keys[:n_layers], past.values[:n_layers],
                                                          past.base_position))
    past_positions = torch.arange(past_len) if past is None else torch.arange(
        past.base_position, past.base_position + past_len)
    mask = additive_mask(visibility(past_positions, None, positions[0]), lm.model.dtype)
    hidden = body.embed_tokens(input_ids)
    pos_emb = body.rotary_emb(hidden, position_ids=positions)
    for layer in body.layers[:n_layers]:
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                       position_embeddings=pos_emb)
    return cache_tail(cache, input_ids.shape[1])
