"""Q-Sparse-Attn in Triton: attention for a list of query positions over shared and fresh KV.

One program per (block of queries, query head). It streams the reused past KV of its
KV head (``h // groups``: grouped-query heads share it, nothing is repeated) only up to
the block's last query position, then the fresh KV of the recomputed tokens up to the
block's last query, with an online softmax (running max and sum in fp32). Visibility is
computed from the position list and a per-slot stale flag inside the kernel (fp32 inputs
multiply in full fp32, never TF32, so ratio 1 stays Full Attention to 1e-4): no mask is
materialised and no copy of the context is made. The past is only read, so requests
that share chunk KV can share it; the fresh KV stays in each request's own cache.

On CPU the same kernel runs under ``TRITON_INTERPRET=1`` (tests, tiny shapes).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from fusionrag.execution.attention_backends.spec import SparseQuery


def _online_softmax_step_src(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of masked scores ``s`` (hidden = -inf) and its values into the running softmax."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing visible yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


def _qsparse_kernel(q_ptr, kp_ptr, vp_ptr, kn_ptr, vn_ptr, pos_ptr, stale_ptr, out_ptr,
                    n, past_len, past_base, scale,
                    sq_h, sq_n, skp_h, skp_t, skn_h, skn_n, so_h, so_n,
                    GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUPS
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < n
    d_ok = offs_d < D
    q = tl.load(q_ptr + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies bf16 wrongly: it computes in fp32 instead
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=-1)
    last_pos = tl.max(pos, axis=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Reused past slots, up to the block's last query position (later slots are never visible).
    past_hi = tl.minimum(past_len, tl.maximum(last_pos - past_base + 1, 0))
    for start in range(0, past_hi, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        t_ok = offs_t < past_hi
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(kp_ptr + kvh * skp_h + offs_t[:, None] * skp_t + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        stale = tl.load(stale_ptr + offs_t, mask=t_ok, other=1)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        vis = (past_base + offs_t[None, :] <= pos[:, None]) & t_ok[None, :] & (stale[None, :] == 0)
        v = tl.load(vp_ptr + kvh * skp_h + offs_t[:, None] * skp_t + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(tl.where(vis, s, float("-inf")), v, m_i, l_i, acc, PRECISION)

    # Fresh keys of this pass: key j is visible to query i iff j <= i (positions ascend).
    new_hi = tl.minimum(n, (mb + 1) * BLOCK_M)
    for start in range(0, new_hi, BLOCK_N):
        offs_j = start + tl.arange(0, BLOCK_N)
        j_ok = offs_j < new_hi
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(kn_ptr + kvh * skn_h + offs_j[:, None] * skn_n + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        vis = (offs_j[None, :] <= offs_m[:, None]) & j_ok[None, :]
        v = tl.load(vn_ptr + kvh * skn_h + offs_j[:, None] * skn_n + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(tl.where(vis, s, float("-inf")), v, m_i, l_i, acc, PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows of the last block
    out = acc / l_safe[:, None]
    tl.store(out_ptr + h * so_h + offs_m[:, None] * so_n + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


@lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel, made on first use: Triton reads ``TRITON_INTERPRET`` when it wraps a function
    (the kernel finds its jitted helper under the global name it calls)."""
    global _online_softmax_step
    _online_softmax_step = triton.jit(_online_softmax_step_src)
    return triton.jit(_qsparse_kernel)


_online_softmax_step = None  # set by _kernel()


# Tile sizes and warps. On one H200 (Qwen2.5-7B shapes, bf16, 15% of 32K) nine tiles (64-256 query rows x
# 32-128 keys, 4-8 warps, 2-3 stages) ran 7.15-9.03 ms against masked SDPA's 15.35 ms, except 128 x 64
# with 4 warps (15.6 ms): the tile shape is not what limits the kernel (benchmarks/gpu/results/README.md).
DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float, config: dict[str, int] | None = None) -> torch.Tensor:
    """``[Hq, n, D]`` attention of ``q`` over past + new KV (see the module docstring); ``config``
    overrides :data:`DEFAULT_CONFIG`'s tile sizes, warps and pipeline stages."""
    unknown = set(config or {}) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"unknown kernel config keys {sorted(unknown)} (known: {sorted(DEFAULT_CONFIG)})")
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_m = cfg["block_m"]
    hq, n, d = q.shape
    hkv = k_new.shape[0]
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    k_past, v_past = k_past.contiguous(), v_past.contiguous()
    if spec.past_len == 0:  # the kernel still needs valid pointers for the (empty) past
        k_past = v_past = k_new
    if "triton_stale" not in spec.memo:
        stale = spec.stale if spec.stale is not None else torch.zeros(max(spec.past_len, 1), dtype=torch.bool,
                                                                      device=q.device)
        spec.memo["triton_stale"] = (stale.to(torch.int8).contiguous(), spec.positions.to(torch.int32).contiguous())
    stale8, pos32 = spec.memo["triton_stale"]
    out = torch.empty_like(q)
    grid = (triton.cdiv(n, block_m), hq)
    _kernel()[grid](
        q, k_past, v_past, k_new, v_new, pos32, stale8, out,
        n, spec.past_len, spec.past_base, float(scale),
        q.stride(0), q.stride(1), k_past.stride(0), k_past.stride(1), k_new.stride(0), k_new.stride(1),
        out.stride(0), out.stride(1),
        GROUPS=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (exactness); tf32 is bf16's no-op
        DOT_F32=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
