"""Q-Sparse-Attn in Triton: attention for a list of query positions over shared and fresh KV.

One program per (block of queries, query head). It streams the reused past KV of its
KV head (``h // groups``: grouped-query heads share it, nothing is repeated) only up to
the block's last query position, then the fresh KV of the recomputed tokens up to the
block's last query, with an online softmax (running max and sum in fp32). Visibility is
computed from the position list and a per-slot stale flag inside the kernel (fp32 inputs
multiply in full fp32, never TF32, so ratio 1 stays Full Attention to 1e-4): no mask is
materialised and no copy of the context is made. The past is only read, so requests
that share chunk KV can share it; the fresh KV stays in each request's own cache.

The tile loop (``_attend_rows``: the visibility rule, the past and fresh streams, the online
softmax) is shared with the GQA-packed kernel (:mod:`.qsparse_packed`), which only maps its
rows differently. On CPU the same kernel runs under ``TRITON_INTERPRET=1`` (tests, tiny shapes).
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


def _fold_tile_src(q, k_ptrs, v_ptrs, kv_mask, vis, scale, m_i, l_i, acc, PRECISION: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """Scores of the rows ``q`` against one K tile, hidden where not ``vis``, folded with its V tile."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    return _online_softmax_step(tl.where(vis, s, float("-inf")), v, m_i, l_i, acc, PRECISION)


def _attend_rows_src(q, pos, tok, new_hi, kvh, kp_ptr, vp_ptr, kn_ptr, vn_ptr, stale_ptr,
                     past_len, past_base, scale, skp_h, skp_t, skn_h, skn_n,
                     ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Attention of a tile of query rows over KV head ``kvh``, the visibility rule of the package: row ``r``
    (query ``tok[r]`` at position ``pos[r]``; padding rows have ``pos = -1``) sees past slot ``t`` iff
    ``past_base + t <= pos[r]`` and ``t`` is not stale, and fresh key ``j`` iff ``j <= tok[r]``. Streams the
    past only up to the tile's last position and the fresh keys up to ``new_hi``. Returns ``[ROWS, BLOCK_D]``
    fp32 (padding rows 0)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    last_pos = tl.max(pos, axis=0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)

    # Reused past slots, up to the tile's last query position (later slots are never visible).
    past_hi = tl.minimum(past_len, tl.maximum(last_pos - past_base + 1, 0))
    for start in range(0, past_hi, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        t_ok = offs_t < past_hi
        stale = tl.load(stale_ptr + offs_t, mask=t_ok, other=1)
        vis = (past_base + offs_t[None, :] <= pos[:, None]) & t_ok[None, :] & (stale[None, :] == 0)
        at = kvh * skp_h + offs_t[:, None] * skp_t + offs_d[None, :]
        m_i, l_i, acc = _fold_tile(q, kp_ptr + at, vp_ptr + at, t_ok[:, None] & d_ok[None, :], vis, scale,
                                   m_i, l_i, acc, PRECISION, DOT_F32)

    # Fresh keys of this pass: key j is visible to query i iff j <= i (positions ascend).
    for start in range(0, new_hi, BLOCK_N):
        offs_j = start + tl.arange(0, BLOCK_N)
        j_ok = offs_j < new_hi
        vis = (offs_j[None, :] <= tok[:, None]) & j_ok[None, :]
        at = kvh * skn_h + offs_j[:, None] * skn_n + offs_d[None, :]
        m_i, l_i, acc = _fold_tile(q, kn_ptr + at, vn_ptr + at, j_ok[:, None] & d_ok[None, :], vis, scale,
                                   m_i, l_i, acc, PRECISION, DOT_F32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows
    return acc / l_safe[:, None]


def _qsparse_kernel(q_ptr, kp_ptr, vp_ptr, kn_ptr, vn_ptr, pos_ptr, stale_ptr, out_ptr,
                    n, past_len, past_base, scale,
                    sq_h, sq_n, skp_h, skp_t, skn_h, skn_n, so_h, so_n,
                    GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < n)[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :], mask=mask, other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies bf16 wrongly: it computes in fp32 instead
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + offs_m, mask=offs_m < n, other=-1)
    out = _attend_rows(q, pos, offs_m, tl.minimum(n, (mb + 1) * BLOCK_M), h // GROUPS, kp_ptr, vp_ptr, kn_ptr,
                       vn_ptr, stale_ptr, past_len, past_base, scale, skp_h, skp_t, skn_h, skn_n,
                       BLOCK_M, D, BLOCK_N, BLOCK_D, PRECISION, DOT_F32)
    tl.store(out_ptr + h * so_h + offs_m[:, None] * so_n + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@lru_cache(maxsize=1)
def helpers():
    """Jit the kernels' shared helpers into this module, where the kernels find them by name (made on first
    use: Triton reads ``TRITON_INTERPRET`` when it wraps a function); returns the jitted tile loop."""
    global _online_softmax_step, _fold_tile, _attend_rows
    _online_softmax_step = triton.jit(_online_softmax_step_src)
    _fold_tile = triton.jit(_fold_tile_src)
    _attend_rows = triton.jit(_attend_rows_src)
    return _attend_rows


@lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel, made on first use (see :func:`helpers`)."""
    helpers()
    return triton.jit(_qsparse_kernel)


_online_softmax_step = _fold_tile = _attend_rows = None  # set by helpers()


# Tile sizes and warps. On one H200 (Qwen2.5-7B shapes, bf16, 15% of 32K) nine tiles (64-256 query rows x
# 32-128 keys, 4-8 warps, 2-3 stages) ran 7.15-9.03 ms against masked SDPA's 15.35 ms, except 128 x 64
# with 4 warps (15.6 ms): the tile shape is not what limits the kernel (benchmarks/gpu/results/README.md).
DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


def interpreting() -> bool:
    """Whether kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def precision_flags(dtype: torch.dtype) -> dict[str, object]:
    """The kernels' dot-product settings: fp32 stays fp32 (exactness; tf32 is bf16's no-op), and bf16 is
    widened under the interpreter (which multiplies bf16 wrongly)."""
    return {"PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "DOT_F32": dtype == torch.bfloat16 and interpreting()}


def kernel_inputs(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor,
                  v_new: torch.Tensor, spec: SparseQuery) -> tuple[torch.Tensor, ...]:
    """``(q, k_past, v_past, k_new, v_new, stale int8, positions int32)`` as the kernels read them: contiguous,
    an empty past pointing at valid memory, the per-pass stale flags and positions made once (``spec.memo``)."""
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    k_past, v_past = k_past.contiguous(), v_past.contiguous()
    if spec.past_len == 0:  # the kernel still needs valid pointers for the (empty) past
        k_past = v_past = k_new
    if "triton_stale" not in spec.memo:
        stale = spec.stale if spec.stale is not None else torch.zeros(max(spec.past_len, 1), dtype=torch.bool,
                                                                      device=q.device)
        spec.memo["triton_stale"] = (stale.to(torch.int8).contiguous(), spec.positions.to(torch.int32).contiguous())
    return (q, k_past, v_past, k_new, v_new, *spec.memo["triton_stale"])


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
    q, k_past, v_past, k_new, v_new, stale8, pos32 = kernel_inputs(q, k_past, v_past, k_new, v_new, spec)
    out = torch.empty_like(q)
    grid = (triton.cdiv(n, block_m), hq)
    _kernel()[grid](
        q, k_past, v_past, k_new, v_new, pos32, stale8, out,
        n, spec.past_len, spec.past_base, float(scale),
        q.stride(0), q.stride(1), k_past.stride(0), k_past.stride(1), k_new.stride(0), k_new.stride(1),
        out.stride(0), out.stride(1),
        GROUPS=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_D=max(16, triton.next_power_of_2(d)),
        **precision_flags(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
