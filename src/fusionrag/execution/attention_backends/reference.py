"""The reference backend: the visibility rule as a dense additive mask, SDPA over repeated KV heads.

This is what every forward did before the mask-free paths (and what transformers does
with a 4D float mask): it is slow (the whole ``[n, T + n]`` score matrix, KV heads
copied ``Hq / Hkv`` times) but says exactly what each token sees, so the other backends
are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionrag.execution.attention_backends.spec import SparseQuery
from fusionrag.execution.masks import additive_mask, visibility


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float) -> torch.Tensor:
    """``[Hq, n, D]`` attention of ``q`` over past + new KV with the dense visibility mask."""
    groups = q.shape[0] // k_past.shape[0]
    key = ("reference_mask", q.dtype)
    if key not in spec.memo:  # built once per pass and shared by the layers, as the old path did
        spec.memo[key] = additive_mask(visibility(spec.past_positions(), spec.stale, spec.positions), q.dtype)
    mask = spec.memo[key]  # [1, 1, n, T + n]
    keys = torch.cat([k_past.to(q.dtype), k_new], dim=1).repeat_interleave(groups, dim=0)
    values = torch.cat([v_past.to(q.dtype), v_new], dim=1).repeat_interleave(groups, dim=0)
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale)[0]


def attend_in_place(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, base: int,
                    scale: float, memo: dict) -> torch.Tensor:
    """The in-place rule as a dense mask: query ``i`` sees slot ``t`` iff ``base + t <= positions[i]``."""
    groups = q.shape[0] // keys.shape[0]
    key = ("reference_in_place", q.dtype, positions.numel(), keys.shape[1])
    if key not in memo:  # once per pass (and once for a last-row call), shared by the layers
        slots = torch.arange(keys.shape[1], device=q.device) + base
        memo[key] = additive_mask(slots[None, :] <= positions[:, None], q.dtype)
    mask = memo[key]
    return F.scaled_dot_product_attention(q[None], keys.repeat_interleave(groups, dim=0)[None],
                                          values.repeat_interleave(groups, dim=0)[None], attn_mask=mask,
                                          scale=scale)[0]
