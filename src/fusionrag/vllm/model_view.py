"""What the connector's passes need of vLLM's loaded model, read once per worker, for any family it serves.

vLLM hands a connector its KV tensors, not its model; the passes drive the model vLLM loaded. Nothing here
depends on a family's layer layout:

- the **attention modules** are the ``Attention`` layers vLLM registered for its KV cache, in layer order
  (Llama's ``self_attn.attn``, GPT-NeoX's ``attention.attn`` through vLLM's Transformers backend, ...);
- a pass runs the **decoder body's own forward** (:attr:`VLLMModel.body`), eagerly: vLLM compiles a body by
  wrapping its ``__call__``, so calling ``forward`` runs the family's own embedding scale, norms, residual rule
  and MLP or experts as vLLM wrote them (native models take ``(ids, positions)``; the Transformers backend's
  Hugging Face body takes batched ``input_ids`` and ``position_ids``);
- the **rotation** that moves a stored key is the one the store's keys were made with: the frequencies of the
  model's Hugging Face rotary embedding (:func:`store_inv_freq`; partial rotary, linear, Llama-3, YaRN and
  longrope scaling included). :func:`fusionrag.vllm.passes.check_rotation` proves at start that vLLM rotates
  keys the same way, and vLLM stops with one line where it does not.

A model the connector cannot drive is refused at start in one line: a family fusionrag does not serve
(:func:`fusionrag.models.compat.check_supported`), attention logits soft-capped, attention modules the
connector does not know, layers on other pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fusionrag.kvcache.kv import KV
from fusionrag.vllm.parallel import SINGLE, TPLayout


@dataclass
class VLLMModel:
    """The parts of vLLM's loaded decoder-only model the passes drive, in layer order."""

    model: Any  # vLLM's ...ForCausalLM
    body: Any  # its decoder body (embedding, layers, final norm), run through its own eager forward
    attention: list  # each layer's vLLM ``Attention`` module, in layer order
    num_heads: int  # this rank's
    num_kv_heads: int
    head_size: int
    scale: float
    inv_freq: torch.Tensor  # the store's rotation frequencies, float32 (re-positioning stored keys)
    dtype: torch.dtype
    device: torch.device
    tp: TPLayout = SINGLE  # this rank's KV heads and the TP group's collectives
    hf_style: bool = field(default=False)  # a Hugging Face body (vLLM's Transformers backend)

    @classmethod
    def of(cls, model: Any, hf_config: Any, layout: Any = None) -> VLLMModel:
        """Read vLLM's ``model`` (whose Hugging Face config is ``hf_config``); ``layout(local_kv_heads)`` gives
        this rank's :class:`TPLayout` (one rank when None). Raises ``ValueError`` naming what it cannot drive."""
        from fusionrag.models.compat import check_supported

        check_supported(hf_config)
        body = model.model
        start, stop = getattr(body, "start_layer", None), getattr(body, "end_layer", None)
        layers = getattr(body, "layers", None)
        if start is not None and layers is not None and (start != 0 or stop != len(layers)):
            raise ValueError("pipeline parallelism is not supported: every layer must be on this worker")
        attention = attention_modules(model)
        if not attention:
            raise ValueError(f"no vLLM attention layers found in {type(model).__name__}")
        first = attention[0]
        for attn in attention:
            cap = getattr(attn.impl, "logits_soft_cap", None)
            if cap:
                raise ValueError(f"{type(model).__name__} soft-caps its attention logits ({cap}); the connector's "
                                 "attention does not, so recomputed tokens would not match vLLM's")
            if (attn.num_heads, attn.num_kv_heads, attn.head_size) != (first.num_heads, first.num_kv_heads,
                                                                         first.head_size):
                raise ValueError("the model's layers have different attention shapes; the connector needs one")
        inv_freq = store_inv_freq(hf_config)
        param = next(model.parameters())
        tp = layout(first.num_kv_heads) if layout is not None else SINGLE
        import transformers

        return cls(model, body, attention, first.num_heads, first.num_kv_heads, first.head_size,
                   float(first.impl.scale), inv_freq.float().to(param.device), param.dtype, param.device, tp,
                   isinstance(body, transformers.PreTrainedModel))

    @property
    def num_layers(self) -> int:
        return len(self.attention)

    def run_body(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The body's own forward on ``ids`` at ``positions`` (eager; the routed attention ends it)."""
        if self.hf_style:
            self.body.forward(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        else:
            self.body.forward(ids, positions, None, None)  # no intermediate tensors (one stage), no embeddings

    def empty_kv(self, slots: int) -> KV:
        """A request-local KV of ``slots`` positions (from 0), in the model's dtype, zeros."""
        t = torch.zeros(self.num_layers, self.num_kv_heads, slots, self.head_size, dtype=self.dtype,
                        device=self.device)
        return KV(t, torch.zeros_like(t), 0)


def attention_modules(model: Any) -> list:
    """vLLM's ``Attention`` layers of ``model``, in module (= layer) order; any other attention kind (MLA, a
    cross or encoder attention) is refused, since the passes route only this one's ``forward``."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = [m for m in model.modules() if isinstance(m, AttentionLayerBase)]
    others = sorted({type(m).__name__ for m in layers if type(m) is not Attention})
    if others:
        raise ValueError(f"the model uses attention layers the connector does not drive ({', '.join(others)})")
    return layers


def store_inv_freq(hf_config: Any) -> torch.Tensor:
    """The rotation frequencies the store's keys were made with: the model's Hugging Face rotary embedding
    (what fusionrag's engine computes chunks with), float64 on the CPU; ``rotary_dim / 2`` of them."""
    import importlib

    model_type = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and
              isinstance(getattr(module, n), type)]
    if len(rotary) != 1:
        raise ValueError(f"cannot tell {model_type}'s rotary embedding ({len(rotary)} candidates)")
    return rotary[0](config=hf_config).inv_freq.detach().to(torch.float64).cpu()
