"""The KV of a token segment, as two stacked tensors.

``keys`` and ``values`` are ``[layers, kv_heads, seq, head_dim]``; keys are post-RoPE
at positions ``base_position .. base_position + seq - 1``. One tensor per kind (rather
than a list per layer) keeps concatenation, slicing, rotation and safetensors storage
one call each. Every operation returns a new object: stored/shared KV is never mutated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from fusionrag.models.rope import rotate_into, rotate_keys, rotation


class ReadRule(Protocol):
    """How the tokens after a prompt read slots ``start:stop`` of its KV, when not by plain attention.

    A method's placement (:func:`fusionrag.online.methods.register_placement`) may set one on the KV it
    assembles; the prompt KV carries it (``KV.read_rule``) and every later reader honours it: the
    question's pass, teacher forcing and the decoder call ``attend`` for the rows of such a prompt
    (:mod:`fusionrag.execution.attention_backends.ruled`). A prompt with a rule is read as stored: no
    pass recomputes its slots (the placement may have put any of them anywhere)."""

    start: int
    stop: int

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
               span: torch.Tensor, scale: float) -> torch.Tensor:
        """``[Hq, n, D]``: ``q [Hq, n, D]`` over ``keys``/``values [Hkv, N, D]`` (grouped heads shared),
        ``allowed [n, N]`` bool (what each query sees), ``span [N]`` bool (the keys that are slots
        ``start:stop``)."""
        ...


@dataclass(frozen=True)
class KV:
    keys: torch.Tensor
    values: torch.Tensor
    base_position: int = 0
    #: Set by a method's placement: every later token reads slots ``start:stop`` through this rule.
    read_rule: ReadRule | None = None

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

    def kv_heads(self, heads: slice) -> KV:
        """Only the KV heads ``heads`` (a view): a tensor-parallel rank's share of a stored entry."""
        if heads == slice(None):
            return self
        return KV(self.keys[:, heads], self.values[:, heads], self.base_position, self.read_rule)

    def head(self, n: int) -> KV:
        """Its first ``n`` tokens as a view (no copy: writes to either show in both)."""
        return KV(self.keys[:, :, :n], self.values[:, :, :n], self.base_position, self.read_rule)

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KV:
        """This KV in ``dtype`` on ``device`` (itself when nothing changes: no copy)."""
        keys, values = self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype)
        if keys is self.keys and values is self.values:
            return self
        return replace(self, keys=keys, values=values)

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


def _layout(prefix: KV, chunks: Sequence[KV]) -> tuple[list[tuple[int, int]], list[int]]:
    """Each chunk's ``(start, stop)`` span after ``prefix`` and the positions it moves by to get there."""
    spans, deltas = [], []
    pos = prefix.base_position + len(prefix)
    for chunk in chunks:
        spans.append((pos - prefix.base_position, pos - prefix.base_position + len(chunk)))
        deltas.append(pos - chunk.base_position)
        pos += len(chunk)
    return spans, deltas


#: A method's own layout of a prompt's chunks: called as :func:`assemble` is, returns what it returns (the
#: prompt's KV, maybe carrying a :class:`ReadRule`, and each chunk's span); see ``online.methods.register_placement``.
Placement = Callable[..., tuple[KV, list[tuple[int, int]]]]


def assemble(prefix: KV, chunks: Sequence[KV], inv_freq: torch.Tensor, device: torch.device | str | None = None,
             dtype: torch.dtype = torch.float32, room: int = 0) -> tuple[KV, list[tuple[int, int]]]:
    """``prefix + chunk_1 + ... + chunk_k`` at consecutive positions (TurboRAG "reordered").

    The chunks move to ``device`` as stored (fp16, or int8 entries dequantised to fp16, travel small)
    and are concatenated there once; each token's rotation (its target position minus the position
    it was computed at, one per chunk) is formed once, in float64 angles; then one rotate-half per
    layer writes all the chunks' keys, fp32 math, straight into the assembled tensor in the compute
    ``dtype`` (per layer: the fp32 temporaries stay one layer's size). Bit for bit the chunk-by-chunk
    assembly it replaced (``tests/kvcache/assemble_reference.py``), in a few ops per layer instead of a dozen
    per chunk. Returns the
    assembled KV and each chunk's ``(start, stop)`` token span within it.

    Each chunk's rotation is its target position minus its ``base_position``: a caller placing chunks
    elsewhere (a method's own placement) can relabel a chunk's base (no copy) to move it anywhere.
    ``room`` more slots (zeros) follow the chunks: a prompt's question, computed into the same buffer.
    """
    head = prefix.to(device=device).to(torch.float32).to(dtype)
    spans, deltas = _layout(prefix, chunks)
    if not chunks and not room:
        return KV.concat([head]), spans  # a new tensor, as with chunks: the prefix may be shared
    dev = head.keys.device
    (layers, heads, p, dim), total = head.keys.shape, spans[-1][1] if spans else len(head)
    keys = torch.empty(layers, heads, total + room, dim, dtype=dtype, device=dev)
    values = torch.empty_like(keys)
    keys[:, :, :p], values[:, :, :p] = head.keys, head.values
    keys[:, :, total:], values[:, :, total:] = 0, 0
    if not chunks:
        return KV(keys, values, prefix.base_position), spans
    cos, sin = rotation(torch.tensor(deltas), inv_freq, dev)  # [chunks, dim/2]
    which = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([len(c) for c in chunks])).to(dev)
    cos, sin = cos[which], sin[which]  # [tokens, dim/2]: each token its chunk's rotation
    moved = [c.to(device=dev) for c in chunks]
    for layer in range(layers):  # a layer's chunks gathered once (one layer's size: stays in cache on a CPU)
        rotate_into(keys[layer, :, p:total], torch.cat([c.keys[layer] for c in moved], dim=1), cos, sin)
        torch.cat([c.values[layer] for c in moved], dim=1, out=values[layer, :, p:total])
    return KV(keys, values, prefix.base_position), spans
