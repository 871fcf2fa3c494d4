"""APE's attention (Adaptive Parallel Encoding, Yang et al., ICLR 2025) for tokens after a parallel context.

Chunks encoded in parallel (each right after ``S``, never seeing each other) give a later
token an attention distribution unlike sequential encoding's; APE realigns it without
training (its section 4.3-4.4 and the authors' released code, which treats all chunks as one
context block): the logits on context keys are divided by a temperature ``T``, and the
context block's log-sum-exp is multiplied by ``S * T`` before it is merged with the rest
(``S``'s keys and the token's own, causal), that is

    weight_j ∝ exp(s_j / T) * exp((S*T - 1) * LSE_C)   for context keys j,
    weight_j ∝ exp(s_j)                                for every other visible key,

with ``LSE_C = logsumexp_j∈C(s_j / T)`` per query and head, one softmax over all keys. ``T = S = 1``
is plain attention. The scores are written out (the queries after a context are few: the
question, the answer being scored or decoded), so every device runs it; there is no kernel.
"""

from __future__ import annotations

import torch

from fusionrag.execution.attention_backends.spec import SparseQuery
from fusionrag.execution.masks import visibility
from fusionrag.kvcache.kv import ParallelContext


def parallel_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                       context: torch.Tensor, rule: ParallelContext, scale: float) -> torch.Tensor:
    """``[Hq, n, D]``: ``q [Hq, n, D]`` over ``keys``/``values [Hkv, N, D]`` (grouped heads shared),
    ``allowed [n, N]`` bool (what each query sees), ``context [N]`` bool (the parallel chunks' keys)."""
    groups = q.shape[0] // keys.shape[0]
    k = keys.to(torch.float32).repeat_interleave(groups, dim=0)
    v = values.to(torch.float32).repeat_interleave(groups, dim=0)
    logits = torch.einsum("hnd,hkd->hnk", q.to(torch.float32), k) * scale  # [Hq, n, N]
    ctx = context.to(logits.device)[None, None, :] & allowed.to(logits.device)[None]  # [1, n, N]
    tempered = logits / rule.temperature
    lse_c = torch.where(ctx, tempered, -torch.inf).logsumexp(dim=-1, keepdim=True)  # [Hq, n, 1]
    boost = ((rule.scale * rule.temperature - 1.0) * lse_c).nan_to_num(0.0, 0.0, 0.0)  # no context seen: none
    adjusted = torch.where(ctx, tempered + boost, logits).masked_fill(~allowed.to(logits.device)[None], -torch.inf)
    return (adjusted.softmax(dim=-1) @ v).to(q.dtype)


def context_flags(rule: ParallelContext, past_len: int, new: int, device: torch.device) -> torch.Tensor:
    """``[past_len + new]`` bool: which keys of a pass over a parallel prompt are its context."""
    flags = torch.zeros(past_len + new, dtype=torch.bool, device=device)
    flags[rule.start: min(rule.stop, past_len)] = True
    return flags


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float) -> torch.Tensor:
    """The sparse-pass backend for a past that carries a :class:`ParallelContext` (``spec.parallel``)."""
    rule = spec.parallel
    if rule is None:
        raise ValueError("the parallel backend needs spec.parallel")
    key = ("parallel",)
    if key not in spec.memo:  # the same for every layer of the pass
        n = spec.positions.numel()
        spec.memo[key] = (visibility(spec.past_positions(), spec.stale, spec.positions),
                          context_flags(rule, spec.past_len, n, q.device))
    allowed, context = spec.memo[key]
    keys = torch.cat([k_past.to(k_new.dtype), k_new], dim=1)
    values = torch.cat([v_past.to(v_new.dtype), v_new], dim=1)
    return parallel_attention(q, keys, values, allowed, context, rule, scale)
