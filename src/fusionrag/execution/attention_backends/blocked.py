"""The mask-free torch backend: query blocks over the keys they can see, heads grouped by reshaping.

Queries come in ascending positions, so a block of consecutive queries ``a..b-1`` can see
at most the first ``e`` past slots (those at or before its last query) and new keys
``0..b-1``; everything after is never touched (the causal saving a dense mask forfeits).
Inside that range only three things are hidden, each without a dense ``[n, T]`` mask:
stale past slots (whole columns, ``index_fill``), past slots between the block's first
and last query (a ``[m, e - f]`` tail, at most one block wide in positions) and new keys
after the query (a ``[m, m]`` triangle). Grouped-query heads read their KV head through a
reshape (``[Hkv, groups * m, D]``), never a copy of the KV heads.

The block layout depends only on the positions, so it is computed once per pass (cached
in ``spec.memo``) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusionrag.execution.attention_backends.spec import SparseQuery

BLOCK = 64  # queries per block: smaller skips more keys, larger makes fewer, bigger matmuls (docs/decisions.md)


@dataclass(frozen=True)
class _Block:
    a: int  # queries a..b-1
    b: int
    e: int  # past slots 0..e-1 may be visible to the block's last query
    f: int  # past slots 0..f-1 are visible (unless stale) to every query of the block
    stale_cols: torch.Tensor  # stale slots < e
    tail_hidden: torch.Tensor | None  # [m, e - f]: slot f + c hidden from query a + r
    triangle: torch.Tensor  # [m, m]: new key a + c hidden from query a + r (c > r)


def _plan(spec: SparseQuery, block: int) -> list[_Block]:
    pos = spec.positions
    n, device = pos.numel(), pos.device
    seen = (pos - spec.past_base + 1).clamp(0, spec.past_len).tolist()  # past slots visible to each query
    stale_idx = spec.stale.nonzero().squeeze(1) if spec.stale is not None else None
    blocks = []
    for a in range(0, n, block):
        b = min(n, a + block)
        e, f = int(seen[b - 1]), int(seen[a])
        stale_cols = stale_idx[stale_idx < e] if stale_idx is not None else torch.empty(0, dtype=torch.long,
                                                                                         device=device)
        tail = None
        if e > f:
            slots = torch.arange(spec.past_base + f, spec.past_base + e, device=device)
            tail = slots[None, :] > pos[a:b, None]
        m = b - a
        triangle = torch.ones(m, m, dtype=torch.bool, device=device).triu(1)
        blocks.append(_Block(a, b, e, f, stale_cols, tail, triangle))
    return blocks


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float, block: int = BLOCK) -> torch.Tensor:
    """``[Hq, n, D]`` attention of ``q`` over past + new KV, the visibility rule by construction."""
    hq, n, d = q.shape
    hkv = k_new.shape[0]
    groups = hq // hkv
    key = ("blocked", block)
    if key not in spec.memo:
        spec.memo[key] = _plan(spec, block)
    qg = (q * scale).reshape(hkv, groups, n, d)
    out = torch.empty_like(qg)
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    for blk in spec.memo[key]:
        m, e = blk.b - blk.a, blk.e
        keys = torch.cat([k_past[:, :e], k_new[:, : blk.b]], dim=1) if e else k_new[:, : blk.b]
        values = torch.cat([v_past[:, :e], v_new[:, : blk.b]], dim=1) if e else v_new[:, : blk.b]
        scores = torch.bmm(qg[:, :, blk.a: blk.b].reshape(hkv, groups * m, d), keys.transpose(1, 2))
        if low_precision:
            scores = scores.float()
        s4 = scores.view(hkv, groups, m, e + blk.b)
        if blk.stale_cols.numel():
            scores.index_fill_(2, blk.stale_cols, float("-inf"))
        if blk.tail_hidden is not None:
            s4[..., blk.f: e].masked_fill_(blk.tail_hidden, float("-inf"))
        s4[..., e + blk.a:].masked_fill_(blk.triangle, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out[:, :, blk.a: blk.b] = torch.bmm(probs, values).view(hkv, groups, m, d)
    return out.reshape(hq, n, d)
