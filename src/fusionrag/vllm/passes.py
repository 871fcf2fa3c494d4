"""FusionRAG's passes on vLLM's own loaded model: no second copy of the weights, vLLM's kernels for everything
but the attention.

The passes call vLLM's decoder layers one by one (its embedding, norms, fused projections, RoPE and MLP)
with each layer's ``Attention`` module routed, for the duration of the pass, to fusionrag's in-place
attention over a request-local KV (:func:`routed_attention`): the layer's new keys and values (normed and
rotated by vLLM) are written at their slots first, then each query reads every slot at or before its
position (:func:`fusionrag.execution.attention_backends.blocked.attend_in_place`). vLLM's paged cache is
never read; the result is written into it once, with the attention backend's own write op
(:func:`write_paged`). Every pass stops at the last layer's attention (its MLP, the final norm and the LM
head feed nothing a connector needs).

- :func:`prefill_into` computes a segment's KV over what the buffer holds before it (``S``'s KV);
- :func:`question_scores` is the selection pre-pass: the question over the assembled context, its last
  layer's attention over it, summed over heads and question tokens (:func:`fusionrag.online.policies.
  attention_scores`' rule, one softmax over the whole prompt), and over the tensor-parallel ranks' heads;
- :func:`recompute` refreshes the selected tokens through every layer, writing in place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fusionrag.execution.attention import attention_probs
from fusionrag.execution.attention_backends.blocked import attend_in_place
from fusionrag.execution.masks import visibility
from fusionrag.kvcache.kv import KV
from fusionrag.vllm.parallel import SINGLE, TPLayout


class _Stop(Exception):
    """Raised by the routed attention of the last layer once its KV is written: the pass is over."""


@dataclass
class VLLMModel:
    """The parts of vLLM's loaded decoder-only model the passes drive, in layer order."""

    model: Any  # e.g. vllm.model_executor.models.qwen2.Qwen2ForCausalLM
    layers: list  # decoder layers: layer(positions, hidden, residual) -> (hidden, residual)
    attention: list  # each layer's vllm Attention module (layer.self_attn.attn)
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    inv_freq: torch.Tensor  # the rotary embedding's, float32 (re-positioning stored keys)
    dtype: torch.dtype
    device: torch.device
    tp: TPLayout = SINGLE  # this rank's KV heads and the TP group's collectives

    @classmethod
    def of(cls, model: Any, layout: Any = None) -> VLLMModel:
        """Read the structure of a vLLM Llama-family model (Llama, Qwen2, Qwen3, Mistral); refuses others in
        one line (a rotary embedding that is not rotate-half over the whole head, a sliding window).
        ``layout(local_kv_heads)`` gives this rank's :class:`TPLayout` (one rank when None)."""
        body = model.model
        start, stop = getattr(body, "start_layer", 0), getattr(body, "end_layer", len(body.layers))
        if start != 0 or stop != len(body.layers):
            raise ValueError("pipeline parallelism is not supported: every layer must be on this worker")
        layers = list(body.layers)
        attention = [layer.self_attn.attn for layer in layers]
        first = attention[0]
        rotary = layers[0].self_attn.rotary_emb
        if not getattr(rotary, "is_neox_style", True) or getattr(rotary, "rotary_dim", first.head_size) \
                != first.head_size:
            raise ValueError("the model's rotary embedding is not rotate-half over the whole head: its KV cannot "
                             "be re-positioned by a rotation")
        if any(getattr(a, "sliding_window", None) for a in attention):
            raise ValueError("the model has sliding-window layers: chunk KV reuse is unsound there")
        inv_freq = rotary._compute_inv_freq(rotary.base).float()
        param = next(model.parameters())
        tp = layout(first.num_kv_heads) if layout is not None else SINGLE
        return cls(model, layers, attention, first.num_heads, first.num_kv_heads, first.head_size,
                   float(first.impl.scale), inv_freq.to(param.device), param.dtype, param.device, tp)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def empty_kv(self, slots: int) -> KV:
        """A request-local KV of ``slots`` positions (from 0), in the model's dtype, zeros."""
        t = torch.zeros(self.num_layers, self.num_kv_heads, slots, self.head_size, dtype=self.dtype,
                        device=self.device)
        return KV(t, torch.zeros_like(t), 0)


@contextmanager
def routed_attention(vm: VLLMModel, work: KV, positions: torch.Tensor,
                     captured: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Inside: every layer's attention writes its new KV into ``work`` at ``positions`` and attends in place;
    the last layer writes, hands its queries to ``captured`` (``[heads, n, d]``, fp32) and ends the pass."""
    memo: dict = {}
    slots = positions - work.base_position
    last = vm.num_layers - 1

    def route(index: int, attn: Any):
        def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape: Any = None,
                    output_dtype: Any = None) -> torch.Tensor:
            n = query.shape[0]
            k = key.view(n, vm.num_kv_heads, vm.head_size).transpose(0, 1)
            v = value.view(n, vm.num_kv_heads, vm.head_size).transpose(0, 1)
            work.keys[index][:, slots[-n:]] = k.to(work.keys.dtype)
            work.values[index][:, slots[-n:]] = v.to(work.values.dtype)
            q = query.view(n, vm.num_heads, vm.head_size).transpose(0, 1)
            if index == last:
                if captured is not None:
                    captured.append(q.float())
                raise _Stop
            out = attend_in_place(q, work.keys[index], work.values[index], positions[-n:], work.base_position,
                                  vm.scale, memo)
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
             captured: list[torch.Tensor] | None = None) -> None:
    """``ids`` at ``positions`` through vLLM's layers over ``work`` (written in place), to the last attention."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(vm.device)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1).to(vm.device)
    hidden, residual = vm.model.model.embed_input_ids(ids), None
    with routed_attention(vm, work, positions, captured):
        try:
            for layer in vm.layers:
                hidden, residual = layer(positions, hidden, residual)
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


def recompute(vm: VLLMModel, context_ids: Sequence[int], selected: torch.Tensor, work: KV) -> None:
    """Refresh the ``selected`` context slots (sorted) through every layer; their fresh KV replaces the old."""
    if selected.numel() == 0:
        return
    ids = torch.tensor(list(context_ids))[selected.cpu()]
    run_pass(vm, ids, selected, work)


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
