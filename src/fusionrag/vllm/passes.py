"""FusionRAG's passes on vLLM's own loaded model: no second copy of the weights, vLLM's kernels for everything
but the attention.

The passes run vLLM's decoder body (:class:`~fusionrag.vllm.model_view.VLLMModel`: its embedding, norms,
fused projections, RoPE and MLP, as the family has them) with each layer's ``Attention`` module routed, for
the duration of the pass, to fusionrag's in-place attention over a request-local KV (:func:`routed_attention`):
the layer's new keys and values (normed and rotated by vLLM) are written at their slots first, then each query
reads every slot at or before its position
(:func:`fusionrag.execution.attention_backends.blocked.attend_in_place`). vLLM's paged cache is never read; the
result is written into it once, with the attention backend's own write op (:func:`write_paged`). Every pass
stops at the last layer's attention (its MLP, the final norm and the LM head feed nothing a connector needs).

- :func:`prefill_into` computes a segment's KV over what the buffer holds before it (``S``'s KV);
- :func:`question_scores` is the selection pre-pass: the question over the assembled context, its last
  layer's attention over it, summed over heads and question tokens (:func:`fusionrag.online.policies.
  attention_scores`' rule, one softmax over the whole prompt), and over the tensor-parallel ranks' heads;
- :func:`recompute_many` refreshes the selected tokens through every layer, writing in place, several
  requests' pieces in one forward (each attends over its own KV only);
- :func:`check_rotation` proves at start that a key vLLM computes at position ``p`` is the key it computes at
  0 moved by the store's rotation (the identity every reused chunk relies on).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionrag.execution.attention import attention_probs
from fusionrag.execution.attention_backends.blocked import attend_in_place
from fusionrag.execution.masks import visibility
from fusionrag.kvcache.kv import KV
from fusionrag.models.rope import rotate_keys
from fusionrag.vllm.model_view import VLLMModel


class _Stop(Exception):
    """Raised by the routed attention of the pass's last layer once its KV is written: the pass is over."""


@dataclass
class Segment:
    """One request's tokens in a pass: how many, at which positions, over which request-local KV."""

    work: KV
    positions: torch.Tensor  # [n], on the model's device
    memo: dict = field(default_factory=dict)

    @property
    def slots(self) -> torch.Tensor:
        return self.positions - self.work.base_position


@contextmanager
def routed_attention(vm: VLLMModel, segments: Sequence[Segment], captured: list[torch.Tensor] | None = None,
                     last: int | None = None) -> Iterator[None]:
    """Inside: every layer's attention writes each segment's new KV into its ``work`` at its positions and
    attends in place over that ``work`` alone (the segments follow one another in the pass's tokens: several
    requests' tokens go through vLLM's body in one forward, each reading only its own KV); layer ``last``
    (default: the last) writes, hands its queries to ``captured`` (``[heads, n, d]``, fp32) and ends the pass."""
    last = vm.num_layers - 1 if last is None else last
    sizes = [seg.positions.numel() for seg in segments]

    def route(index: int, attn: Any):
        def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape: Any = None,
                    output_dtype: Any = None) -> torch.Tensor:
            n = query.shape[0]
            k = key.view(n, vm.num_kv_heads, vm.head_size).transpose(0, 1)
            v = value.view(n, vm.num_kv_heads, vm.head_size).transpose(0, 1)
            q = query.view(n, vm.num_heads, vm.head_size).transpose(0, 1)
            if len(segments) > 1 and n != sum(sizes):
                raise RuntimeError(f"a pass of {sum(sizes)} tokens reached layer {index}'s attention with {n}")
            # a segment's last n tokens (one segment: vLLM's body may run a layer on its last rows only)
            parts = [(seg, seg.positions.numel() - n if len(segments) == 1 else 0) for seg in segments]
            outs, at = [], 0
            for (seg, skip), size in zip(parts, sizes, strict=True):
                m = size - skip
                seg.work.keys[index][:, seg.slots[skip:]] = k[:, at:at + m].to(seg.work.keys.dtype)
                seg.work.values[index][:, seg.slots[skip:]] = v[:, at:at + m].to(seg.work.values.dtype)
                if index != last:
                    outs.append(attend_in_place(q[:, at:at + m], seg.work.keys[index], seg.work.values[index],
                                                seg.positions[skip:], seg.work.base_position, vm.scale, seg.memo))
                at += m
            if index == last:
                if captured is not None:
                    captured.append(q.float())
                raise _Stop
            out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
            return out.transpose(0, 1).reshape(n, vm.num_heads * vm.head_size).to(output_dtype or query.dtype)
        return forward

    for i, attn in enumerate(vm.attention):
        attn.forward = route(i, attn)  # an instance attribute: the class's forward is untouched
    try:
        yield
    finally:
        for attn in vm.attention:
            attn.__dict__.pop("forward", None)


def run_pass(vm: VLLMModel, ids: torch.Tensor, positions: torch.Tensor, work: KV,
             captured: list[torch.Tensor] | None = None, last: int | None = None) -> None:
    """``ids`` at ``positions`` through vLLM's body over ``work`` (written in place), to layer ``last``'s
    attention (default: the last layer's)."""
    run_passes(vm, [(ids, positions, work)], captured, last)


def run_passes(vm: VLLMModel, parts: Sequence[tuple[Any, Any, KV]], captured: list[torch.Tensor] | None = None,
               last: int | None = None) -> None:
    """Several requests' ``(ids, positions, work)`` through vLLM's body in one forward (the projections and MLPs
    over all their tokens at once), each attending over its own ``work`` only."""
    ids = torch.cat([torch.as_tensor(i, dtype=torch.long).reshape(-1) for i, _, _ in parts]).to(vm.device)
    segments = [Segment(work, torch.as_tensor(p, dtype=torch.long).reshape(-1).to(vm.device)) for _, p, work in parts]
    positions = torch.cat([seg.positions for seg in segments])
    with routed_attention(vm, segments, captured, last):
        try:
            vm.run_body(ids, positions)
        except _Stop:
            return
    raise RuntimeError("the pass never reached the last layer's attention")


def prefill_into(vm: VLLMModel, ids: Sequence[int], start: int, work: KV) -> None:
    """The KV of ``ids`` at positions ``start..`` over ``work``'s slots before them (e.g. ``S`` from 0)."""
    run_pass(vm, torch.tensor(list(ids)), torch.arange(start, start + len(ids)), work)


def question_scores(vm: VLLMModel, question_ids: Sequence[int], context_len: int, work: KV) -> torch.Tensor:
    """Each context slot's attention from the question at the last layer (summed over heads and question
    tokens); ``work`` holds the assembled context in ``0..context_len-1`` and room for the question after it."""
    q_pos = torch.arange(context_len, context_len + len(question_ids))
    captured: list[torch.Tensor] = []
    run_pass(vm, torch.tensor(list(question_ids)), q_pos, work, captured)
    keys = work.keys[-1][:, : context_len + len(question_ids)].float()
    allowed = visibility(torch.arange(context_len), None, q_pos)
    probs = attention_probs(captured[-1], keys, allowed, vm.scale)  # [heads, q, T + q]
    return vm.tp.sum(probs.sum(dim=(0, 1))[:context_len])  # every head's, whichever rank holds it


def recompute_many(vm: VLLMModel, pieces: Sequence[tuple[Sequence[int], torch.Tensor, KV]]) -> None:
    """Refresh each request's ``selected`` context slots (sorted) through every layer, several requests in one
    pass (``(context_ids, selected, work)`` each); their fresh KV replaces the old in each ``work``."""
    parts = [(torch.as_tensor(list(ids))[sel.cpu()], sel, work) for ids, sel, work in pieces if sel.numel()]
    if parts:
        run_passes(vm, parts)


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """vLLM's slots of a request's tokens ``start..stop-1`` (token ``t`` is in block ``block_ids[t // bs]``)."""
    t = torch.arange(start, stop)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)
    return blocks[t // block_size] * block_size + t % block_size


def write_paged(vm: VLLMModel, work: KV, start: int, stop: int, slots: torch.Tensor) -> None:
    """Tokens ``start..stop-1`` of ``work`` into vLLM's paged cache at ``slots``, every layer, through the
    attention backend's own write (the cache layout is the backend's: keys may be stored transposed or packed)."""
    slots = slots.to(vm.device)
    for i, attn in enumerate(vm.attention):
        key = work.keys[i][:, start:stop].transpose(0, 1).contiguous()
        value = work.values[i][:, start:stop].transpose(0, 1).contiguous()
        attn.impl.do_kv_cache_update(attn, key, value, attn.kv_cache, slots)


def check_rotation(vm: VLLMModel, token: int, positions: Sequence[int]) -> float:
    """The largest gap, relative to the key's size, between the first layer's key of ``token`` computed by vLLM
    at each of ``positions`` and the same key computed at 0 then moved there by the store's rotation (the one
    :func:`~fusionrag.kvcache.kv.assemble` applies to every stored chunk). One token, no context: the first
    layer's key depends only on its position. Every rank calls it (the passes run vLLM's collectives)."""
    at = [0, *positions]
    work = vm.empty_kv(max(at) + 1)
    for p in at:
        run_pass(vm, torch.tensor([token]), torch.tensor([p]), work, last=0)
    base = work.keys[0][:, 0:1].float()
    worst = 0.0
    for p in positions:
        moved = rotate_keys(base, p, vm.inv_freq)
        computed = work.keys[0][:, p:p + 1].float()
        worst = max(worst, float((moved - computed).abs().max() / computed.abs().max().clamp_min(1e-12)))
    return worst
