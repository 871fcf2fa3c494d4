"""The connector's scheduler side without vLLM: stored chunks found in a prompt's token ids."""

from __future__ import annotations

from fusionrag.vllm.matching import KEY_TOKENS, ChunkMatcher

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
