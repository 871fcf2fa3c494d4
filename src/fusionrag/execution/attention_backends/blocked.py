"""The mask-free torch backend: query blocks over only the keys they can reach, KV heads shared.

Queries come in ascending positions, so a block of consecutive queries ``a..b-1`` can see
at most the first ``e`` past slots (those at or before its last query) and new keys
``0..b-1``; everything after is never touched (the causal saving a dense mask forfeits:
at 15% of a 4K context the blocks reach ~60% of the dense ``[n, T + n]`` score matrix).
Each block is one call of torch's fused SDPA kernel over exactly that range, with
``enable_gqa`` (query heads read their KV head; no copy of the KV heads) and a boolean
mask of the block's own ``[m, e + b]`` range (stale slots, the slots between the block's
first and last query, the new keys after each query). No dense ``[n, T]`` float mask is
ever built, and the block masks depend only on the positions: they are built once per
pass (cached in ``spec.memo``) and shared by every layer.

Measured against the reference (masked SDPA over repeated KV heads) in decision 020
(``docs/decisions/020-sparse-pass-attention-a-mask-free-torch-backend.md``).

:func:`attend_in_place` is the same idea for an *in-place* pass (the sparse recompute): the
request's own prompt KV already holds every new token's fresh KV at its slot, so a query sees
exactly the slots at or before its position. No stale columns to skip, no past + new
concatenation: each block reads one prefix of the buffer (decision 050).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusionrag.execution.attention_backends.spec import SparseQuery

BLOCK = 64  # queries per block: smaller skips more keys, larger makes fewer, bigger calls (decision 020)
#: Queries per block of an in-place pass: 32 computed ~2% fewer score columns than 64 and ran as fast or
#: faster at 15% of 4K on one CPU thread (decision 050).
IN_PLACE_BLOCK = 32


@dataclass(frozen=True)
class _Block:
    a: int  # queries a..b-1
    b: int
    e: int  # past slots 0..e-1 may be visible to some query of the block
    allowed: torch.Tensor  # [m, e + b] bool: past slots 0..e-1, then new keys 0..b-1


def _plan(spec: SparseQuery, block: int) -> list[_Block]:
    pos = spec.positions
    n, device = pos.numel(), pos.device
    reach = (pos - spec.past_base + 1).clamp(0, spec.past_len).tolist()  # past slots at or before each query
    slots = torch.arange(spec.past_base, spec.past_base + spec.past_len, device=device)
    fresh = ~spec.stale if spec.stale is not None else None
    blocks = []
    for a in range(0, n, block):
        b = min(n, a + block)
        e = int(reach[b - 1])
        past = slots[None, :e] <= pos[a:b, None]  # [m, e]
        if fresh is not None:
            past &= fresh[None, :e]
        new = torch.arange(b, device=device)[None, :] <= torch.arange(a, b, device=device)[:, None]  # j <= i
        blocks.append(_Block(a, b, e, torch.cat([past, new], dim=1)))
    return blocks


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float, block: int = BLOCK) -> torch.Tensor:
    """``[Hq, n, D]`` attention of ``q`` over past + new KV, the visibility rule by construction."""
    key = ("blocked", block)
    if key not in spec.memo:
        spec.memo[key] = _plan(spec, block)
    out = torch.empty_like(q)
    for blk in spec.memo[key]:
        keys = torch.cat([k_past[:, : blk.e], k_new[:, : blk.b]], dim=1) if blk.e else k_new[:, : blk.b]
        values = torch.cat([v_past[:, : blk.e], v_new[:, : blk.b]], dim=1) if blk.e else v_new[:, : blk.b]
        out[:, blk.a: blk.b] = F.scaled_dot_product_attention(
            q[None, :, blk.a: blk.b], keys[None], values[None], attn_mask=blk.allowed[None, None], scale=scale,
            enable_gqa=True)[0]
    return out


def _in_place_plan(positions: torch.Tensor, base: int, block: int) -> list[tuple[int, int, int, torch.Tensor | None]]:
    """Blocks ``(a, b, e, allowed)``: queries ``a..b-1`` read slots ``0..e-1``; ``allowed`` is ``[m, e]``
    (slot at or before the query's position), ``None`` where every query sees all ``e`` slots."""
    slots_of = (positions - base).tolist()
    out = []
    for a in range(0, len(slots_of), block):
        b = min(len(slots_of), a + block)
        e = slots_of[b - 1] + 1
        allowed = None
        if slots_of[a] + 1 < e:
            allowed = torch.arange(e, device=positions.device)[None, :] <= (positions[a:b, None] - base)
        out.append((a, b, e, allowed))
    return out


def attend_in_place(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, base: int,
                    scale: float, memo: dict, block: int = IN_PLACE_BLOCK) -> torch.Tensor:
    """``[Hq, n, D]`` attention of ``q`` (at ``positions``) over the slots of ``keys``/``values``
    (``[Hkv, S, D]``, slot ``t`` at position ``base + t``): every slot at or before one's own position."""
    key = ("in_place", block, positions.numel(), int(positions[0]))
    if key not in memo:
        memo[key] = _in_place_plan(positions, base, block)
    out = torch.empty_like(q)
    for a, b, e, allowed in memo[key]:
        mask = None if allowed is None else allowed[None, None]
        out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], keys[None, :, :e], values[None, :, :e],
                                                     attn_mask=mask, scale=scale, enable_gqa=True)[0]
    return out
