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

Each backend is an :class:`AttentionBackend` in :data:`BACKENDS` (like vLLM's ``AttentionBackend``): its
name, the devices and dtypes it runs, whether it has the in-place form; :func:`select_backend` picks
one for a device and dtype (a name asked for that cannot run there is one clear error, before any
kernel is reached) and imports its module only then.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionrag.execution.attention_backends.spec import SparseQuery

Attend = Callable[..., torch.Tensor]
AttendInPlace = Callable[..., torch.Tensor]
__all__ = ["BACKENDS", "NAMES", "Attend", "AttendInPlace", "AttentionBackend", "SparseQuery", "default_backend",
           "get_backend", "get_in_place", "select_backend", "triton_available"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """Whether the Triton kernels can run here: a CUDA device, or the interpreter on CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of a sparse pass's attention and where it runs."""

    name: str
    module: str  # imported on first use: the Triton kernels need Triton, the torch ones nothing
    devices: tuple[str, ...]  # device types it runs on natively
    dtypes: tuple[torch.dtype, ...] = _FLOATS
    supports_in_place: bool = False  # has attend_in_place (the sparse recompute writing in place)
    needs_triton: bool = False  # a Triton kernel: CUDA, or the CPU under TRITON_INTERPRET=1

    @functools.cached_property
    def attend(self) -> Attend:
        """The backend's ``attend`` (its module imported on first use, then held)."""
        return importlib.import_module(self.module).attend

    @functools.cached_property
    def attend_in_place(self) -> AttendInPlace | None:
        return importlib.import_module(self.module).attend_in_place if self.supports_in_place else None

    def why_not(self, device: torch.device, dtype: torch.dtype | None = None) -> str:
        """Why it cannot run on ``device`` in ``dtype`` ('' when it can)."""
        if self.needs_triton and not triton_available():
            return f"attention backend {self.name!r} needs Triton and a CUDA device (or TRITON_INTERPRET=1)"
        interpreted = self.needs_triton and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type not in self.devices and not interpreted:
            return f"attention backend {self.name!r} runs on {'/'.join(self.devices)}, not {device.type}"
        if dtype is not None and dtype not in self.dtypes:
            return f"attention backend {self.name!r} does not compute in {str(dtype).removeprefix('torch.')}"
        return ""


_PACKAGE = "fusionrag.execution.attention_backends"
#: Every backend by name, in the order the CLI lists them.
BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    AttentionBackend("reference", f"{_PACKAGE}.reference", ("cpu", "cuda"), supports_in_place=True),
    AttentionBackend("blocked", f"{_PACKAGE}.blocked", ("cpu", "cuda"), supports_in_place=True),
    AttentionBackend("triton", f"{_PACKAGE}.qsparse_triton", ("cuda",), needs_triton=True),
    AttentionBackend("triton-packed", f"{_PACKAGE}.qsparse_packed", ("cuda",), supports_in_place=True,
                     needs_triton=True),
)}
NAMES = tuple(BACKENDS)


def _named(name: str) -> AttentionBackend:
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(NAMES)})")
    return backend


def default_backend(device: torch.device) -> str:
    """``triton`` on CUDA when Triton is installed, else the mask-free torch backend."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return "blocked"


def select_backend(device: torch.device, dtype: torch.dtype | None = None, name: str = "auto") -> AttentionBackend:
    """The backend for a model on ``device`` computing in ``dtype``: ``name``, or the device's default for
    ``auto``; a backend that cannot run there is a ValueError saying why."""
    backend = _named(default_backend(device) if name == "auto" else name)
    why = backend.why_not(device, dtype)
    if why:
        raise ValueError(why)
    return backend


def get_backend(name: str) -> Attend:
    """The ``attend`` function of backend ``name`` (see the module docstring)."""
    return _named(name).attend


def get_in_place(name: str) -> AttendInPlace | None:
    """Backend ``name``'s in-place function, or ``None`` where it has none (the pass then reads past + new)."""
    return _named(name).attend_in_place
