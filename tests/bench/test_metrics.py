"""Evaluation metrics against hand-worked examples, and the QA dataset loader."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import shared_data_file
from fusionrag.bench.datasets import (
    Passage,
    QAExample,
    infer_dataset_name,
    knowledge_base,
    load_questions,
    truncate_passage_words,
)
from fusionrag.bench.metrics import (
    agreement_f1,
    answer_scores,
    bootstrap_ci,
    bootstrap_diff_ci,
    contains_gold,
    exact_match,
    f1,
    kl_first_token,
    normalised_agreement,
    normalised_score,
    normalize_answer,
    percentile_bootstrap,
    top1_agree,
)
from fusionrag.errors import FusionRAGError

# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple,  a  pear. ", "apple pear"),
        ("Warsaw!", "warsaw"),
        ("U.S.A.", "usa"),
        ("Theatre", "theatre"),  # an article only as a whole word
        ("“Curie’s” – 1911", "curies 1911"),  # Unicode quotes and dashes are punctuation too
        ("", ""),
        ("The", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# --------------------------------------------------------------------------- gold metrics


def test_f1_hand_worked():
    # pred {warsaw, poland}, gold {warsaw}: P = 1/2, R = 1 -> F1 = 2/3.
    assert f1("Warsaw, Poland", "warsaw") == pytest.approx(2 / 3)
    # pred {born, in, warsaw}, gold {warsaw, poland}: overlap 1, P = 1/3, R = 1/2 -> F1 = 0.4.
    assert f1("born in Warsaw", "Warsaw Poland") == pytest.approx(0.4)
    assert f1("Paris", "Warsaw") == 0.0


def test_f1_counts_repeated_tokens_once_per_gold_occurrence():
    # pred {new, new, york}, gold {new, york}: overlap 2, P = 2/3, R = 1 -> F1 = 0.8.
    assert f1("new new york", "New York") == pytest.approx(0.8)


def test_f1_takes_best_alias_and_ignores_case_articles_punctuation():
    golds = ["Marie Skłodowska Curie", "Marie Curie", "Curie"]
    assert f1("the CURIE.", golds) == 1.0
    assert exact_match("the CURIE.", golds) == 1.0
    assert f1("Marie Curie (physicist)", golds) == pytest.approx(0.8)  # best alias: "Marie Curie"


def test_empty_answers():
    assert f1("", "") == 1.0
    assert f1("the", "a") == 1.0  # both normalise to empty
    assert f1("", "Warsaw") == 0.0
    assert f1("Warsaw", "") == 0.0
    assert exact_match("", "Warsaw") == 0.0
    assert exact_match("", "") == 1.0
    assert contains_gold("", "Warsaw") == 0.0
    assert contains_gold("Warsaw", "the") == 0.0  # an empty gold must not match everything
    assert contains_gold("", "the") == 1.0


def test_no_gold_list_is_an_error():
    with pytest.raises(ValueError, match="no gold"):
        f1("x", [])


def test_exact_match():
    assert exact_match("The Warsaw", ["Kraków", "warsaw"]) == 1.0
    assert exact_match("Warsaw, Poland", "Warsaw") == 0.0


def test_contains_gold_whole_tokens():
    assert contains_gold("She was born in Warsaw, Poland.", ["Paris", "warsaw"]) == 1.0
    assert contains_gold("In 1911.", "1911") == 1.0
    assert contains_gold("1911", "1") == 0.0  # not a substring match inside a token
    assert contains_gold("Born in New York City", "new york") == 1.0
    assert contains_gold("York", "New York") == 0.0


def test_answer_scores():
    assert answer_scores("Warsaw", ["warsaw"]) == {"f1": 1.0, "em": 1.0, "contains": 1.0}


# --------------------------------------------------------------------------- normalised scores


def test_normalised_score():
    assert normalised_score(0.8, reuse=0.6, full=1.0) == pytest.approx(0.5)
    assert normalised_score(0.6, reuse=0.6, full=1.0) == 0.0
    assert normalised_score(1.0, reuse=0.6, full=1.0) == 1.0
    assert normalised_score(0.5, reuse=0.6, full=1.0) == pytest.approx(-0.25)  # worse than reuse
    # A reversed gap (reuse better than full) is still a well-defined ratio.
    assert normalised_score(0.7, reuse=0.8, full=0.6) == pytest.approx(0.5)


def test_normalised_score_degenerate_is_undefined_not_a_division_by_zero():
    assert normalised_score(0.5, reuse=0.4, full=0.4) is None
    assert normalised_score(0.5, reuse=0.4, full=0.4 + 1e-12) is None
    assert normalised_score(0.5, reuse=0.4, full=0.41, eps=0.05) is None
    assert normalised_score(None, reuse=0.4, full=0.8) is None
    assert normalised_score(0.5, reuse=math.nan, full=0.8) is None


def test_agreement_and_normalised_agreement():
    assert agreement_f1("Warsaw", "warsaw.") == 1.0
    assert agreement_f1("in Warsaw", "Warsaw") == pytest.approx(2 / 3)
    assert agreement_f1("", "") == 1.0
    assert normalised_agreement(0.75, 0.5) == pytest.approx(0.5)
    assert normalised_agreement(1.0, 0.5) == 1.0
    assert normalised_agreement(0.9, 1.0) is None


# --------------------------------------------------------------------------- first-token fidelity


def test_kl_first_token_zero_for_identical_logits():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert kl_first_token(logits, logits.clone()) == pytest.approx(0.0, abs=1e-12)
    # Softmax is shift-invariant: adding a constant changes nothing.
    assert kl_first_token(logits, logits + 3.0) == pytest.approx(0.0, abs=1e-12)
    assert kl_first_token(logits.view(1, -1), logits.view(1, -1)) == pytest.approx(0.0, abs=1e-12)


def test_kl_first_token_hand_worked_and_asymmetric():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    q = torch.tensor([0.9, 0.1], dtype=torch.float64).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_first_token(p, q) == pytest.approx(expected, rel=1e-9)
    assert kl_first_token(p, q) > 0
    assert kl_first_token(q, p) != pytest.approx(kl_first_token(p, q))


def test_kl_first_token_handles_masked_tokens_and_fp16():
    full = torch.tensor([2.0, 1.0, -math.inf])
    assert kl_first_token(full, torch.tensor([2.0, 1.0, 0.0])) > 0
    assert math.isfinite(kl_first_token(full, torch.tensor([2.0, 1.0, 0.0])))
    half = torch.randn(64).half()
    assert kl_first_token(half, half) == pytest.approx(0.0, abs=1e-12)


def test_kl_first_token_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="vocabulary"):
        kl_first_token(torch.zeros(5), torch.zeros(6))
    with pytest.raises(ValueError, match="one next-token distribution"):
        kl_first_token(torch.zeros(2, 5), torch.zeros(2, 5))


def test_top1_agree():
    assert top1_agree(torch.tensor([0.1, 3.0, 0.2]), torch.tensor([0.0, 1.0, 0.5])) == 1.0
    assert top1_agree(torch.tensor([0.1, 3.0, 0.2]), torch.tensor([0.0, 1.0, 1.5])) == 0.0
    assert top1_agree([1.0, 0.0], np.array([2.0, 1.0])) == 1.0


# --------------------------------------------------------------------------- bootstrap


def test_bootstrap_ci_contains_mean_and_narrows_with_n():
    rng = np.random.default_rng(1)
    small = rng.random(20)
    large = rng.random(2000)
    mean_s, lo_s, hi_s = bootstrap_ci(small)
    mean_l, lo_l, hi_l = bootstrap_ci(large)
    assert mean_s == pytest.approx(small.mean())
    assert lo_s <= mean_s <= hi_s
    assert lo_l <= mean_l <= hi_l
    assert (hi_l - lo_l) < (hi_s - lo_s) / 4  # width ~ 1/sqrt(n): 10x narrower expected
    # Roughly the normal-theory interval for a large sample.
    se = large.std(ddof=1) / math.sqrt(large.size)
    assert hi_l - lo_l == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_bootstrap_ci_is_reproducible_and_handles_edge_cases():
    values = [0.0, 1.0, 1.0, 0.5, 0.25]
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    assert bootstrap_ci([0.7]) == (0.7, 0.7, 0.7)
    assert bootstrap_ci([0.4, 0.4, 0.4]) == pytest.approx((0.4, 0.4, 0.4))
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    # Undefined values are dropped, not counted as zero.
    assert bootstrap_ci([1.0, None, 1.0, math.nan])[0] == 1.0
    with pytest.raises(ValueError):
        bootstrap_ci(values, alpha=1.5)


def test_bootstrap_diff_ci_paired():
    rng = np.random.default_rng(2)
    base = rng.random(200)  # large shared per-question variance
    a = base + 0.05
    b = base
    mean, lo, hi = bootstrap_diff_ci(a, b)
    assert mean == pytest.approx(0.05)
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)  # pairing removes the shared variance
    mean, lo, hi = bootstrap_diff_ci([1.0, 0.0, None, 1.0], [0.0, 0.0, 1.0, 1.0])
    assert mean == pytest.approx(1 / 3)
    assert lo <= mean <= hi
    with pytest.raises(ValueError, match="same length"):
        bootstrap_diff_ci([1.0], [1.0, 2.0])


def test_bootstrap_ci_on_known_data_matches_the_binomial_quantiles():
    """Ten 0s and ten 1s: a resampled mean is Binomial(20, 1/2) / 20, whose 2.5% and 97.5% quantiles are 0.3, 0.7."""
    mean, lo, hi = bootstrap_ci([0.0] * 10 + [1.0] * 10, n_boot=4000)
    assert mean == 0.5
    assert lo == pytest.approx(0.3, abs=0.05) and hi == pytest.approx(0.7, abs=0.05)


def test_bootstrap_ci_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    samples = rng.exponential(1.0, size=(200, 60))  # true mean 1, skewed like per-question scores
    covered = sum(lo <= 1.0 <= hi for _, lo, hi in (bootstrap_ci(s, seed=i) for i, s in enumerate(samples)))
    assert 0.88 <= covered / len(samples) <= 0.99


def test_bootstrap_diff_ci_resamples_pairs_not_each_side():
    rng = np.random.default_rng(3)
    base = rng.normal(0.5, 0.3, size=80)  # shared per-question difficulty
    a = base + 0.05 + rng.normal(0, 0.02, size=80)
    _, lo, hi = bootstrap_diff_ci(a, base)
    assert lo <= 0.05 <= hi and lo > 0  # the true gap is inside, and the interval excludes 0
    _, lo_a, hi_a = bootstrap_ci(a)
    assert (hi - lo) < (hi_a - lo_a) / 5  # unpaired, the shared variance would swamp the gap


def test_percentile_bootstrap_leaves_undefined_resamples_out():
    def ratio(a, b, axis=-1):  # undefined where b's resampled mean is 0
        mb = b.mean(axis=axis)
        return np.where(mb == 0, np.nan, a.mean(axis=axis) / np.where(mb == 0, 1.0, mb))

    a, b = np.array([1.0, 2.0, 3.0]), np.array([0.0, 0.0, 2.0])  # 8/27 of resamples draw no 2.0
    lo, hi = percentile_bootstrap([a, b], ratio, n_boot=2000)
    assert 1.5 - 1e-9 <= lo <= hi <= 3.5 + 1e-9  # the defined ratios lie in [1.5, 3.5]
    assert all(math.isnan(v) for v in percentile_bootstrap([a, np.zeros(3)], ratio))
    with pytest.raises(ValueError, match="n_boot"):
        percentile_bootstrap([a], lambda x, axis=-1: x.mean(axis=axis), n_boot=0)


# --------------------------------------------------------------------------- dataset loader


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _record(i, passages=None):
    return {
        "id": f"q{i}",
        "question": f"Question {i}?",
        "answers": [f"answer {i}", f"alias {i}"],
        "passages": passages if passages is not None else [{"title": f"T{i}", "text": f"text of passage {i}"}],
        "supporting_titles": [f"T{i}"],
    }


def test_load_questions_from_temp_file(tmp_path):
    shared = {"title": "Shared", "text": "a passage two questions retrieved"}
    records = [_record(i, [shared, {"title": f"T{i}", "text": f"own {i}"}]) for i in range(5)]
    path = _write_jsonl(tmp_path / "hotpotqa_dev.jsonl", records)
    examples = load_questions(path)
    assert len(examples) == 5
    ex = examples[0]
    assert isinstance(ex, QAExample)
    assert ex.id == "q0" and ex.question == "Question 0?" and ex.answers == ["answer 0", "alias 0"]
    assert ex.passages == [Passage("Shared", shared["text"]), Passage("T0", "own 0")]
    assert ex.dataset == "hotpotqa"
    assert ex.supporting_titles == ["T0"]
    kb = knowledge_base(examples)
    assert kb[0] == Passage("Shared", shared["text"])
    assert kb[1:] == [Passage(f"T{i}", f"own {i}") for i in range(5)]


def test_load_questions_limit_and_seeded_shuffle(tmp_path):
    path = _write_jsonl(tmp_path / "musique.jsonl", [_record(i) for i in range(20)])
    assert [e.id for e in load_questions(path, limit=3)] == ["q0", "q1", "q2"]
    assert load_questions(path, limit=0) == []
    a = [e.id for e in load_questions(path, limit=5, shuffle=True, seed=7)]
    b = [e.id for e in load_questions(path, limit=5, shuffle=True, seed=7)]
    c = [e.id for e in load_questions(path, limit=5, shuffle=True, seed=8)]
    assert a == b
    assert a != c
    assert a != ["q0", "q1", "q2", "q3", "q4"]
    # The limit is a prefix of the same shuffled order.
    assert [e.id for e in load_questions(path, limit=10, shuffle=True, seed=7)][:5] == a


def test_load_questions_truncates_passages(tmp_path):
    long = {"title": "Long", "text": "one two three four five six"}
    path = _write_jsonl(tmp_path / "x.jsonl", [_record(0, [long])])
    ex = load_questions(path, max_passage_words=3)[0]
    assert ex.passages[0].text == "one two three"
    assert ex.dataset == "x"
    assert load_questions(path, dataset="custom")[0].dataset == "custom"


def test_load_questions_errors(tmp_path):
    with pytest.raises(FusionRAGError, match="not found"):
        load_questions(tmp_path / "missing.jsonl")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(_record(0)) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(FusionRAGError, match=r"bad\.jsonl:3: not valid JSON"):
        load_questions(bad_json)
    cases = {
        "missing field": ({"id": "x", "question": "q?"}, "missing field"),
        "no answers": ({**_record(0), "answers": []}, "'answers' is empty"),
        "answers not list": ({**_record(0), "answers": "Warsaw"}, "'answers' must be a list"),
        "bad passage": ({**_record(0), "passages": [{"title": "t"}]}, "passage 0"),
        "not object": ([1, 2], "expected a JSON object"),
    }
    for name, (record, message) in cases.items():
        path = _write_jsonl(tmp_path / f"{name.replace(' ', '_')}.jsonl", [_record(9), record])
        with pytest.raises(FusionRAGError, match=rf":2: .*{message}"):
            load_questions(path)
    dup = _write_jsonl(tmp_path / "dup.jsonl", [_record(1), _record(1)])
    with pytest.raises(FusionRAGError, match="duplicate id 'q1'"):
        load_questions(dup)
    with pytest.raises(FusionRAGError, match="limit"):
        load_questions(dup, limit=-1)


def test_truncate_passage_words():
    assert truncate_passage_words("a  b\nc", None) == "a  b\nc"
    assert truncate_passage_words("a  b\nc", 3) == "a  b\nc"  # untouched when short enough
    assert truncate_passage_words("a  b\nc d", 2) == "a b"
    assert truncate_passage_words("a b", 0) == ""
    with pytest.raises(ValueError):
        truncate_passage_words("a", -1)


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/d/triviaqa/triviaqa_dev_searchr1_e5_wiki18.jsonl", "triviaqa"),
        ("/d/hotpotqa/hotpotqa_dev_fullwiki_amor.jsonl", "hotpotqa"),
        ("/d/musique/musique_longbench_chunks_cacheblend.jsonl", "musique"),
        ("/d/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl", "2wikimqa"),
        ("/d/musique/renamed.jsonl", "musique"),
        ("/d/other/sample.jsonl", "sample"),
    ],
)
def test_infer_dataset_name(path, name):
    assert infer_dataset_name(path) == name


def test_load_real_shared_file():
    path = shared_data_file("musique/musique_dev_paragraphs_kag.jsonl")
    examples = load_questions(path)
    assert len(examples) == 68  # as documented in the data README
    assert all(e.dataset == "musique" for e in examples)
    assert all(len(e.passages) == 20 and e.answers for e in examples)
    first = load_questions(path, limit=4, shuffle=True, seed=0)
    assert len(first) == 4 and {e.id for e in first} <= {e.id for e in examples}
    kb = knowledge_base(examples)
    assert len(kb) == len(set(kb)) <= sum(len(e.passages) for e in examples)
