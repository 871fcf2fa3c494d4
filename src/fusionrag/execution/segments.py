"""KV of contiguous prompt segments: ``S`` alone, and one chunk right after ``S``.

These are the two caches everything else is assembled from: ``S``'s KV prefixes every
prompt, and a chunk's plain (Full Reuse) KV is the chunk prefilled after ``S`` only.
The offline builder stores both; the online engine computes a plain KV for a passage the
store does not hold (the alternative path). Both are one causal prefill, computed on the
model's device and returned on the CPU, where the store and the memory tiers keep KV
(assembling moves it back to the device, as it does for KV read from disk).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag.execution.forward import prefill
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel


def system_kv(lm: LoadedModel, system_token_ids: Sequence[int]) -> KV:
    """KV of ``S`` at positions ``0..len(S)-1``."""
    kv, _ = prefill(lm, torch.tensor(list(system_token_ids)))
    return kv.to(device="cpu")


def chunk_kv_plain(lm: LoadedModel, system: KV, token_ids: Sequence[int]) -> KV:
    """A chunk's Full Reuse KV: prefilled right after ``S``, only the chunk's part kept."""
    kv, _ = prefill(lm, torch.tensor(list(token_ids)), past=system)
    return kv.to(device="cpu")
