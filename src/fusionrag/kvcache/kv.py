"""The KV of a token segment, as two stacked tensors.

``keys`` and ``values`` are ``[layers, kv_heads, seq, head_dim]``; keys are post-RoPE
at positions ``base_position .. base_position + seq - 1``. One tensor per kind (rather
than a list per layer) keeps concatenation, slicing, rotation and safetensors storage
one call each. Every operation returns a new object: stored/shared KV is never mutated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusionrag.models.rope import rotate_into, rotate_keys, rotation


@dataclass(frozen=True)
class ParallelContext:
    """How later tokens read a prompt whose chunks were placed in parallel (APE, ICLR 2025).

    Slots ``start:stop`` of the prompt KV are the chunks, all encoded at the same positions right
    after ``S``; a token after them attends to those slots with the logits divided by
    ``temperature`` and the context block's log-sum-exp multiplied by ``scale * temperature``
    (APE section 4.3-4.4; :func:`fusionrag.execution.attention_backends.parallel.parallel_attention`).
    ``temperature = scale = 1`` is plain attention over the parallel layout."""

    start: int
    stop: int
    temperature: float = 0.9
    scale: float = 0.9


@dataclass(frozen=True)
class KV:
    keys: torch.Tensor
    values: torch.Tensor
    base_position: int = 0
    #: Set on a prompt assembled in parallel (APE): every later token reads slots start:stop with its rule.
    parallel: ParallelContext | None = None

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"KV tensors must both be [L, H, T, D]; got {self.keys.shape}, {self.values.shape}")

    def __len__(self) -> int:
        return self.keys.shape[2]

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    @staticmethod
    def empty_like(other: KV, base_position: int = 0) -> KV:
        shape = (*other.keys.shape[:2], 0, other.keys.shape[3])
        z = other.keys.new_zeros(shape)
        return KV(z, z.clone(), base_position)

    def slice(self, start: int, stop: int) -> KV:
        """Tokens ``start:stop`` of this segment (positions follow)."""
        return KV(
            self.keys[:, :, start:stop].clone(),
            self.values[:, :, start:stop].clone(),
            self.base_position + start,
        )

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KV:
        """This KV in ``dtype`` on ``device`` (itself when nothing changes: no copy)."""
        keys, values = self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype)
        if keys is self.keys and values is self.values:
            return self
        return KV(keys, values, self.base_position, self.parallel)

    def moved_to(self, new_base: int, inv_freq: torch.Tensor) -> KV:
        """This segment re-positioned to start at ``new_base`` (keys rotated, values shared)."""
        delta = new_base - self.base_position
        if delta == 0:
            return self
        return KV(rotate_keys(self.keys, delta, inv_freq), self.values, new_base)

    @staticmethod
    def concat(parts: Sequence[KV]) -> KV:
        """Concatenate segments that are already at consecutive positions."""
        if not parts:
            raise ValueError("nothing to concatenate")
        expected = parts[0].base_position
        for p in parts:
            if p.base_position != expected:
                raise ValueError(f"segment at {p.base_position} does not follow position {expected}")
            expected += len(p)
        return KV(
            torch.cat([p.keys for p in parts], dim=2),
            torch.cat([p.values for p in parts], dim=2),
            parts[0].base_position,
        )


def parallel_shift(chunks: Sequence[KV]) -> int:
    """How far a parallel layout rotates every key forward: the chunks' total length minus the longest.

    In APE's layout every chunk starts right after ``S`` and the question comes after the longest
    chunk; the cache still stores the chunks one after another (slot = bookkeeping position, so
    the visibility rule, decoding and teacher forcing need nothing new). Rotating ``S`` and every
    chunk forward by this shift puts the question, at slot ``len(S) + sum``, exactly as far from
    each key as APE puts it (RoPE scores depend only on the distance)."""
    return sum(len(c) for c in chunks) - max((len(c) for c in chunks), default=0)


def _layout(prefix: KV, chunks: Sequence[KV], parallel: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
    """Each chunk's ``(start, stop)`` span after ``prefix`` and the positions it moves by to get there
    (``parallel``: every chunk to the same position, see :func:`parallel_shift`)."""
    spans, deltas = [], []
    pos = prefix.base_position + len(prefix)
    parallel_at = pos + parallel_shift(chunks)
    for chunk in chunks:
        spans.append((pos - prefix.base_position, pos - prefix.base_position + len(chunk)))
        deltas.append((parallel_at if parallel else pos) - chunk.base_position)
        pos += len(chunk)
    return spans, deltas


def assemble(prefix: KV, chunks: Sequence[KV], inv_freq: torch.Tensor, device: torch.device | str | None = None,
             dtype: torch.dtype = torch.float32, parallel: bool = False) -> tuple[KV, list[tuple[int, int]]]:
    """``prefix + chunk_1 + ... + chunk_k`` at consecutive positions (TurboRAG "reordered").

    The chunks move to ``device`` as stored (fp16, or int8 entries dequantised to fp16, travel small)
    and are concatenated there once; each token's rotation (its target position minus the position
    it was computed at, one per chunk) is formed once, in float64 angles; then one rotate-half per
    layer writes all the chunks' keys, fp32 math, straight into the assembled tensor in the compute
    ``dtype`` (per layer: the fp32 temporaries stay one layer's size). Bit for bit the chunk-by-chunk
    :func:`assemble_per_chunk`, in a few ops per layer instead of a dozen per chunk. Returns the
    assembled KV and each chunk's ``(start, stop)`` token span within it.

    ``parallel`` (APE): every chunk at the same positions after ``S``, the keys of ``S`` and the
    chunks rotated forward by :func:`parallel_shift`; spans and slots are as without it.
    """
    head = prefix.to(device=device).to(torch.float32)
    if parallel:
        head = head.moved_to(prefix.base_position + parallel_shift(chunks), inv_freq)
        head = KV(head.keys, head.values, prefix.base_position)
    head = head.to(dtype)
    spans, deltas = _layout(prefix, chunks, parallel)
    if not chunks:
        return KV.concat([head]), spans  # a new tensor, as with chunks: the prefix may be shared
    dev = head.keys.device
    (layers, heads, p, dim), total = head.keys.shape, spans[-1][1]
    keys = torch.empty(layers, heads, total, dim, dtype=dtype, device=dev)
    values = torch.empty_like(keys)
    keys[:, :, :p], values[:, :, :p] = head.keys, head.values
    cos, sin = rotation(torch.tensor(deltas), inv_freq, dev)  # [chunks, dim/2]
    which = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([len(c) for c in chunks])).to(dev)
    cos, sin = cos[which], sin[which]  # [tokens, dim/2]: each token its chunk's rotation
    moved = [c.to(device=dev) for c in chunks]
    for layer in range(layers):  # a layer's chunks gathered once (one layer's size: stays in cache on a CPU)
        rotate_into(keys[layer, :, p:], torch.cat([c.keys[layer] for c in moved], dim=1), cos, sin)
        torch.cat([c.values[layer] for c in moved], dim=1, out=values[layer, :, p:])
    return KV(keys, values, prefix.base_position), spans


def assemble_per_chunk(prefix: KV, chunks: Sequence[KV], inv_freq: torch.Tensor,
                       device: torch.device | str | None = None,
                       dtype: torch.dtype = torch.float32) -> tuple[KV, list[tuple[int, int]]]:
    """:func:`assemble` one chunk at a time (move, widen, rotate, cast, then one concatenation): the
    previous path, kept as the reference the batched one is tested and measured against."""
    parts = [prefix.to(device=device).to(torch.float32).to(dtype)]
    spans, _ = _layout(prefix, chunks)
    for chunk, (start, _stop) in zip(chunks, spans, strict=True):
        target = prefix.base_position + start
        parts.append(chunk.to(device=device).to(torch.float32).moved_to(target, inv_freq).to(dtype))
    return KV.concat(parts), spans
