"""Parts of stored chunks found in a client's text (:mod:`fusionrag.retrieval.overlaps`)."""

from __future__ import annotations

import pytest

from fusionrag.models import load_model
from fusionrag.prompt import chunk_text
from fusionrag.retrieval.overlaps import (
    MIN_PART_CHARS,
    find_regions,
    normalise,
    positions,
    token_span,
)

A = ("The old town of Velmora sits on both banks of the river Ostra, which floods every spring. "
     "Its cathedral was finished in 1412 after ninety years of building and two fires.")
B = ("The market square holds a clock tower whose bells were cast from melted cannons. "
     "Velmora's university, founded in 1520, is known for its early school of cartography.")


def test_a_whole_chunk_and_parts_of_another_are_found_where_they_occur():
    text = normalise(f"Context:\n{A}\n---\n{B[10:120]}\n\n{B[60:]}\nQuestion?")
    regions = find_regions(text, [(1, A), (2, B)], min_whole=24)
    assert [(r.chunk_id, r.whole) for r in regions] == [(1, True), (2, False), (2, False)]
    for r in regions:
        body = A if r.chunk_id == 1 else B
        assert text[r.start:r.end] == body[r.at:r.at + len(r)]
    assert regions[1].at == 10 and len(regions[1]) == 110  # the overlap both parts hold is found in each
    assert regions[2].at == 60 and regions[2].at + len(regions[2]) == len(B)


def test_a_passage_running_across_two_chunks_is_two_parts():
    text = normalise(A[50:] + " " + B[:90])
    regions = find_regions(text, [(1, A), (2, B)], min_whole=24)
    assert [(r.chunk_id, r.at, len(r)) for r in regions] == [(1, 50, len(A) - 50), (2, 0, 90)]


def test_few_shared_words_are_not_a_part():
    text = normalise("An unrelated note: rivers which floods every spring; in other words.")
    assert len(" which floods every spring") < MIN_PART_CHARS
    assert find_regions(text, [(1, A)], min_whole=24) == []


def test_overlapping_candidates_keep_the_longest_and_the_rest_of_a_shorter_one():
    text = normalise(A)
    regions = find_regions(text, [(1, A), (2, A[:100] + " and something else entirely, not in the text")],
                           min_whole=24)
    assert [(r.chunk_id, r.whole) for r in regions] == [(1, True)]


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("qwen2.5-0.5b", marks=pytest.mark.slow)])
def test_a_part_is_the_chunks_whole_tokens_inside_it(model):
    """Character-level (tiny-llama) and byte-level BPE tokens (Qwen: ``" word"``, ``".\n\n"``)."""
    tok = load_model(model).tokenizer
    title, body = "Velmora", A.replace(" which", "  which\n")  # stored whitespace need not be the client's
    prompt_text = chunk_text(title, body)
    ids = tok.encode(prompt_text, add_special_tokens=False)
    where = positions(prompt_text, len(prompt_text) - len(body.strip()) - 2, body.strip())
    assert where is not None and where.body == normalise(body)
    at = where.body.index("sits on")
    end = where.body.index("ninety") + 3  # ends inside a word: that word is left to the text around it
    first, stop, a, b = token_span(tok, prompt_text, ids, where, at, end)
    region = where.body[at:end]
    served = normalise(tok.decode(ids[first:stop]))
    assert served == where.body[a:b].strip() and served.startswith("sits on") and served in region
    assert at <= a and b <= end
    assert normalise(tok.decode(ids[first:stop + 1])) not in region  # every whole token inside, no more
    before = tok.decode(ids[first - 1:first])
    assert not before.strip() or normalise(tok.decode(ids[first - 1:stop])) not in region  # a space needs no KV
    if model != "tiny-llama":  # word tokens: the cut word is not served (tiny-llama's tokens are characters)
        assert served.endswith("after")


def test_a_chunk_nfc_would_change_is_only_served_whole():
    assert positions("e\u0301te\n\n", 0, "e\u0301te") is None
