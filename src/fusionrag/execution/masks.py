"""Visibility rules and the dense additive mask (the reference path and the padded decoder).

``visibility`` is the one statement of what a new token may see; every attention backend
implements it (the reference by materialising it, the others by construction) and the
tests compare them against it.
"""

from __future__ import annotations

import torch


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
    past_positions = past_positions.to(new_positions.device)
    past_ok = past_positions[None, :] <= new_positions[:, None]
    if past_hidden is not None:
        past_ok &= ~past_hidden.to(new_positions.device)[None, :]
    new_ok = new_positions[None, :] <= new_positions[:, None]
    return torch.cat([past_ok, new_ok], dim=1)
