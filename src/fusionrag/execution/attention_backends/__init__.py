"""Attention of a sparse pass: new tokens at explicit positions over reused KV, one interface.

A pass (the sparse recompute, a chunk prefilled after ``S`` or after its neighbours, the
question pre-pass) runs ``n`` new tokens at strictly ascending positions ``p`` over
``past``, the reused KV of ``T`` slots at positions ``past_base .. past_base+T-1``. Query
``i`` sees past slot ``t`` iff ``past_base + t <= p[i]`` and ``t`` is not stale (a stale
slot's token is being recomputed: its fresh copy is new key ``j``), and new key ``j`` iff
``p[j] <= p[i]``, i.e. ``j <= i``. That is :func:`fusionrag.execution.masks.visibility`.

Every backend is a function ``attend(q, k_past, v_past, k_new, v_new, spec, scale)`` with
``q [Hq, n, D]``, past ``[Hkv, T, D]``, new ``[Hkv, n, D]`` (grouped-query heads: query
head ``h`` reads KV head ``h // (Hq // Hkv)``, as transformers' ``repeat_kv`` does),
returning ``[Hq, n, D]``. The past is only read (it is shared between requests); the new
KV lives in the request's own cache.

- ``reference``: today's path, a dense additive mask and SDPA over repeated KV heads.
- ``blocked``: torch, mask-free: query blocks skip the keys they cannot see, grouped-query
  heads by reshaping (no copies of KV heads), stale slots hidden by column.
- ``triton``: the Q-Sparse-Attn kernel, one program per query head (GPU; on CPU under
  ``TRITON_INTERPRET=1``); the measured CUDA default.
- ``triton-packed``: the same rule, one program per KV head with its grouped query heads packed
  into the tile's rows (K/V read once per KV head, not once per query head), autotuned tiles;
  selectable until a GPU run decides the default (``benchmarks/gpu/gpu_check.sh``).

An *in-place* pass (the sparse recompute, decision 050) writes each layer's fresh KV into the
request's own prompt KV before that layer's attention, so a query simply sees every slot at or
before its position. A backend that has such a function, ``attend_in_place(q, keys, values,
positions, base, scale, memo)``, is returned by :func:`get_in_place` (``reference``, ``blocked``
and ``triton-packed``: its kernel with the buffer as the past and no fresh keys to stream); the
per-head ``triton`` kernel keeps the past + new interface, so a GPU run measures both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusionrag.execution.attention_backends.spec import SparseQuery

Attend = Callable[..., torch.Tensor]
AttendInPlace = Callable[..., torch.Tensor]
NAMES = ("reference", "blocked", "triton", "triton-packed")
__all__ = ["NAMES", "Attend", "AttendInPlace", "SparseQuery", "default_backend", "get_backend", "get_in_place",
           "triton_available"]


def triton_available() -> bool:
    """Whether the Triton kernels can run here: a CUDA device, or the interpreter on CPU."""
    import os

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def get_backend(name: str) -> Attend:
    """The ``attend`` function of backend ``name`` (see the module docstring)."""
    if name == "reference":
        from fusionrag.execution.attention_backends.reference import attend
    elif name == "blocked":
        from fusionrag.execution.attention_backends.blocked import attend
    elif name == "triton":
        from fusionrag.execution.attention_backends.qsparse_triton import attend
    elif name == "triton-packed":
        from fusionrag.execution.attention_backends.qsparse_packed import attend
    else:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(NAMES)})")
    return attend


def get_in_place(name: str) -> AttendInPlace | None:
    """Backend ``name``'s in-place function, or ``None`` where it has none (the pass then reads past + new)."""
    if name == "reference":
        from fusionrag.execution.attention_backends.reference import attend_in_place
    elif name == "blocked":
        from fusionrag.execution.attention_backends.blocked import attend_in_place
    elif name == "triton-packed":
        from fusionrag.execution.attention_backends.qsparse_packed import attend_in_place
    else:
        get_backend(name)  # an unknown name is an error here too
        return None
    return attend_in_place


def default_backend(device: torch.device) -> str:
    """``triton`` on CUDA when Triton is installed, else the mask-free torch backend."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return "blocked"
