"""Selection policies: counts, bounds, ratio 0/1 equivalences, and their scores against explicit computations."""

import pytest
import torch

from fusionrag.errors import FusionRAGError
from fusionrag.execution.attention import prefill_with_context_attention
from fusionrag.execution.forward import prefill
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.online.policies import (
    EPIC_MAX_PER_CHUNK,
    METHODS,
    POLICIES,
    SelectionInput,
    budget,
    cacheblend_deviation,
    epic_budget,
    make_policy,
    question_attention,
    select,
)
from fusionrag.online.prefill import assemble_context, prefill_full, prefill_reused

GEN = torch.Generator().manual_seed(7)


def _setup(lm, lengths=(40, 29, 35)):
    system = torch.randint(0, 250, (6,), generator=GEN).tolist()
    chunks = [torch.randint(0, 250, (n,), generator=GEN).tolist() for n in lengths]
    question = torch.randint(0, 250, (7,), generator=GEN).tolist()
    s_kv, _ = prefill(lm, torch.tensor(system))
    kvs, scores = [], []
    for c in chunks:
        kvs.append(chunk_kv_plain(lm, s_kv, c))
        # Cache-Craft scores as preprocess records them (here: context = S only, enough for shape tests)
        scores.append(prefill_with_context_attention(lm, torch.tensor(c), s_kv, context_start=0)[1])
    ctx, ids, spans = assemble_context(lm, s_kv, kvs, system, chunks)
    inp = SelectionInput(lm, ctx, ids, spans, torch.tensor(question), chunk_scores=scores, seed=3)
    return system, chunks, question, inp


@pytest.mark.parametrize("method", list(POLICIES))
def test_ratio_one_is_full_attention_and_zero_is_full_reuse(tiny_lm, method):
    system, chunks, question, inp = _setup(tiny_lm)
    full = prefill_full(tiny_lm, system, chunks, question)
    reuse = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question)
    policy = make_policy(method)
    at_one = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question, select(policy, inp, 1.0))
    at_zero = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question, select(policy, inp, 0.0))
    assert (at_one.last_logits - full.last_logits).abs().max() < 1e-4
    assert torch.equal(at_zero.last_logits, reuse.last_logits)


@pytest.mark.parametrize("method", list(POLICIES))
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
    """Per-chunk and global scores vs the eager-attention weights of the real last layer."""
    _, _, question, inp = _setup(tiny_lm)
    model = tiny_lm.model
    # Reference: the model's own eager attention weights for the question over the assembled cache.
    from fusionrag.execution.forward import to_dynamic_cache

    T = len(inp.context)
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=inp.question_token_ids[None], position_ids=torch.arange(T, T + len(question))[None],
                    cache=to_dynamic_cache(inp.context), use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    att = out.attentions[-1][0]  # [heads, q, T + q]
    global_ref = att.sum(dim=(0, 1))[:T][inp.candidates]
    assert torch.allclose(question_attention(inp, "global"), global_ref, atol=1e-5)
    # per-chunk softmax: renormalise the logits within each chunk
    per_chunk = question_attention(inp, "per_chunk")
    for (a, b), part in zip(inp.spans, torch.split(per_chunk, [b - a for a, b in inp.spans]), strict=True):
        w = att[:, :, a:b]
        ref = (w / w.sum(-1, keepdim=True)).sum(dim=(0, 1))
        assert torch.allclose(part, ref, atol=1e-5)


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
    assert "full" in METHODS and "reuse" in METHODS


def test_cachecraft_without_scores_is_clear(tiny_llama):
    _, _, _, inp = _setup(tiny_llama)
    inp.chunk_scores = [None, None, None]
    with pytest.raises(FusionRAGError, match="preprocess"):
        select(make_policy("cachecraft"), inp, 0.2)


def test_authors_scores_equal_explicit_attention_against_base_position_keys(tiny_lm):
    """The authors' scoring: the model's eager last-layer attention with each chunk's keys at their
    stored base position (len(S)), renormalised within the chunk; the first chunk skipped if asked."""
    from fusionrag.execution.forward import to_dynamic_cache
    from fusionrag.kvcache.kv import KV

    system, chunks, question, inp = _setup(tiny_lm)
    s_kv, _ = prefill(tiny_lm, torch.tensor(system))
    base_keys = [chunk_kv_plain(tiny_lm, s_kv, c).keys[-1] for c in chunks]  # as stored: at len(S), never moved
    keys = inp.context.keys.clone()
    for (a, b), k in zip(inp.spans, base_keys, strict=True):
        keys[-1, :, a:b] = k  # only the last layer changes, so the question's last-layer queries are the same
    T = len(inp.context)
    model = tiny_lm.model
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=inp.question_token_ids[None], position_ids=torch.arange(T, T + len(question))[None],
                    cache=to_dynamic_cache(KV(keys, inp.context.values, 0)), use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    att = out.attentions[-1][0]
    expected = torch.cat([(att[:, :, a:b] / att[:, :, a:b].sum(-1, keepdim=True)).sum(dim=(0, 1))
                          for a, b in inp.spans])
    assert torch.allclose(question_attention(inp, "authors"), expected, atol=1e-5)
    assert not torch.allclose(question_attention(inp, "per_chunk"), expected, atol=1e-3)  # re-positioning matters
    skipped = question_attention(inp, "authors", skip_first_chunk=True)
    first = inp.spans[0][1] - inp.spans[0][0]
    assert torch.isinf(skipped[:first]).all() and torch.allclose(skipped[first:], expected[first:], atol=1e-5)
    idx = select(make_policy("fusionrag", softmax="authors", skip_first_chunk=True), inp, 0.3)
    assert idx.numel() == budget(0.3, inp.candidates.numel()) and (idx >= inp.spans[1][0]).all()


@pytest.mark.parametrize("options", [{"softmax": "authors", "skip_first_chunk": True}, {"softmax": "authors"},
                                     {"softmax": "global", "skip_first_chunk": True}])
def test_selection_variants_at_ratio_one_are_full_attention(tiny_lm, options):
    system, chunks, question, inp = _setup(tiny_lm)
    full = prefill_full(tiny_lm, system, chunks, question)
    idx = select(make_policy("fusionrag", **options), inp, 1.0)
    at_one = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question, idx)
    assert (at_one.last_logits - full.last_logits).abs().max() < 1e-4
