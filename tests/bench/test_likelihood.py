"""Teacher-forced metrics: gold NLL against plain transformers, spellings, end-of-turn, KL, recovery."""

import math

import pytest
import torch

from fusionrag.bench.full_reference import FullReference, FullResult
from fusionrag.bench.likelihood import (
    TopKReference,
    answer_spellings,
    coarse_kl,
    encode_answer,
    gold_nll,
    kl_along_reference,
    kl_recovery,
    reference_kl,
)
from fusionrag.execution.forward import prefill
from fusionrag.execution.teacher_forcing import continuation_logprobs

GEN = torch.Generator().manual_seed(11)


def _prompt(lm, n=30):
    ids = torch.randint(0, 250, (n,), generator=GEN)
    kv, logits = prefill(lm, ids)
    return ids, kv, logits[-1]


def _hand_nll(lm, prompt_ids, answer_ids):
    """Teacher-forced NLL per answer token from one plain transformers forward over prompt + answer."""
    full = torch.cat([prompt_ids, torch.tensor(answer_ids)])
    logits = lm.model(input_ids=full[None]).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids) - 1  # the logits at the prompt's last token predict the first answer token
    return [-float(logp[start + j, t]) for j, t in enumerate(answer_ids)]


def test_gold_nll_equals_a_hand_computed_teacher_forced_loss(tiny_llama):
    lm = tiny_llama
    prompt_ids, kv, last = _prompt(lm)
    eot = lm.stop_token_ids[0]
    golds = ["paris", "the city of light"]
    best, best_eot = math.inf, math.inf
    for s in answer_spellings(golds):
        ids = encode_answer(lm.tokenizer, s)
        nll = _hand_nll(lm, prompt_ids, [*ids, eot])
        best = min(best, sum(nll[:-1]) / len(ids))
        best_eot = min(best_eot, sum(nll) / len(nll))
    got = gold_nll(lm, kv, last, golds)
    assert got.nll == pytest.approx(best, abs=1e-4)
    assert got.nll_eot == pytest.approx(best_eot, abs=1e-4)
    assert got.nll != pytest.approx(got.nll_eot, abs=1e-6)  # the end-of-turn option really changes it


def test_spellings_as_given_lower_and_capitalised_deduplicated():
    assert answer_spellings(["yes"]) == ["yes", "Yes"]
    assert answer_spellings(["New York", " "]) == ["New York", "new york"]
    assert answer_spellings([f"a{i}" for i in range(9)], max_aliases=2) == ["a0", "A0", "a1", "A1"]


def test_a_spelling_the_model_prefers_is_what_counts(tiny_llama):
    """Best over spellings: adding a spelling can only lower the reported NLL."""
    lm = tiny_llama
    _, kv, last = _prompt(lm)
    one = gold_nll(lm, kv, last, ["abc"]).nll
    assert gold_nll(lm, kv, last, ["abc", "xyz"]).nll <= one + 1e-9


def test_continuation_rows_are_the_greedy_decoder_s_distributions(tiny_llama):
    """Row 0 is the prefill's own first-token distribution, and teacher forcing the greedy answer
    reproduces each next greedy choice (the prompt KV is not modified by scoring)."""
    from fusionrag.execution.generate import greedy_tokens

    lm = tiny_llama
    _, kv, last = _prompt(lm)
    ids = list(greedy_tokens(lm, kv, last, 6, stop_ids=[]))
    rows = continuation_logprobs(lm, kv, last, ids)
    assert rows.shape[0] == len(ids) + 1
    assert torch.allclose(rows[0], torch.log_softmax(last.float(), -1), atol=1e-6)
    assert [int(r.argmax()) for r in rows[:-1]] == ids
    assert torch.equal(continuation_logprobs(lm, kv, last, ids), rows)  # scoring twice: same KV, same rows


def test_re_encoding_the_answer_text_gives_back_its_ids(tiny_llama):
    tok = tiny_llama.tokenizer
    for text in ["Paris", "yes", "1,024 metres"]:
        ids = encode_answer(tok, text)
        assert encode_answer(tok, tok.decode(ids, skip_special_tokens=True).strip()) == ids


def test_coarse_kl_is_the_full_kl_with_every_token_and_a_lower_bound_with_few():
    p = torch.log_softmax(torch.randn(50, generator=GEN) * 2, -1)
    q = torch.log_softmax(torch.randn(50, generator=GEN) * 2, -1)
    full = float((p.double().exp() * (p.double() - q.double())).sum())
    top_all = torch.topk(p, 50)
    assert coarse_kl(top_all.indices, top_all.values, q) == pytest.approx(full, rel=1e-6)
    top5 = torch.topk(p, 5)
    assert 0.0 <= coarse_kl(top5.indices, top5.values, q) <= full + 1e-9
    assert coarse_kl(top5.indices, top5.values, p) == pytest.approx(0.0, abs=1e-9)


def test_reference_kl_is_zero_against_itself_and_positive_for_another_prompt(tiny_llama):
    lm = tiny_llama
    _, kv, last = _prompt(lm)
    ids = [65, 66, 67]
    ref = TopKReference.from_logprobs(ids, True, continuation_logprobs(lm, kv, last, ids), k=16)
    assert ref.positions == 4  # three answer tokens + the end-of-turn position
    first, answer = reference_kl(lm, kv, last, ref)
    assert first == pytest.approx(0.0, abs=1e-6) and answer == pytest.approx(0.0, abs=1e-6)
    _, kv2, last2 = _prompt(lm)
    per_pos = kl_along_reference(ref, continuation_logprobs(lm, kv2, last2, ids))
    assert len(per_pos) == 4 and min(per_pos) > 0


def test_kl_recovery_and_its_degenerate_denominator():
    assert kl_recovery(0.25, 1.0) == pytest.approx(0.75)
    assert kl_recovery(2.0, 1.0) == pytest.approx(-1.0)  # worse than Full Reuse
    assert kl_recovery(0.0, 0.0) is None  # Full Reuse already equals Full Attention: nothing to recover
    assert kl_recovery(None, 1.0) is None and kl_recovery(0.1, math.nan) is None


def test_full_reference_round_trips_and_refuses_other_input(tmp_path):
    ref = TopKReference([5, 6], False, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]))
    store = FullReference(tmp_path, "m")
    store.put("ds", "q/1", 8, FullResult("five six", ref, {"input_sha": "abc", "gold_nll": 1.5}))
    got = store.get("ds", "q/1", 8, "abc")
    assert got is not None and got.text == "five six" and got.info["gold_nll"] == 1.5
    assert got.reference.answer_ids == [5, 6] and not got.reference.ended
    assert torch.equal(got.reference.top_ids, ref.top_ids) and torch.equal(got.reference.top_logprobs, ref.top_logprobs)
    assert store.get("ds", "q/1", 8, "other") is None  # same id, other passages: not served
    assert store.get("ds", "q/1", 16, "abc") is None


def test_a_damaged_reference_file_is_not_served(tmp_path):
    ref = TopKReference([5], True, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]))
    store = FullReference(tmp_path, "m")
    store.put("ds", "q", 8, FullResult("five", ref, {"input_sha": "abc"}))
    path = store.path("ds", "q", 8)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the tensor data
    path.write_bytes(bytes(data))
    assert store.get("ds", "q", 8, "abc") is None
