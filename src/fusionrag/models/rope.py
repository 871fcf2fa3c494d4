"""Re-positioning of cached, post-RoPE keys.

Hugging Face caches keys *after* the rotary embedding (the "rotate_half" layout: the
first and second halves of each head dimension form the rotation pairs). A key
computed at position ``p`` is ``R(p) k``; since rotations compose,
``R(delta) R(p) k = R(p + delta) k``. Moving a stored chunk to a new offset is
therefore one extra rotation of its keys; values carry no position and stay as they are.

Angles are formed in float64 (``delta * inv_freq`` for deltas of thousands of
positions loses ~1e-4 rad in fp32) and the rotation itself runs in fp32, on whatever
device the keys are (the result keeps the keys' dtype: callers widen fp16/bf16 first).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate-half layout: ``(-x2, x1)`` of the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Return ``keys`` moved by ``delta`` positions (a new tensor; ``keys`` is not modified).

    ``keys`` is ``[..., seq, head_dim]`` (e.g. ``[layers, kv_heads, seq, head_dim]``);
    ``delta`` is an int (whole segment moves) or a ``[seq]`` tensor (per-token moves).
    """
    if isinstance(delta, int) and delta == 0:
        return keys.clone()
    delta64 = torch.as_tensor(delta, dtype=torch.float64, device=keys.device)
    angles = delta64.reshape(-1, 1) * inv_freq.to(keys.device).reshape(1, -1)  # [seq or 1, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)
    cos = angles.cos().to(torch.float32)
    sin = angles.sin().to(torch.float32)
    k32 = keys.to(torch.float32)
    rotated = k32 * cos + rotate_half(k32) * sin
    return rotated.to(keys.dtype)
