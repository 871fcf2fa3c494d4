"""Compute device and dtype: one spelling for every command (``--device``, ``--dtype``).

The device defaults to CUDA when torch sees one (every real deployment runs on GPUs), else
the CPU; the compute dtype defaults to float32 (the exactness tests' setting; bf16 halves
weight traffic on GPUs). Stored KV keeps its own dtype (fp16/int8 on disk); it is moved to
the device as stored and widened there, and RoPE re-rotation is fp32 math on that device.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from fusionrag.errors import FusionRAGError

#: ``auto`` and the sparse-pass backends of ``execution.attention_backends.NAMES`` (a lower layer cannot
#: import it; a test keeps the two equal).
ATTENTION_CHOICES = ("auto", "reference", "blocked", "triton", "triton-packed")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``float32`` / ``bfloat16`` / ``float16`` (or a torch dtype); None means float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise FusionRAGError(f"unknown dtype {dtype!r} (choose {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``cpu`` / ``cuda`` / ``cuda:N``; None means :func:`default_device`. Refuses CUDA without a GPU."""
    dev = torch.device(device if device is not None else default_device())
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FusionRAGError(f"device {dev} asked for, but torch sees no CUDA device here (use --device cpu)")
    return dev


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--attention`` (the sparse-pass backend) on a sub-command."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="compute dtype (default float32)")
    p.add_argument("--attention", choices=list(ATTENTION_CHOICES), default=None,
                   help="attention of sparse passes: auto (triton on CUDA, blocked on CPU), reference "
                        "(dense masked SDPA), blocked (mask-free torch), triton (Q-Sparse-Attn kernel, a "
                        "program per query head), triton-packed (the same, a program per KV head)")


def device_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_model`` keywords named by :func:`add_device_args` (absent flags: defaults)."""
    return {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype", None),
            "attention": getattr(args, "attention", None)}
