"""Tiny, randomly initialised models with a byte-level tokenizer, for tests and smoke runs.

They need no download and run in milliseconds, yet exercise the same code paths as the
real models (GQA, RoPE, chat template, stop tokens). Seeded, so runs are reproducible.
"""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)  # Qwen3's ``enable_thinking`` switch, so a test can see ``chat_template_kwargs`` reach the template
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(family: str = "llama", **overrides):
    """A 2-layer GQA config of the given family (``llama``, ``qwen2``, ``mistral``, ``qwen3``)."""
    from transformers import AutoConfig

    base = dict(
        vocab_size=262,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=258,
        pad_token_id=256,
        bos_token_id=None,
    )
    if family in {"qwen2", "mistral"}:
        base["sliding_window"] = None
    base.update(overrides)
    return AutoConfig.for_model(family, **base)


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised fp32 causal LM of ``family`` (eval mode, sdpa attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # Random init gives near-uniform logits; widen them so greedy choices are well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()
