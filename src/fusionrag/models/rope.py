"""Re-positioning of cached, post-RoPE keys.

Hugging Face caches keys *after* the rotary embedding (the "rotate_half" layout: the
first and second halves of each head dimension form the rotation pairs). A key
computed at position ``p`` is ``R(p) k``; since rotations compose,
``R(delta) R(p) k = R(p + delta) k``. Moving a stored chunk to a new offset is
therefore one extra rotation of its keys; values carry no position and stay as they are.

A partial rotary embedding (GPT-NeoX, StableLM, Phi-4-mini) rotates only the first ``rotary_dim``
dimensions of a head (rotate-half within them) and leaves the rest: ``inv_freq`` then has
``rotary_dim / 2`` entries, and the dimensions after ``2 * len(inv_freq)`` move unchanged.

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


def rotation(delta: int | torch.Tensor, inv_freq: torch.Tensor,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[len(delta), head_dim/2]`` fp32 of the angles ``delta * inv_freq``, formed in float64."""
    delta64 = torch.as_tensor(delta, dtype=torch.float64, device=device)
    angles = delta64.reshape(-1, 1) * inv_freq.to(delta64.device).reshape(1, -1)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rotate_into(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Write ``keys`` (``[..., seq, head_dim]``) rotated by ``(cos, sin)`` (``[seq or 1, rotary_dim/2]`` fp32
    from :func:`rotation`) into ``out`` (same shape, any float dtype): fp32 math (fp16/bf16 keys promote
    exactly against the fp32 cos/sin; no widened copy is made), one cast on the write. The halves are
    rotate-half's pairs: ``(x1 c - x2 s, x2 c + x1 s)``, bit for bit ``k c + rotate_half(k) s``; the
    dimensions after ``rotary_dim`` (a partial rotary embedding) are copied."""
    if keys.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        keys = keys.to(torch.float32)
    half = cos.shape[-1]
    x1, x2 = keys[..., :half], keys[..., half:2 * half]
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:2 * half])
    if 2 * half < keys.shape[-1]:
        out[..., 2 * half:] = keys[..., 2 * half:]


def rotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Return ``keys`` moved by ``delta`` positions (a new tensor; ``keys`` is not modified).

    ``keys`` is ``[..., seq, head_dim]`` (e.g. ``[layers, kv_heads, seq, head_dim]``);
    ``delta`` is an int (whole segment moves) or a ``[seq]`` tensor (per-token moves).
    """
    if isinstance(delta, int) and delta == 0:
        return keys.clone()
    cos, sin = rotation(delta, inv_freq, keys.device)
    out = torch.empty_like(keys)
    rotate_into(out, keys, cos, sin)
    return out


#: A key moved by :func:`rotate_keys` against the key computed at the target position, relative to its largest
#: magnitude: float32 (the model forms angles as ``position * inv_freq`` in fp32, ~pos * 1e-7 rad from the float64
#: rotation), and a reduced dtype (bf16 keeps 8 bits: 2^-8 is one step; the model rotates in bf16, the
#: re-positioning in fp32, 2-3 steps apart at the largest key; a wrong angle is off by O(1)).
KEY_REL_TOL = 1e-4
REDUCED_KEY_REL_TOL = 2.0 ** -5
