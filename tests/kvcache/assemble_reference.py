"""The chunk-by-chunk assembly that :func:`fusionrag.kvcache.kv.assemble` replaced, kept as its reference.

Per chunk: move, widen to fp32, rotate to its target position, cast, then one concatenation. The
batched ``assemble`` must equal it bit for bit (``test_rope.py``); ``benchmarks/gpu/assemble_bench.py``
times the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag.kvcache.kv import KV


def assemble_per_chunk(prefix: KV, chunks: Sequence[KV], inv_freq: torch.Tensor,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype = torch.float32) -> tuple[KV, list[tuple[int, int]]]:
    """``prefix + chunk_1 + ... + chunk_k`` at consecutive positions, one chunk at a time; and the chunks' spans."""
    parts = [prefix.to(device=device).to(torch.float32).to(dtype)]
    spans, start = [], len(prefix)
    for chunk in chunks:
        spans.append((start, start + len(chunk)))
        target = prefix.base_position + start
        parts.append(chunk.to(device=device).to(torch.float32).moved_to(target, inv_freq).to(dtype))
        start += len(chunk)
    return KV.concat(parts), spans
