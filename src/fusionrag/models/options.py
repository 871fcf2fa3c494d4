"""What the command line needs to know about models and devices, without importing torch.

The model names, the default model and the ``--device`` / ``--dtype`` / ``--attention`` flags live
here so that building the parser (``fusionrag --help``) and every check that runs before a model
loads stay light; :mod:`fusionrag.models.registry` and :mod:`fusionrag.models.devices` read them
from here (a test keeps them equal to what those modules load).
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_MODEL = "qwen2.5-0.5b"
#: Models shipped inside pinned packages (``registry.PACKAGED`` holds how each is found and checked).
PACKAGED_NAMES = ("qwen2.5-0.5b", "smollm2-135m")
#: Random 2-layer test models, by name -> architecture.
TINY = {"tiny-llama": "llama", "tiny-qwen2": "qwen2"}
KNOWN_NAMES = [*PACKAGED_NAMES, *TINY]

#: ``auto`` and the sparse-pass backends of ``execution.attention_backends.NAMES`` (a lower layer cannot
#: import it; a test keeps the two equal).
ATTENTION_CHOICES = ("auto", "reference", "blocked", "triton", "triton-packed")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--attention`` (the sparse-pass backend) on a sub-command."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=list(DTYPE_CHOICES), default=None,
                   help="compute dtype (default auto: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32; "
                        "float32 is the exactness mode)")
    p.add_argument("--attention", choices=list(ATTENTION_CHOICES), default=None,
                   help="attention of sparse passes: auto (triton on CUDA, blocked on CPU), reference "
                        "(dense masked SDPA), blocked (mask-free torch), triton (Q-Sparse-Attn kernel, a "
                        "program per query head), triton-packed (the same, a program per KV head)")


def device_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_model`` keywords named by :func:`add_device_args` (absent flags: defaults)."""
    return {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype", None),
            "attention": getattr(args, "attention", None)}
