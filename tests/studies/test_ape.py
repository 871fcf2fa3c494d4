"""APE, the plugin (studies/peers/ape.py: a placement and a read rule through the engine's generic hooks):
the rule against its three-part definition, the layout against computing at APE's positions, T = S = 1
with one chunk against Full Attention, and every reader of the prompt (the question's pass, teacher
forcing, the shared decoder) applying the same rule."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from studies.peers.ape import ApeRule, parallel_shift, place, register_ape

from fusionrag.execution.decoder import BatchDecoder
from fusionrag.execution.forward import to_dynamic_cache
from fusionrag.execution.generate import greedy_tokens
from fusionrag.execution.recompute import sparse_recompute
from fusionrag.execution.teacher_forcing import continuation_logprobs
from fusionrag.kvcache.kv import KV
from fusionrag.online.methods import all_methods, method_info, methods
from fusionrag.online.prefill import assemble_context, prefill_full, prefill_reused
from fusionrag.online.request import ReuseRequest
from policy_helpers import selection_setup

GEN = torch.Generator().manual_seed(11)


def _three_part(q, k, v, allowed, context, temperature, scale, softmax_scale):
    """APE's definition as its authors' code computes it: context and the rest attended separately,
    merged by their log-sum-exps, the context's multiplied by S*T."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    s = (q @ k.transpose(1, 2)) * softmax_scale
    ctx = allowed & context[None]
    other = allowed & ~context[None]
    s_c = torch.where(ctx[None], s / temperature, -torch.inf)
    s_o = torch.where(other[None], s, -torch.inf)
    lse_c, lse_o = s_c.logsumexp(-1, keepdim=True), s_o.logsumexp(-1, keepdim=True)
    o_c, o_o = s_c.softmax(-1) @ v, s_o.softmax(-1) @ v
    w = torch.cat([scale * temperature * lse_c, lse_o], -1).softmax(-1)
    return w[..., :1] * o_c + w[..., 1:] * o_o


@pytest.mark.parametrize("temperature,scale", [(1.0, 1.0), (0.9, 0.9), (0.5, 1.0), (0.8, 0.6)])
def test_rule_equals_its_three_part_definition(temperature, scale):
    q = torch.randn(6, 4, 8, generator=GEN)
    k, v = torch.randn(2, 20, 8, generator=GEN), torch.randn(2, 20, 8, generator=GEN)
    context = torch.zeros(20, dtype=torch.bool)
    context[3:16] = True
    allowed = torch.ones(4, 20, dtype=torch.bool)
    allowed[:, 16:] = torch.tril(torch.ones(4, 4, dtype=torch.bool))  # the queries' own keys, causal
    got = ApeRule(3, 16, temperature, scale).attend(q, k, v, allowed, context, 0.35)
    torch.testing.assert_close(got, _three_part(q, k, v, allowed, context, temperature, scale, 0.35),
                               atol=1e-5, rtol=1e-5)
    if temperature == scale == 1.0:  # plain softmax attention
        plain = torch.nn.functional.scaled_dot_product_attention(
            q[None], k.repeat_interleave(3, 0)[None], v.repeat_interleave(3, 0)[None], attn_mask=allowed, scale=0.35)
        torch.testing.assert_close(got, plain[0], atol=1e-5, rtol=1e-5)


def _parallel_prompt(lm, lengths=(40, 29, 35), rule=(1.0, 1.0)):
    system, chunks, question, inp = selection_setup(lm, lengths)
    kvs = [inp.context.slice(a, b) for a, b in inp.spans]  # the chunks' KV at consecutive positions
    kvs = [kv.moved_to(len(system), lm.inv_freq) for kv in kvs]  # as stored: each right after S
    s_kv = inp.context.slice(0, len(system))
    ctx, ids, spans = assemble_context(lm, s_kv, kvs, system, chunks,
                                       partial(place, temperature=rule[0], scale=rule[1]))
    return system, chunks, question, kvs, s_kv, ctx, ids, spans


def test_layout_equals_computing_at_apes_positions(tiny_lm):
    """T = S = 1: the question over S at 0.., every chunk at len(S).., itself after the longest chunk."""
    system, chunks, question, kvs, s_kv, ctx, ids, spans = _parallel_prompt(tiny_lm)
    assert ctx.read_rule == ApeRule(len(system), spans[-1][1], 1.0, 1.0)
    assert parallel_shift(kvs) == sum(map(len, chunks)) - max(map(len, chunks))
    got = prefill_reused(tiny_lm, ctx, ids, spans, question)
    # Reference: the model's eager path over the stored KV as is (S at 0, each chunk at len(S)), the
    # question at len(S) + the longest chunk, seeing everything before it and itself causally.
    past = KV(torch.cat([s_kv.keys, *(k.keys for k in kvs)], 2), torch.cat([s_kv.values, *(k.values for k in kvs)], 2))
    start, n, T = len(system) + max(map(len, chunks)), len(question), len(past)
    allowed = torch.cat([torch.ones(n, T, dtype=torch.bool), torch.tril(torch.ones(n, n, dtype=torch.bool))], 1)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    model = tiny_lm.model
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=torch.tensor(question)[None], position_ids=torch.arange(start, start + n)[None],
                    attention_mask=mask, cache=to_dynamic_cache(past), use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got.last_logits, out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
    reuse = prefill_reused(tiny_lm, *assemble_context(tiny_lm, s_kv, kvs, system, chunks), question)
    assert (got.last_logits - reuse.last_logits).abs().max() > 1e-3  # the layout did change something


def test_one_chunk_with_t_s_one_is_full_attention(tiny_lm):
    system, chunks, question, _kvs, _s, ctx, ids, spans = _parallel_prompt(tiny_lm, lengths=(37,))
    full = prefill_full(tiny_lm, system, chunks, question)
    got = prefill_reused(tiny_lm, ctx, ids, spans, question)
    assert (got.last_logits - full.last_logits).abs().max() < 1e-4


def test_teacher_forcing_and_the_shared_decoder_read_the_same_rule(tiny_lm):
    *_, question, _kvs, _s, ctx, ids, spans = _parallel_prompt(tiny_lm, rule=(0.7, 0.8))
    pre = prefill_reused(tiny_lm, ctx, ids, spans, question)
    assert pre.kv.read_rule == ctx.read_rule  # the prompt KV carries its rule to every later reader
    answer = list(greedy_tokens(tiny_lm, pre.kv, pre.last_logits, 6, stop_ids=[]))
    forced = continuation_logprobs(tiny_lm, pre.kv, pre.last_logits, answer)
    assert answer == [int(t) for t in forced[:-1].argmax(-1)]  # the decoder's choices are teacher forcing's
    plain = KV(pre.kv.keys, pre.kv.values, pre.kv.base_position)  # the same cache read without the rule
    assert (continuation_logprobs(tiny_lm, plain, pre.last_logits, answer) - forced).abs().max() > 1e-3
    # In a batch with an ordinary row, each row decodes as alone.
    other = prefill_full(tiny_lm, [1, 2, 3], [[4, 5, 6, 7]], [8, 9])
    dec = BatchDecoder(tiny_lm)
    dec.join("ape", pre.kv)
    dec.join("plain", other.kv)
    alone = BatchDecoder(tiny_lm)
    alone.join("plain", other.kv)
    tok_a, tok_p = answer[0], int(other.last_logits.argmax())
    for step in range(4):
        both, solo = dec.step({"ape": tok_a, "plain": tok_p}), alone.step({"plain": tok_p})
        torch.testing.assert_close(both["ape"].log_softmax(-1), forced[step + 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(both["plain"], solo["plain"], atol=1e-4, rtol=1e-4)
        tok_a, tok_p = answer[step + 1], int(solo["plain"].argmax())
        if step == 1:  # a row leaving compacts the cache: the context flags must follow the slots
            dec.drop(["plain"])
            dec.join("plain", KV(*(t[:, :, :] for t in (other.kv.keys, other.kv.values)), 0))
            alone = BatchDecoder(tiny_lm)
            alone.join("plain", other.kv)
            tok_p = int(other.last_logits.argmax())


def test_ape_is_a_study_method_that_recomputes_nothing(tiny_llama):
    info = method_info("ape")  # registered by importing the plugin; the product never lists it
    assert "ape" in all_methods() and "ape" not in methods() and info.recomputes_nothing
    assert info.placement.keywords == {"temperature": 0.9, "scale": 0.9}
    assert ReuseRequest("q", "ape", ratio=0.5).validated().ratio == 0.0
    *_, question, _kvs, _s, ctx, ids, _spans = _parallel_prompt(tiny_llama)
    with pytest.raises(ValueError, match="read as stored"):
        sparse_recompute(tiny_llama, ctx, ids, torch.tensor([50, 51]), torch.tensor(question))
    info = register_ape("ape-test", 0.5, 1.0)
    assert info.kind == "study" and "ape-test" not in methods()
    with pytest.raises(Exception, match=r"\(0, 4\]"):
        register_ape("ape-bad", 0.0, 1.0)
