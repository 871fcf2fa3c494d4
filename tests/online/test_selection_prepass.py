"""The question's selection pre-pass, stopped where the scored layer's attention begins (decision 048),
selects bit for bit what the whole forward (the reference, the path before it) selected."""

import dataclasses

import pytest
import torch
from prepass_reference import ReferenceQueryGuided, question_queries_reference, reference_attention

from fusionrag.execution import attention_hook
from fusionrag.execution.forward import forward, forward_to_attention, prefill
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.offline.preprocess import fuse_one
from fusionrag.online.policies import (
    QueryGuided,
    SelectionInput,
    question_attention,
    question_queries,
    select,
)
from fusionrag.online.prefill import assemble_context, prefill_reused
from policy_helpers import eager_attentions

RATIOS = [0.05, 0.15, 0.3, 0.5]


def _input(lm, kind: str, stored_dtype: torch.dtype, seed: int = 3) -> SelectionInput:
    """An assembled context of three chunks after ``S``: plain KV, or fused (each chunk prefilled after the
    other two's plain KV, the offline stage's ``fuse_one``), stored in ``stored_dtype`` as a store keeps it."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 250, (6,), generator=gen).tolist()
    chunks = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (40, 29, 35)]
    question = torch.randint(0, 250, (9,), generator=gen).tolist()
    s_kv, _ = prefill(lm, torch.tensor(system))
    plain = [chunk_kv_plain(lm, s_kv, c) for c in chunks]
    if kind == "fused":
        kvs = [fuse_one(lm, s_kv, i, chunks[i], [j for j in range(3) if j != i], plain.__getitem__).kv
               for i in range(3)]
    else:
        kvs = plain
    kvs = [kv.to(stored_dtype) for kv in kvs]
    ctx, ids, spans = assemble_context(lm, s_kv, kvs, system, chunks)
    return SelectionInput(lm, ctx, ids, spans, torch.tensor(question))


@pytest.mark.parametrize("backend", ["blocked", "reference"])
@pytest.mark.parametrize("kind", ["plain", "fused"])
@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_the_stopped_pre_pass_selects_bit_for_bit_what_the_whole_forward_selected(tiny_lm, backend, kind, stored):
    lm = dataclasses.replace(tiny_lm, attention=backend)
    inp = _input(lm, kind, stored)
    new, ref = question_queries(inp), question_queries_reference(inp)
    assert torch.equal(new.queries, ref.queries) and torch.equal(new.question_keys, ref.question_keys)
    assert torch.equal(question_attention(inp), reference_attention(inp))
    question = inp.question_token_ids.tolist()
    for ratio in RATIOS:
        idx = select(QueryGuided(), inp, ratio)
        idx_ref = select(ReferenceQueryGuided(), inp, ratio)
        assert torch.equal(idx, idx_ref), ratio
        out = prefill_reused(lm, inp.context, inp.context_ids, inp.spans, question, idx)
        out_ref = prefill_reused(lm, inp.context, inp.context_ids, inp.spans, question, idx_ref)
        assert torch.equal(out.last_logits, out_ref.last_logits)
        assert torch.equal(out.kv.keys, out_ref.kv.keys) and torch.equal(out.kv.values, out_ref.kv.values)


def test_forward_to_attention_gives_each_layers_keys_of_the_whole_pass_and_skips_the_rest(tiny_lm):
    inp = _input(tiny_lm, "plain", torch.float32)
    T, q = len(inp.context), inp.question_token_ids.numel()
    pos = torch.arange(T, T + q)
    whole = forward(tiny_lm, inp.question_token_ids, pos, inp.context)
    ran: list[str] = []
    hooks = [tiny_lm.adapter.body.norm.register_forward_hook(lambda *_: ran.append("norm")),
             tiny_lm.model.lm_head.register_forward_hook(lambda *_: ran.append("lm_head"))]
    hooks += [layer.mlp.register_forward_hook(lambda *_, i=i: ran.append(f"mlp{i}"))
              for i, layer in enumerate(tiny_lm.adapter.layers)]
    try:
        for layer in range(tiny_lm.num_layers):
            ran.clear()
            keys = forward_to_attention(tiny_lm, inp.question_token_ids, pos, inp.context, layer)
            assert torch.equal(keys, whole.keys[layer])
            assert ran == [f"mlp{i}" for i in range(layer)]  # no MLP from the stop on, no norm, no LM head
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(forward_to_attention(tiny_lm, inp.question_token_ids, pos, inp.context), whole.keys[-1])


def test_a_stop_the_pass_never_reaches_is_an_error_and_leaves_later_passes_whole(tiny_llama):
    ids, pos = torch.arange(4), torch.arange(4)
    with pytest.raises(RuntimeError, match="never reached layer 99"), attention_hook.stop_at_attention(99):
        forward(tiny_llama, ids, pos)
    kv, _ = prefill(tiny_llama, ids)  # no stop left behind
    assert kv.keys.shape[0] == tiny_llama.num_layers


@pytest.mark.parametrize("layer", [0, 1])
def test_an_earlier_scoring_layer_is_that_layers_attention(tiny_lm, layer):
    """The option: scores from layer ``layer``'s attention, checked against the model's eager weights there."""
    inp = _input(tiny_lm, "plain", torch.float32)
    T = len(inp.context)
    expected = eager_attentions(tiny_lm, inp)[layer][0].sum(dim=(0, 1))[:T][inp.candidates]
    assert torch.allclose(question_attention(inp, layer=layer), expected, atol=1e-5)
    assert question_queries(inp, layer).layer == layer
    idx = select(QueryGuided(layer=layer), inp, 0.15)
    assert idx.numel() == round(0.15 * inp.candidates.numel())
