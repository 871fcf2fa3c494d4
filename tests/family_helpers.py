"""Tiny random checkpoints of every model family fusionrag serves or refuses (configs only: no download).

``FAMILIES``: a case name -> ``(model_type, vLLM architecture, config overrides)``; 2 layers, 4 query heads of
32 (vLLM's CPU kernels need head size >= 32), 2 KV heads where the family has grouped-query attention.
``NOT_IN_VLLM``: cases vLLM itself cannot load. ``REFUSED``: configs that must be refused with a reason, and a
word the reason contains.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BASE = dict(vocab_size=262, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=258,
            pad_token_id=256, bos_token_id=None)
THETA = {"rope_theta": 10000.0}

FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM", {}),
    "llama-rope-llama3": ("llama", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512, **THETA}}),
    "llama-rope-linear": ("llama", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                            **THETA}}),
    "qwen2-rope-yarn": ("qwen2", "Qwen2ForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, **THETA}}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                                      "moe_intermediate_size": 64, "decoder_sparse_step": 1}),
    "mistral-window": ("mistral", "MistralForCausalLM", {"sliding_window": 2048}),
    "phi3": ("phi3", "Phi3ForCausalLM", {}),
    "phi3-partial-rotary": ("phi3", "Phi3ForCausalLM", {"rope_parameters": {"rope_type": "default",
                                                                           "partial_rotary_factor": 0.75, **THETA}}),
    "phi3-longrope": ("phi3", "Phi3ForCausalLM", {
        "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                            "original_max_position_embeddings": 2048, **THETA},
        "original_max_position_embeddings": 2048, "max_position_embeddings": 8192}),
    "granite": ("granite", "GraniteForCausalLM", {"embedding_multiplier": 12.0, "attention_multiplier": 0.05,
                                                  "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", {}),
    "stablelm": ("stablelm", "StableLmForCausalLM", {"rope_parameters": {
        "rope_type": "default", "partial_rotary_factor": 0.25, **THETA}}),
    "stablelm-qk-layernorm": ("stablelm", "StableLmForCausalLM", {"qk_layernorm": True, "rope_parameters": {
        "rope_type": "default", "partial_rotary_factor": 0.25, **THETA}}),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM", {"rope_parameters": {"rope_type": "default",
                                                                       "partial_rotary_factor": 0.25, **THETA}}),
}

#: Cases vLLM 0.32 itself cannot load, and why (our engine serves them; the connector is not reached).
NOT_IN_VLLM = {"stablelm-qk-layernorm": "vLLM's StableLM has no per-head q/k layernorm (its weights are refused)"}

REFUSED = {
    "gemma2": (lambda: AutoConfig.for_model("gemma2", num_hidden_layers=2), "soft-caps"),
    "gemma3": (lambda: AutoConfig.for_model("gemma3_text", num_hidden_layers=2), "two rope bases"),
    "llama-rope-dynamic": (lambda: family_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                             **THETA}), "dynamic"),
}


def family_config(model_type: str, **overrides):
    kw = {**BASE, **overrides}
    if model_type == "gpt_neox":
        kw.pop("num_key_value_heads")  # no grouped-query attention in GPT-NeoX
    return AutoConfig.for_model(model_type, **kw)


def family_model(case: str, seed: int = 0):
    """A randomly initialised fp32 model of ``case`` (its LM head widened so greedy choices are well apart)."""
    model_type, architecture, overrides = FAMILIES[case]
    torch.manual_seed(seed)
    config = family_config(model_type, **overrides)
    config.architectures = [architecture]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model
