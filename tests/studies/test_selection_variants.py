"""The studies' selection variants: registered through the engine's policy registry, each equal to Full
Attention at ratio 1 (the test every method passes), and the research code's scoring checked against an
explicit computation."""

import pytest
import torch
from studies.selection.variants import per_chunk_attention, register

from fusionrag.execution.forward import prefill
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.online.methods import all_methods, default_kv, make_policy, methods
from fusionrag.online.policies import budget, select
from fusionrag.online.prefill import prefill_full, prefill_reused
from policy_helpers import selection_setup

VARIANTS = ["query", "fusionrag-perchunk", "fusionrag-authors", "fusionrag-authors-all", "query-authors",
            "fusionrag-plainfirst", "random"]


def test_variants_register_as_study_methods_with_their_kv():
    register()
    assert set(VARIANTS) <= set(all_methods()) and not set(VARIANTS) & set(methods())
    assert default_kv("query") == "plain" and default_kv("fusionrag-authors") == "fused"
    assert default_kv("fusionrag-plainfirst") == default_kv("fusionrag") == "plain-first"


@pytest.mark.parametrize("method", VARIANTS)
def test_each_variant_at_ratio_one_is_full_attention(tiny_lm, method):
    register()
    system, chunks, question, inp = selection_setup(tiny_lm)
    full = prefill_full(tiny_lm, system, chunks, question)
    idx = select(make_policy(method), inp, 1.0)
    at_one = prefill_reused(tiny_lm, inp.context, inp.context_ids, inp.spans, question, idx)
    assert (at_one.last_logits - full.last_logits).abs().max() < 1e-4


def test_authors_scores_equal_explicit_attention_against_base_position_keys(tiny_lm):
    """The research code's scoring: the model's eager last-layer attention with each chunk's keys at their
    stored base position (len(S)), renormalised within the chunk; the first chunk skipped."""
    from fusionrag.execution.forward import to_dynamic_cache
    from fusionrag.kvcache.kv import KV

    register()
    system, chunks, question, inp = selection_setup(tiny_lm)
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
    assert torch.allclose(per_chunk_attention(inp, stored_positions=True), expected, atol=1e-5)
    assert not torch.allclose(per_chunk_attention(inp, stored_positions=False), expected, atol=1e-3)
    skipped = make_policy("fusionrag-authors").scores(inp)
    first = inp.spans[0][1] - inp.spans[0][0]
    assert torch.isinf(skipped[:first]).all() and torch.allclose(skipped[first:], expected[first:], atol=1e-5)
    idx = select(make_policy("fusionrag-authors"), inp, 0.3)
    assert idx.numel() == budget(0.3, inp.candidates.numel()) and (idx >= inp.spans[1][0]).all()
