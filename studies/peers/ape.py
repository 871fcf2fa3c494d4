"""APE (Adaptive Parallel Encoding, Yang et al., ICLR 2025) as a plugin of the engine: its layout and its rule.

APE recomputes nothing: the chunks, each encoded right after ``S`` and never seeing each other, sit at
the same positions after ``S``, and the question comes after the longest one. A later token's attention
is realigned without training (its section 4.3-4.4 and the authors' released code, which treats all
chunks as one context block): the logits on context keys are divided by a temperature ``T``, and the
context block's log-sum-exp is multiplied by ``S * T`` before it is merged with the rest (``S``'s keys
and the token's own, causal), that is

    weight_j ∝ exp(s_j / T) * exp((S*T - 1) * LSE_C)   for context keys j,
    weight_j ∝ exp(s_j)                                for every other visible key,

with ``LSE_C = logsumexp_j∈C(s_j / T)`` per query and head, one softmax over all keys. ``T = S = 1`` is
plain attention over the parallel layout.

It reaches the engine through two generic hooks: a *placement* (:func:`place`, registered with
:func:`fusionrag.online.methods.register_placement`) lays the chunks out, and the KV it returns carries
an :class:`ApeRule` (a :class:`fusionrag.kvcache.kv.ReadRule`) that every later reader of the prompt
honours: the question's pass, teacher forcing and the shared decoder. Importing this module registers
``ape``, APE's released default (its README and demo: T = S = 0.9; the paper tunes both per task), as a
study method (usable through the Python API and ``python -m studies.quality_cli``, never listed by the
product).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.kv import KV, assemble
from fusionrag.online.methods import MethodInfo, register_placement

#: APE's released default (temperature, scale).
DEFAULT = (0.9, 0.9)


@dataclass(frozen=True)
class ApeRule:
    """How later tokens read slots ``start:stop`` (the chunks placed in parallel): APE's rule (module doc)."""

    start: int
    stop: int
    temperature: float = DEFAULT[0]
    scale: float = DEFAULT[1]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
               span: torch.Tensor, scale: float) -> torch.Tensor:
        """``[Hq, n, D]``: ``q [Hq, n, D]`` over ``keys``/``values [Hkv, N, D]`` (grouped heads shared),
        ``allowed [n, N]`` bool (what each query sees), ``span [N]`` bool (the parallel chunks' keys)."""
        groups = q.shape[0] // keys.shape[0]
        k = keys.to(torch.float32).repeat_interleave(groups, dim=0)
        v = values.to(torch.float32).repeat_interleave(groups, dim=0)
        logits = torch.einsum("hnd,hkd->hnk", q.to(torch.float32), k) * scale  # [Hq, n, N]
        allowed = allowed.to(logits.device)[None]
        ctx = span.to(logits.device)[None, None, :] & allowed  # [1, n, N]
        tempered = logits / self.temperature
        lse_c = torch.where(ctx, tempered, -torch.inf).logsumexp(dim=-1, keepdim=True)  # [Hq, n, 1]
        boost = ((self.scale * self.temperature - 1.0) * lse_c).nan_to_num(0.0, 0.0, 0.0)  # no context seen: none
        adjusted = torch.where(ctx, tempered + boost, logits).masked_fill(~allowed, -torch.inf)
        return (adjusted.softmax(dim=-1) @ v).to(q.dtype)


def parallel_shift(chunks: Sequence[KV]) -> int:
    """How far APE's layout rotates every key forward: the chunks' total length minus the longest.

    In APE's layout every chunk starts right after ``S`` and the question comes after the longest
    chunk; the cache still stores the chunks one after another (slot = bookkeeping position, so
    the visibility rule, decoding and teacher forcing need nothing new). Rotating ``S`` and every
    chunk forward by this shift puts the question, at slot ``len(S) + sum``, exactly as far from
    each key as APE puts it (RoPE scores depend only on the distance)."""
    return sum(len(c) for c in chunks) - max((len(c) for c in chunks), default=0)


def place(prefix: KV, chunks: Sequence[KV], inv_freq: torch.Tensor, device: torch.device | str | None = None,
          dtype: torch.dtype = torch.float32, *, temperature: float = DEFAULT[0],
          scale: float = DEFAULT[1]) -> tuple[KV, list[tuple[int, int]]]:
    """APE's placement (called as :func:`~fusionrag.kvcache.kv.assemble` is): every chunk at the same
    positions after ``S``, the keys of ``S`` and of the chunks rotated forward by :func:`parallel_shift`;
    spans and slots as ``assemble``'s. The KV carries the :class:`ApeRule` over the chunks' slots."""
    shift = parallel_shift(chunks)
    head = prefix.to(device=device).to(torch.float32).moved_to(prefix.base_position + shift, inv_freq)
    head = KV(head.keys, head.values, prefix.base_position)  # S's keys rotated forward, its slots unchanged
    # assemble rotates a chunk by (its slot's position - its base_position): relabel each base (no copy)
    # so that every chunk lands at APE's position, right after S plus the shift.
    at, pos, relabelled = prefix.base_position + len(prefix) + shift, prefix.base_position + len(prefix), []
    for c in chunks:
        relabelled.append(KV(c.keys, c.values, c.base_position + pos - at))
        pos += len(c)
    kv, spans = assemble(head, relabelled, inv_freq, device=device, dtype=dtype)
    if not spans:
        return kv, spans
    return replace(kv, read_rule=ApeRule(spans[0][0], spans[-1][1], temperature, scale)), spans


def register_ape(name: str, temperature: float, scale: float, *, kv: str = "plain",
                 description: str = "") -> MethodInfo:
    """Make ``name`` APE with ``temperature`` and ``scale`` (a study method: never listed by the product)."""
    if not (0 < temperature <= 4 and 0 < scale <= 4):
        raise FusionRAGError(f"APE's temperature and scale must lie in (0, 4], got {temperature}, {scale}")
    return register_placement(name, partial(place, temperature=float(temperature), scale=float(scale)), kv=kv,
                              description=description or f"APE with temperature {temperature}, scale {scale}")


register_ape("ape", *DEFAULT, description="APE (chunks in parallel, attention temperature and scale, no recompute)")
