"""Q-Sparse-Attn, GQA-packed: one program per (block of queries, KV head), K/V read once per KV head.

The per-head kernel (:mod:`.qsparse_triton`) runs one program per (query block, query head),
so the ``G = Hq / Hkv`` query heads of a KV head (Qwen2.5-7B: 28 / 4, G = 7) stream the same
K/V tiles G times. Here the G query heads of one KV head share a program: its tile of
``BLOCK_R`` rows holds ``TOKENS = BLOCK_R // G`` consecutive queries x G heads,
**token-major** (row ``r`` is query ``r // G`` of the block, head ``kvh * G + r % G``), and each
K/V tile it loads serves every row. Why token-major rather than head-major
(``r = g * TOKENS + t``): G need not be a power of two (7 is not), and token-major wastes only
``BLOCK_R mod G`` padding rows (2 of 128 at G = 7) where a head-major tile would pad G to 8
(16 of 128); the visibility of a row depends only on its token, and a block's tokens are
consecutive either way, so the past it streams (up to its last query's position) and the
fresh keys it streams (up to its last query) are the same. Rows are gathered from ``q [Hq, n, D]``
and scattered back to ``out`` by address: no copy of the queries is made. K/V traffic: a
KV head's tiles are read once per ``TOKENS`` queries instead of once per 64 queries and query
head, for 128 rows at G = 7, 18 queries x 7 heads per read:
half the per-head kernel's reads at its 64-row tiles, and each program's queries span ~1/3.5 of
the positions (a tighter causal bound on the past it streams).

Visibility is the package's rule, computed in the kernel from the position list and the
per-slot stale flags by the per-head kernel's own tile loop (``qsparse_triton._attend_rows``):
row ``r`` (query ``i``) sees past slot ``t`` iff ``past_base + t <= p[i]`` and ``t`` is not
stale, and fresh key ``j`` iff ``j <= i`` (positions ascend, gaps allowed). Online softmax in
fp32; fp32 inputs multiply in full fp32 (``ieee``), so ratio 1 stays Full Attention to 1e-4.

Tiles are autotuned (``triton.autotune``) over a few shapes, keyed on head size, group size,
the dtypes and a coarse bucket of the query count (a 32-token question pass wants small tiles
for parallelism, a 5,000-query recompute pass large ones for reuse); under
``TRITON_INTERPRET=1`` there is one small config, so nothing is benchmarked. ``config=``
bypasses the autotuner (tests, the GPU tile sweep).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from fusionrag.execution.attention_backends.qsparse_triton import helpers, interpreting, kernel_inputs, precision_flags
from fusionrag.execution.attention_backends.spec import SparseQuery


def _packed_kernel(q_ptr, kp_ptr, vp_ptr, kn_ptr, vn_ptr, pos_ptr, stale_ptr, out_ptr,
                   n, n_new, past_len, past_base, scale, n_bucket,
                   sq_h, sq_n, skp_h, skp_t, skn_h, skn_n, so_h, so_n,
                   GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    TOKENS = BLOCK_R // GROUPS  # queries per program (a constexpr: both operands are)
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)
    tok = qb * TOKENS + rows // GROUPS  # token-major: a query's G heads are adjacent rows
    head = kvh * GROUPS + rows % GROUPS
    r_ok = (rows < TOKENS * GROUPS) & (tok < n)
    offs_d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + head[:, None] * sq_h + tok[:, None] * sq_n + offs_d[None, :], mask=mask, other=0.0)
    if DOT_F32:  # Triton's CPU interpreter multiplies bf16 wrongly: it computes in fp32 instead
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + tok, mask=r_ok, other=-1)  # padding rows see nothing
    out = _attend_rows(q, pos, tok, tl.minimum(n_new, (qb + 1) * TOKENS), kvh, kp_ptr, vp_ptr, kn_ptr, vn_ptr,
                       stale_ptr, past_len, past_base, scale, skp_h, skp_t, skn_h, skn_n,
                       BLOCK_R, D, BLOCK_N, BLOCK_D, PRECISION, DOT_F32)
    tl.store(out_ptr + head[:, None] * so_h + tok[:, None] * so_n + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


_attend_rows = None  # set by _kernels(): the per-head kernel's tile loop (one visibility rule for both)

# (rows, keys per tile, warps, stages). Rows hold BLOCK_R // G queries x G heads (9 x 7 in 64 rows at G = 7).
# Chosen without a GPU from ptxas's resource report for sm_90 (Qwen2.5-7B: D 128, G 7, bf16; Triton 3.9,
# benchmarks/gpu/kernel_compile.py): these spill nothing (64 x 64 x 4 warps: 24 bytes); 256 rows spill at any
# warp count (16 warps cap registers at 128), as do 128 rows at 4 warps and 128-key tiles; 2 or 3 stages made
# no difference to shared memory. The GPU run's autotuner picks among them.
GPU_TILES = ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3))
INTERPRETER_TILE = (64, 64, 4, 2)  # one config: the interpreter would otherwise time every tile in Python
CONFIG_KEYS = ("block_r", "block_n", "num_warps", "num_stages")


def _config(tile: tuple[int, int, int, int]) -> triton.Config:
    block_r, block_n, warps, stages = tile
    return triton.Config({"BLOCK_R": block_r, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _prune(configs, named_args, **kwargs):
    """Only tiles with room for at least one query's G heads (all of them at G <= 64)."""
    groups = kwargs.get("GROUPS", named_args.get("GROUPS", 1))
    fit = [c for c in configs if c.kwargs["BLOCK_R"] >= groups]
    return fit or [max(configs, key=lambda c: c.kwargs["BLOCK_R"])]


@lru_cache(maxsize=1)
def _kernels():
    """``(jitted, autotuned)`` kernels, made on first use (Triton reads ``TRITON_INTERPRET`` when it wraps a
    function); the autotuner's cache is keyed on head size, group size, query-count bucket and dtypes."""
    global _attend_rows
    _attend_rows = helpers()
    jitted = triton.jit(_packed_kernel)
    tiles = [INTERPRETER_TILE] if interpreting() else GPU_TILES
    tuned = triton.autotune(configs=[_config(t) for t in tiles], key=["D", "GROUPS", "n_bucket"],
                            prune_configs_by={"early_config_prune": _prune})(jitted)
    return jitted, tuned


def n_bucket(n: int) -> int:
    """The autotuner's query-count class: powers of 4 from 16 to 4096 (always a multiple of 16, so the
    argument never changes the kernel's integer specialisation)."""
    b = 16
    while b < n and b < 4096:
        b *= 4
    return b


def best_configs() -> dict:
    """The autotuner's choice per key so far (for the GPU benchmark's record)."""
    _, tuned = _kernels()
    cfg = lambda c: {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}  # noqa: E731
    if len(tuned.configs) == 1:  # the interpreter's one tile: nothing is tuned or cached
        return {"only tile": cfg(tuned.configs[0])}
    return {str(k): cfg(c) for k, c in tuned.cache.items()}


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float, config: dict[str, int] | None = None) -> torch.Tensor:
    """``[Hq, n, D]`` attention of ``q`` over past + new KV (see the module docstring). ``config``
    (``block_r``, ``block_n``, ``num_warps``, ``num_stages``) fixes the tile instead of autotuning."""
    _check_config(config, q.shape[0] // k_new.shape[0])
    q, k_past, v_past, k_new, v_new, stale8, pos32 = kernel_inputs(q, k_past, v_past, k_new, v_new, spec)
    return _launch(q, k_past, v_past, k_new, v_new, stale8, pos32, spec, scale, q.shape[1], config)


def attend_in_place(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, base: int,
                    scale: float, memo: dict, config: dict[str, int] | None = None) -> torch.Tensor:
    """The in-place pass (decision 050) on the packed kernel: every query reads the slots of ``keys``/``values``
    at or before its position. The same kernel with the buffer as its past, no stale slot and no fresh keys
    (a pass that wrote its fresh KV into the buffer has none left to stream)."""
    _check_config(config, q.shape[0] // keys.shape[0])
    key = ("packed_in_place", positions.numel(), int(positions[0]))
    if key not in memo:  # the pass's positions over this buffer; its own memo keeps the kernel's inputs
        memo[key] = SparseQuery(positions, base, keys.shape[1])
    spec = memo[key]
    q, keys, values, _, _, stale8, pos32 = kernel_inputs(q, keys, values, keys, values, spec)
    return _launch(q, keys, values, keys, values, stale8, pos32, spec, scale, 0, config)


def _check_config(config: dict[str, int] | None, groups: int) -> None:
    """A tile named by hand must name exactly the tile's keys and hold one query's ``groups`` heads."""
    if config is None:
        return
    missing, unknown = set(CONFIG_KEYS) - set(config), set(config) - set(CONFIG_KEYS)
    if missing or unknown:
        raise ValueError(f"packed kernel config needs exactly {list(CONFIG_KEYS)}; "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    if config["block_r"] < groups:
        raise ValueError(f"block_r {config['block_r']} has no room for one query's {groups} heads")


def _launch(q, k_past, v_past, k_new, v_new, stale8, pos32, spec: SparseQuery, scale: float, n_new: int,
            config: dict[str, int] | None) -> torch.Tensor:
    """Run the kernel (autotuned, or on ``config``'s tile) for ``q``'s queries, streaming ``n_new`` fresh keys."""
    hq, n, d = q.shape
    groups = hq // k_new.shape[0]
    out = torch.empty_like(q)
    args = (q, k_past, v_past, k_new, v_new, pos32, stale8, out, n, n_new, spec.past_len, spec.past_base,
            float(scale), n_bucket(n), q.stride(0), q.stride(1), k_past.stride(0), k_past.stride(1),
            k_new.stride(0), k_new.stride(1), out.stride(0), out.stride(1))
    consts = {"GROUPS": groups, "D": d, "BLOCK_D": max(16, triton.next_power_of_2(d)),
              **precision_flags(q.dtype)}
    jitted, tuned = _kernels()
    if config is not None:
        grid = (triton.cdiv(n, config["block_r"] // groups), k_new.shape[0])
        jitted[grid](*args, **consts, BLOCK_R=config["block_r"], BLOCK_N=config["block_n"],
                     num_warps=config["num_warps"], num_stages=config["num_stages"])
    else:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_R"] // groups), k_new.shape[0])](*args, **consts)
    return out
