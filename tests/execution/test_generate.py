"""The Full Attention path decodes exactly what plain ``transformers`` greedy generate does."""

import torch

from fusionrag.execution.generate import TextStreamer, greedy_tokens
from fusionrag.online.prefill import prefill_full
from fusionrag.prompt import PromptBuilder


def test_full_attention_matches_transformers_generate(tiny_lm):
    pb = PromptBuilder(tiny_lm.tokenizer)
    chunks = [pb.chunk_token_ids("Paris", "Paris is the capital of France."),
              pb.chunk_token_ids("Rome", "Rome is in Italy.")]
    question = pb.question_token_ids("What is the capital of France?")
    full = prefill_full(tiny_lm, pb.system_token_ids, chunks, question)
    ours = list(greedy_tokens(tiny_lm, full.kv, full.last_logits, max_new_tokens=24, stop_ids=[]))
    ids = torch.tensor([[*pb.system_token_ids, *chunks[0], *chunks[1], *question]])
    ref = tiny_lm.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, ids.shape[1]:].tolist()
    assert ours == ref
    assert len(set(ours)) > 1  # a constant output would make the comparison weak


def test_stop_tokens_end_generation(tiny_llama):
    pb = PromptBuilder(tiny_llama.tokenizer)
    full = prefill_full(tiny_llama, pb.system_token_ids, [pb.chunk_token_ids("t", "some text")],
                        pb.question_token_ids("q?"))
    free = list(greedy_tokens(tiny_llama, full.kv, full.last_logits, max_new_tokens=10, stop_ids=[]))
    assert len(free) == 10
    stopped = list(greedy_tokens(tiny_llama, full.kv, full.last_logits, max_new_tokens=10, stop_ids=[free[3]]))
    assert stopped == free[: free.index(free[3])]


def test_text_streamer_joins_to_full_decode(tiny_llama):
    tok = tiny_llama.tokenizer
    ids = tok.encode("héllo wörld ✓", add_special_tokens=False)
    streamer = TextStreamer(tok)
    assert "".join(streamer.push(i) for i in ids) == "héllo wörld ✓"
