"""The engine's generic hooks for a method's own layout: a placement (called as ``assemble`` is) and the
read rule its KV may carry. A rule that is plain attention changes nothing, yet every reader of the
prompt (the question's pass, teacher forcing, the shared decoder) goes through it; a prompt with a rule
recomputes nothing. APE, the one placement with a rule, is a plugin: tests/studies/test_ape.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from fusionrag.execution.decoder import BatchDecoder
from fusionrag.execution.recompute import sparse_recompute
from fusionrag.execution.teacher_forcing import continuation_logprobs
from fusionrag.kvcache.kv import assemble
from fusionrag.online.methods import all_methods, method_info, methods, register_placement
from fusionrag.online.prefill import assemble_context, prefill_full, prefill_reused
from fusionrag.online.request import ReuseRequest
from policy_helpers import selection_setup


@dataclass(frozen=True)
class PlainRule:
    """Plain attention through the rule's interface, counting its calls."""

    start: int
    stop: int
    calls: list = field(default_factory=list, compare=False)

    def attend(self, q, keys, values, allowed, span, scale):
        self.calls.append(int(span.sum()))
        groups = q.shape[0] // keys.shape[0]
        return torch.nn.functional.scaled_dot_product_attention(
            q[None].float(), keys.repeat_interleave(groups, 0)[None].float(),
            values.repeat_interleave(groups, 0)[None].float(), attn_mask=allowed, scale=scale)[0].to(q.dtype)


def _with_rule(*args, **kwargs):
    kv, spans = assemble(*args, **kwargs)
    return replace(kv, read_rule=PlainRule(spans[0][0], spans[-1][1])), spans


def test_a_plain_rule_changes_nothing_and_every_reader_calls_it(tiny_llama):
    lm = tiny_llama
    system, chunks, question, inp = selection_setup(lm, (12, 9))
    kvs = [inp.context.slice(a, b).moved_to(len(system), lm.inv_freq) for a, b in inp.spans]
    s_kv = inp.context.slice(0, len(system))
    ctx, ids, spans = assemble_context(lm, s_kv, kvs, system, chunks, _with_rule)
    rule = ctx.read_rule
    assert rule == PlainRule(len(system), spans[-1][1])
    plain = prefill_reused(lm, *assemble_context(lm, s_kv, kvs, system, chunks), question)
    got = prefill_reused(lm, ctx, ids, spans, question)
    assert rule.calls and set(rule.calls) == {spans[-1][1] - len(system)}  # the question's pass read through it
    assert got.kv.read_rule is rule
    torch.testing.assert_close(got.last_logits, plain.last_logits, atol=1e-4, rtol=1e-4)
    answer = [3, 1, 4]
    before = len(rule.calls)
    torch.testing.assert_close(continuation_logprobs(lm, got.kv, got.last_logits, answer),
                               continuation_logprobs(lm, plain.kv, plain.last_logits, answer), atol=1e-4, rtol=1e-4)
    assert len(rule.calls) > before  # teacher forcing read through it
    other = prefill_full(lm, [1, 2, 3], [[4, 5, 6, 7]], [8, 9])
    dec, ref = BatchDecoder(lm), BatchDecoder(lm)
    dec.join("ruled", got.kv)
    dec.join("other", other.kv)
    ref.join("ruled", plain.kv)
    ref.join("other", other.kv)
    before = len(rule.calls)
    for _ in range(2):
        a, b = dec.step({"ruled": 5, "other": 6}), ref.step({"ruled": 5, "other": 6})
        for row in ("ruled", "other"):
            torch.testing.assert_close(a[row], b[row], atol=1e-4, rtol=1e-4)
    assert len(rule.calls) > before  # the decoder read the ruled row through it
    with pytest.raises(ValueError, match="read as stored"):
        sparse_recompute(lm, ctx, ids, torch.tensor([len(system)]), torch.tensor(question))


def test_a_placement_is_a_method_that_recomputes_nothing():
    info = register_placement("test-placement", _with_rule, kv="fused")
    assert info.recomputes_nothing and info.placement is _with_rule
    assert "test-placement" in all_methods() and "test-placement" not in methods()
    assert ReuseRequest("q", "test-placement", ratio=0.5).validated().ratio == 0.0
    assert method_info("test-placement").kv == "fused"
    with pytest.raises(Exception, match="built in"):
        register_placement("reuse", _with_rule)
