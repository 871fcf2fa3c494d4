"""Compute device and dtype: one spelling for every command (``--device``, ``--dtype``).

The device defaults to CUDA when torch sees one (every real deployment runs on GPUs), else
the CPU. The compute dtype defaults to ``auto`` (decision 052): bfloat16 on a CPU with bf16
arithmetic (AMX-BF16 or AVX512-BF16, detected once from the CPU's flags), where a bf16 GEMM
runs 2-4x faster than fp32 and what a CPU user runs instead (vLLM's CPU build) computes in
bf16; float32 elsewhere (CPUs without it, GPUs until a GPU run measures bf16 there). float32
is the exactness mode (``--dtype float32``: ratio 1 equals Full Attention within 1e-4).
Stored KV keeps its own dtype (fp16/int8 on disk); it is moved to the device as stored and
widened there, and RoPE re-rotation is fp32 math on that device.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from fusionrag.errors import FusionRAGError

# The flags themselves (and their choices) are in the torch-free models.options, re-exported here.
from fusionrag.models.options import ATTENTION_CHOICES, DTYPE_CHOICES, DTYPE_NAMES, add_device_args, device_options

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
#: CPU flags (Linux ``/proc/cpuinfo`` spelling) that give bf16 arithmetic, best first.
BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def cpu_bf16_feature(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The CPU's bf16 feature (``AMX-BF16``, ``AVX512-BF16``), or None; read once from its flags.

    x86-64 Linux only (the flags are in ``/proc/cpuinfo``); anywhere else None, so ``auto`` stays
    float32 where bf16 has not been measured."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return next((name for flag, name in BF16_FLAGS.items() if flag in flags), None)


def auto_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` computes in on ``device``, and why (one phrase for ``doctor`` and ``ask``)."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return torch.float32, f"on {dev.type}, bf16 not yet measured there"
    feature = cpu_bf16_feature()
    if feature is None:
        return torch.float32, "this CPU has no AMX-BF16 or AVX512-BF16"
    return torch.bfloat16, f"this CPU has {feature}"


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str = "cpu") -> torch.dtype:
    """``float32`` / ``bfloat16`` / ``float16`` (or a torch dtype); None or ``auto``: :func:`auto_dtype`."""
    if dtype is None or dtype == "auto":
        return auto_dtype(device)[0]
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise FusionRAGError(f"unknown dtype {dtype!r} (choose {', '.join(DTYPE_CHOICES)})")
    return DTYPES[dtype]


def dtype_choice(dtype: torch.dtype | str | None, device: torch.device | str) -> str:
    """How the compute dtype was chosen, for the lines a command prints: ``float32 (asked for)`` or
    ``bfloat16 (auto: this CPU has AMX-BF16)``."""
    if dtype is None or dtype == "auto":
        chosen, why = auto_dtype(device)
        return f"{str(chosen).removeprefix('torch.')} (auto: {why})"
    return f"{str(resolve_dtype(dtype)).removeprefix('torch.')} (asked for)"


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``cpu`` / ``cuda`` / ``cuda:N``; None means :func:`default_device`. Refuses CUDA without a GPU."""
    dev = torch.device(device if device is not None else default_device())
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FusionRAGError(f"device {dev} asked for, but torch sees no CUDA device here (use --device cpu)")
    return dev


__all__ = ["ATTENTION_CHOICES", "DTYPES", "DTYPE_CHOICES", "add_device_args", "auto_dtype", "cpu_bf16_feature",
           "default_device", "device_options", "dtype_choice", "resolve_device", "resolve_dtype"]
