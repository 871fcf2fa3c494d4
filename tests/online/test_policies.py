"""Selection policies: counts, bounds, ratio 0/1 equivalences, and their scores against explicit computations."""

import pytest
import torch

from fusionrag.errors import FusionRAGError
from fusionrag.execution.forward import prefill
from fusionrag.online.methods import all_methods, make_policy, method_info, methods, register_policy
from fusionrag.online.policies import (
    EPIC_MAX_PER_CHUNK,
    QueryGuided,
    budget,
    cacheblend_deviation,
    epic_budget,
    question_attention,
    select,
)
from fusionrag.online.prefill import prefill_full, prefill_reused
from policy_helpers import eager_attentions
from policy_helpers import selection_setup as _setup

POLICIES = [m for m in methods() if method_info(m).factory is not None]  # selection policies

@pytest.mark.parametrize("method", POLICIES)
def test_ratio_one_is_full_attention_and_zero_is_full_reuse(tiny_lm, method):
    system, chunks, question, inp = _setup(tiny_lm)
    full = prefill_full(tiny_lm, system, chunks, question)
    reuse = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question)
    policy = make_policy(method)
    at_one = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question, select(policy, inp, 1.0))
    at_zero = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question, select(policy, inp, 0.0))
    assert (at_one.last_logits - full.last_logits).abs().max() < 1e-4
    assert torch.equal(at_zero.last_logits, reuse.last_logits)


@pytest.mark.parametrize("method", POLICIES)
@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3, 0.5, 0.9])
def test_policy_returns_requested_count_of_unique_context_tokens(tiny_llama, method, ratio):
    _, _, _, inp = _setup(tiny_llama)
    idx = select(make_policy(method), inp, ratio)
    n_ctx = inp.candidates.numel()
    expected = epic_budget(ratio, inp.spans) if method == "epic" else budget(ratio, n_ctx)
    assert idx.numel() == expected
    assert idx.unique().numel() == idx.numel()
    in_chunks = torch.zeros(len(inp.context), dtype=torch.bool)
    in_chunks[inp.candidates] = True
    assert in_chunks[idx].all()  # never S, never outside the context


def test_epic_takes_the_first_tokens_of_each_chunk(tiny_llama):
    _, _, _, inp = _setup(tiny_llama, lengths=(40, 40, 40))
    idx = select(make_policy("epic"), inp, 0.25)  # 30 tokens -> 10 per chunk
    offsets = sorted((i - a) for i in idx.tolist() for a, b in inp.spans if a <= i < b)
    assert offsets == sorted(list(range(10)) * 3)
    assert epic_budget(0.99, inp.spans) == 3 * EPIC_MAX_PER_CHUNK


def test_query_scores_equal_explicit_last_layer_attention(tiny_lm):
    """FusionRAG's scores vs the eager-attention weights of the real last layer."""
    _, _, _question, inp = _setup(tiny_lm)
    T = len(inp.context)
    att = eager_attentions(tiny_lm, inp)[-1][0]  # [heads, q, T + q]
    global_ref = att.sum(dim=(0, 1))[:T][inp.candidates]
    assert torch.allclose(question_attention(inp), global_ref, atol=1e-5)


def test_cacheblend_score_equals_explicit_layer1_deviation(tiny_lm):
    system, chunks, _question, inp = _setup(tiny_lm)
    ctx_ids = torch.tensor([*system, *(t for c in chunks for t in c)])
    exact, _ = prefill(tiny_lm, ctx_ids)  # full attention over S + chunks: layer 1 is "fresh"
    s = len(system)
    explicit_v = ((exact.values[1, :, s:] - inp.context.values[1, :, s:]) ** 2).sum(dim=(0, 2))
    explicit_k = ((exact.keys[1, :, s:] - inp.context.keys[1, :, s:]) ** 2).sum(dim=(0, 2))
    assert torch.allclose(cacheblend_deviation(inp), explicit_v, atol=1e-5)
    assert torch.allclose(cacheblend_deviation(inp, on="keys"), explicit_k, atol=1e-5)
    assert explicit_v.max() > 1e-4  # reuse did deviate, so the comparison means something


def test_unknown_method_is_clear():
    with pytest.raises(FusionRAGError, match="unknown method"):
        make_policy("magic")
    assert methods() == ["full", "reuse", "fusionrag", "auto", "cacheblend", "cachecraft", "epic", "prophetkv"]


def test_a_registered_policy_is_a_method_every_door_accepts_but_the_product_does_not_list():
    from fusionrag.online.request import ReuseRequest

    register_policy("test-echo", lambda: QueryGuided("test-echo"), kv="fused")
    assert "test-echo" in all_methods() and "test-echo" not in methods()
    assert ReuseRequest("q", "test-echo").validated().kv == "fused"
    with pytest.raises(FusionRAGError):
        register_policy("full", QueryGuided)


def test_cachecraft_without_scores_is_clear(tiny_llama):
    _, _, _, inp = _setup(tiny_llama)
    inp.chunk_scores = [None, None, None]
    with pytest.raises(FusionRAGError, match="preprocess"):
        select(make_policy("cachecraft"), inp, 0.2)


def test_prophetkv_scores_equal_the_layer_mean_of_explicit_attention(tiny_lm):
    """ProphetKV's score vs every layer's eager attention weights of the question over the assembled cache,
    renormalised over the context keys (its softmax leaves the question's own keys out)."""
    from fusionrag.online.policies import layerwise_question_attention

    _, _, _question, inp = _setup(tiny_lm)
    T = len(inp.context)
    per_layer = []
    for att in eager_attentions(tiny_lm, inp):  # [1, heads, q, T + q]
        ctx = att[0, :, :, :T]
        per_layer.append((ctx / ctx.sum(-1, keepdim=True)).mean(dim=(0, 1)))
    expected = torch.stack(per_layer).mean(0)[inp.candidates]
    got = layerwise_question_attention(inp)
    assert torch.allclose(got, expected, atol=1e-5)
