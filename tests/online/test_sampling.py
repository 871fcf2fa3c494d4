"""Token choice and stop strings (:mod:`fusionrag.online.sampling`), without a model."""

from __future__ import annotations

import pytest
import torch

from fusionrag.online.sampling import SamplingParams, StopMatcher, TokenSampler


def run(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.push(d) for d in deltas)
    return out + m.flush(), m.stopped


@pytest.mark.parametrize(("deltas", "expected"), [
    (["Paris", " is", "\n", "more"], "Paris is"),  # the stop string is a whole token
    (["Par", "is", " END", "ING"], "Paris "),  # across tokens: " EN" + "D..." never shows
    (["aE", "N", "Dz"], "a"),  # ends inside a token
    (["no stop here"], "no stop here"),
    (["trailing E", "N"], "trailing EN"),  # a prefix held back, released at the end
])
def test_stop_strings_cut_the_text_across_token_boundaries(deltas, expected):
    text, stopped = run(("\n", "END"), deltas)
    assert text == expected
    assert stopped == (expected != "".join(deltas))


def test_a_held_prefix_is_never_streamed():
    m = StopMatcher(("STOP",))
    assert m.push("abc ST") == "abc "  # "ST" might start "STOP"
    assert m.push("O") == ""
    assert m.push("P and more") == ""
    assert m.stopped and m.flush() == ""


def test_greedy_is_argmax_and_logprobs_are_the_models():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    p = TokenSampler(SamplingParams(logprobs=True, top_logprobs=2)).pick(logits)
    ref = torch.log_softmax(logits, -1)
    assert p.token == 1 and p.logprob == pytest.approx(float(ref[1]))
    assert [t for t, _ in p.top] == [1, 3] and p.top[1][1] == pytest.approx(float(ref[3]))


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.zeros(50)
    draw = lambda seed: [TokenSampler(SamplingParams(temperature=1.0, seed=seed)).pick(logits).token  # noqa: E731
                         for _ in range(1)]
    a = TokenSampler(SamplingParams(temperature=1.0, seed=7))
    b = TokenSampler(SamplingParams(temperature=1.0, seed=7))
    seq_a = [a.pick(logits).token for _ in range(20)]
    assert seq_a == [b.pick(logits).token for _ in range(20)]
    assert len(set(seq_a)) > 3  # uniform over 50 tokens: 20 draws are not all alike
    assert len({draw(s)[0] for s in range(20)}) > 3


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([5.0, 4.9, 4.8, -10.0, -10.0, 0.0])
    s = TokenSampler(SamplingParams(temperature=5.0, top_k=2, seed=0))
    assert {s.pick(logits).token for _ in range(200)} == {0, 1}
    # probabilities ~[.5, .3, .2]: top_p=0.6 keeps the two most likely
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    s = TokenSampler(SamplingParams(temperature=1.0, top_p=0.6, seed=0))
    assert {s.pick(logits).token for _ in range(200)} == {0, 1}
    s = TokenSampler(SamplingParams(temperature=1.0, top_p=0.4, seed=0))
    assert {s.pick(logits).token for _ in range(50)} == {0}


def test_a_vanishing_temperature_is_greedy_not_an_overflow():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert TokenSampler(SamplingParams(temperature=1e-300, seed=1)).pick(logits).token == 1


def test_an_overflowing_repetition_penalty_samples_the_top_tokens_not_an_error():
    """The API fuzzer's find: repetition_penalty 1e-300 divides a seen positive logit to infinity, and inf - inf
    made the sampler's distribution NaN (a 500). The overflowed tokens are now the largest finite scores."""
    logits = torch.tensor([0.0, 3.0, 1.0, -2.0])
    s = TokenSampler(SamplingParams(temperature=0.5, repetition_penalty=1e-300, seed=0))
    s.see_prompt([1, 2])  # both positive logits seen: divided to +inf
    assert {s.pick(logits).token for _ in range(50)} <= {1, 2}
    masked = TokenSampler(SamplingParams(temperature=1.0, seed=0))
    assert masked.pick(torch.tensor([float("nan"), 1.0, float("-inf")])).token == 1  # NaN and -inf never drawn


def test_the_warpers_scale_then_cut_top_k_then_top_p_like_generate():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    s = TokenSampler(SamplingParams(temperature=2.0, top_k=4, top_p=0.8, seed=0))
    scores = s.warpers(torch.empty(1, 0, dtype=torch.long), logits.unsqueeze(0))[0]
    scaled = logits / 2.0  # top-4: tokens 5, 0, 1, 2; of those, the smallest prefix with 80% of the mass
    probs = torch.softmax(scaled[[5, 0, 1, 2]], -1)
    assert float(probs[:2].sum()) < 0.8 <= float(probs[:3].sum())
    kept = torch.isfinite(scores)
    assert kept.tolist() == [True, True, False, False, False, True]
    assert torch.allclose(scores[kept], scaled[kept])


def test_rows_of_one_batch_keep_their_own_parameters():
    logits = torch.tensor([5.0, 4.9, 4.8, 4.7, 4.6])
    narrow = TokenSampler(SamplingParams(temperature=1.0, top_k=1, seed=3))
    wide = TokenSampler(SamplingParams(temperature=1.0, top_p=1.0, seed=3))
    greedy = TokenSampler(SamplingParams(seed=3))
    picks = [(narrow.pick(logits).token, wide.pick(logits).token, greedy.pick(logits).token) for _ in range(100)]
    assert {n for n, _, _ in picks} == {0} and {g for _, _, g in picks} == {0}
    assert len({w for _, w, _ in picks}) == 5  # near-uniform over five tokens: every one is drawn


# ------------------------------------------------------------- vLLM's names: top_k, min_p, repetition_penalty


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_of_zero_or_minus_one_is_off_as_in_vllm(off):
    logits = torch.zeros(30)
    s = TokenSampler(SamplingParams(temperature=1.0, top_k=off, seed=0))
    assert len(s.warpers) == 1  # the temperature only: no cut
    assert len({s.pick(logits).token for _ in range(300)}) > 20


def test_top_k_keeps_exactly_the_k_most_likely_and_k_of_one_is_greedy():
    logits = torch.randn(262, generator=torch.Generator().manual_seed(0)) * 3
    top20 = set(torch.topk(logits, 20).indices.tolist())
    s = TokenSampler(SamplingParams(temperature=50.0, top_k=20, seed=1))  # near-uniform over what is kept
    drawn = {s.pick(logits).token for _ in range(2000)}
    assert drawn == top20
    greedy = int(torch.argmax(logits))
    assert all(TokenSampler(SamplingParams(temperature=1.5, top_k=1, seed=seed)).pick(logits).token == greedy
               for seed in range(10))


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    s = TokenSampler(SamplingParams(temperature=1.0, min_p=0.2, seed=0))  # threshold 0.2 x 0.5 = 0.1
    scores = s.warpers(torch.empty(1, 0, dtype=torch.long), logits.unsqueeze(0))[0]
    assert torch.isinf(scores[3]) and torch.allclose(scores[:3], logits[:3])
    assert {s.pick(logits).token for _ in range(500)} == {0, 1, 2}
    assert {TokenSampler(SamplingParams(temperature=1.0, min_p=0.7, seed=0)).pick(logits).token
            for _ in range(50)} == {0}  # 0.3 < 0.7 x 0.5: only the top token is left


def test_min_p_is_applied_after_the_temperature_as_in_vllm():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # at temperature 2 the probabilities flatten: token 3's rises above 0.2 x the top one's
    s = TokenSampler(SamplingParams(temperature=2.0, min_p=0.2, seed=0))
    scores = s.warpers(torch.empty(1, 0, dtype=torch.long), logits.unsqueeze(0))[0]
    assert torch.isfinite(scores).all()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from transformers import RepetitionPenaltyLogitsProcessor

    from fusionrag.online.sampling import repetition_penalised

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    seen = torch.tensor([True, True, False, False, True])
    assert repetition_penalised(logits, seen, 2.0).tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    # the same as transformers' (and vLLM's) over the prompt and output ids
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1, 4, 0]]), logits.unsqueeze(0))[0]
    assert torch.equal(hf, repetition_penalised(logits, seen, 2.0))


def test_a_greedy_pick_is_the_argmax_of_the_penalised_logits_over_prompt_and_output():
    logits = torch.tensor([3.0, 2.9, 1.0, -5.0])
    s = TokenSampler(SamplingParams(repetition_penalty=1.5, logprobs=True))
    s.see_prompt([0, 3])
    first = s.pick(logits)  # token 0: 3.0 / 1.5 = 2.0 < 2.9
    assert first.token == 1
    assert first.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))  # the model's, not penalised
    assert s.pick(logits).token == 0  # now 1 (picked) is penalised too: 2.9 / 1.5 < 2.0
    plain = TokenSampler(SamplingParams())
    assert [plain.pick(logits).token for _ in range(2)] == [0, 0]
    one = TokenSampler(SamplingParams(repetition_penalty=1.0))
    one.see_prompt([0])
    assert one.pick(logits).token == 0  # 1 is off
