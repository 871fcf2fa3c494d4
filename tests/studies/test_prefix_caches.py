"""Prefix caches: the package's alternative path and the study's plain (radix) baseline against brute-force
references; the study's observer (repeats, the plain-prefix shadow) on both."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from studies.prefix_cache.caches import ObservedAlternativePathCache, RadixPrefixCache

from fusionrag.files import content_hash
from fusionrag.kvcache.prefix_cache import AlternativePathCache, path_key

S = "sys"


@dataclass(frozen=True)
class Blob:
    nbytes: int
    tag: str = ""


def size(chunk: str) -> int:
    return 10 + len(chunk)


class Recorder:
    """A compute callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...], str]] = []

    def __call__(self, system: str, context: tuple[str, ...], chunk: str) -> Blob:
        self.calls.append((system, context, chunk))
        return Blob(size(chunk), f"{system}|{','.join(context)}|{chunk}")


# -- brute-force references: plain tuples and sets, no hashing, no trie -------------------------


def ref_alt(requests, preload=()):
    """Expected source per chunk for the alternative path, from its definition.

    Stored contexts are explicit tuples ``(S, c_0, ..., c_j)``. A chunk is a prefix hit if
    it is stored under its full request prefix and every chunk before it was a prefix hit;
    otherwise a hit if any contiguous run ending at it (``c_i..c_j``) is stored; otherwise
    it is computed and stored as ``(S, c_j)``. Also counts redundant recomputes: a computed
    chunk whose content is the last element of some stored tuple.
    """
    stored = {(s, *p) for s, p in preload}
    out, redundant = [], 0
    for system, chunks in requests:
        srcs: list[str] = []
        for j, c in enumerate(chunks):
            if all(x == "prefix" for x in srcs) and (system, *chunks[: j + 1]) in stored:
                srcs.append("prefix")
            elif any((system, *chunks[i : j + 1]) in stored for i in range(j + 1)):
                srcs.append("alt")
            else:
                redundant += any(t[0] == system and t[-1] == c for t in stored)
                srcs.append("computed")
                stored.add((system, c))
        out.append(srcs)
    return out, stored, redundant


def ref_plain(requests, preload=()):
    """Expected sources for a plain prefix cache: chunk j hits iff ``S + c_0..c_j`` is a prefix of
    an earlier request (or a preload) - i.e. the longest common prefix with anything seen."""
    seen_paths = [(s, tuple(p)) for s, p in preload]
    out, redundant = [], 0
    contents = {(s, p[-1]) for s, p in preload}
    for system, chunks in requests:
        chunks = tuple(chunks)
        lcp = 0
        for s, p in seen_paths:
            if s != system:
                continue
            n = 0
            while n < min(len(p), len(chunks)) and p[n] == chunks[n]:
                n += 1
            lcp = max(lcp, n)
        srcs = ["prefix"] * lcp + ["computed"] * (len(chunks) - lcp)
        for c in chunks[lcp:]:
            redundant += (system, c) in contents
            contents.add((system, c))
        out.append(srcs)
        seen_paths.append((system, chunks))
    return out, redundant


def run(cache, requests):
    rec = Recorder()
    return [cache.lookup(s, cs, rec).sources for s, cs in requests], rec


requests_st = st.lists(
    st.tuples(
        st.sampled_from(["s1", "s1", "s1", "s2"]),
        st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=5, unique=True),
    ),
    min_size=1,
    max_size=12,
)


# -- alternative path ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(requests=requests_st, kb=st.lists(st.sampled_from("abcd"), unique=True, max_size=4))
def test_alt_path_matches_reference(requests, kb):
    preload = [("s1", (c,)) for c in kb]
    cache = AlternativePathCache()
    for s, p in preload:
        cache.insert(s, p, Blob(size(p[-1])))
    got, rec = run(cache, requests)
    want, stored, redundant = ref_alt(requests, preload)
    assert got == want
    st_ = cache.stats()
    distinct = {(s, c) for s, cs in requests for c in cs} | {(s, p[-1]) for s, p in preload}
    # one replica per distinct (S, chunk), whatever the orders
    assert st_.entries == len(stored) == len(distinct)
    assert st_.recomputations == len(rec.calls) == sum(x.count("computed") for x in want)
    assert st_.redundant_recomputations == redundant == 0
    assert st_.prefix_hits == sum(x.count("prefix") for x in want)
    assert st_.alt_hits == sum(x.count("alt") for x in want)
    assert st_.lookups == sum(len(cs) for _, cs in requests)
    assert st_.bytes_stored == sum(size(c) for _, c in distinct)
    assert all(ctx == () for _, ctx, _ in rec.calls)  # computed in context S only


@settings(max_examples=60, deadline=None)
@given(
    requests=requests_st,
    deep=st.lists(
        st.tuples(st.sampled_from(["s1", "s2"]), st.lists(st.sampled_from("abcdef"), min_size=1, max_size=3)),
        max_size=8,
    ),
)
def test_alt_path_with_deeper_entries_matches_reference(requests, deep):
    """Entries under longer contexts (e.g. from a full prefill) are found by backing off."""
    preload = [(s, tuple(p)) for s, p in deep]
    cache = AlternativePathCache()
    for s, p in preload:
        cache.insert(s, p, Blob(size(p[-1])))
    got, _ = run(cache, requests)
    want, stored, redundant = ref_alt(requests, preload)
    assert got == want
    assert cache.stats().entries == len(stored)
    assert cache.stats().redundant_recomputations == redundant


@settings(max_examples=60, deadline=None)
@given(requests=requests_st, kb=st.lists(st.sampled_from("abcd"), unique=True, max_size=4))
def test_plain_prefix_matches_reference(requests, kb):
    preload = [("s1", (c,)) for c in kb]
    cache = RadixPrefixCache()
    for s, p in preload:
        cache.insert(s, p, Blob(size(p[-1])))
    got, rec = run(cache, requests)
    want, redundant = ref_plain(requests, preload)
    assert got == want
    stats = cache.stats()
    assert stats.alt_hits == 0
    assert stats.redundant_recomputations == stats.repeat_recomputations == redundant
    assert [(s, ctx) for s, ctx, _ in rec.calls] == [
        (s, tuple(cs[:j]))
        for (s, cs), srcs in zip(requests, want, strict=True)
        for j, x in enumerate(srcs)
        if x == "computed"
    ]
    # the alternative path's shadow of a plain cache equals the real plain cache
    alt = ObservedAlternativePathCache()
    for s, p in preload:
        alt.insert(s, p, Blob(size(p[-1])))
    run(alt, requests)
    assert alt.stats().plain_prefix_bytes == stats.bytes_stored == stats.plain_prefix_bytes
    assert alt.stats().bytes_saved == stats.bytes_stored - alt.stats().bytes_stored >= 0


def test_order_change_and_partial_overlap():
    alt, plain = AlternativePathCache(), RadixPrefixCache()
    for cache in (alt, plain):
        run(cache, [(S, ["a", "b", "c"])])
    assert alt.lookup(S, ["c", "a", "b"], Recorder()).sources == ["prefix", "alt", "alt"]
    assert plain.lookup(S, ["c", "a", "b"], Recorder()).sources == ["computed"] * 3
    assert alt.lookup(S, ["a", "b", "d"], Recorder()).sources == ["prefix", "alt", "computed"]
    assert plain.lookup(S, ["a", "b", "d"], Recorder()).sources == ["prefix", "prefix", "computed"]
    assert len(alt) == 4  # a b c d, one replica each
    assert len(plain) == 7  # a b c | c a b | d under a-b
    assert plain.stats().redundant_recomputations == 3
    assert alt.stats().redundant_recomputations == 0
    assert alt.stats().hit_rate == 5 / 9


def test_unique_chunks_are_computed_once_each():
    alt = AlternativePathCache()
    srcs, rec = run(alt, [(S, ["u1", "k"]), (S, ["k", "u2"]), (S, ["u3", "k"])])
    assert srcs == [["computed", "computed"], ["prefix", "computed"], ["computed", "alt"]]
    assert [c for _, _, c in rec.calls] == ["u1", "k", "u2", "u3"]


def test_system_prompt_is_part_of_the_key():
    alt = AlternativePathCache()
    run(alt, [("s1", ["a"])])
    assert alt.peek("s2", ["a"]) == [None]
    assert path_key("s1", ["a"]) != path_key("s2", ["a"])
    assert path_key(S, ["ab"]) != path_key(S, ["a", "b"])
    assert path_key(S, ["a", "b"]) != path_key(S, ["b", "a"])
    assert content_hash("x") == content_hash(b"x") != content_hash("y")


def test_deeper_entries_back_off_one_chunk_at_a_time():
    alt = AlternativePathCache()
    alt.insert(S, ["a"], Blob(1, "a"))
    alt.insert(S, ["a", "b"], Blob(1, "b|a"))
    alt.insert(S, ["b"], Blob(1, "b"))
    assert alt.lookup(S, ["a", "b"], Recorder()).sources == ["prefix", "prefix"]
    res = alt.lookup(S, ["x", "a", "b"], Recorder())
    assert res.sources == ["computed", "alt", "alt"]
    # b is served from (S, a, b): the longest context that matches, not the bare (S, b)
    assert res.chunks[2].value.tag == "b|a" and res.chunks[2].context == ("a",)
    assert res.chunks[1].context == ()


def test_a_full_prefix_entry_after_the_run_broke_is_an_alt_hit():
    alt = AlternativePathCache()
    alt.insert(S, ["a"], Blob(1))
    alt.insert(S, ["a", "y", "b"], Blob(1, "b|a,y"))
    res = alt.lookup(S, ["a", "y", "b"], Recorder())
    assert res.sources == ["prefix", "computed", "alt"]
    assert res.chunks[2].context == ("a", "y")


def test_redundant_when_a_replica_exists_only_under_another_context():
    alt = AlternativePathCache()
    alt.insert(S, ["x"], Blob(1))
    alt.insert(S, ["x", "c"], Blob(1))
    assert alt.lookup(S, ["c"], Recorder()).sources == ["computed"]
    assert alt.stats().redundant_recomputations == 1


def test_peek_has_no_side_effects_and_agrees_with_lookup():
    for cache in (AlternativePathCache(), RadixPrefixCache()):
        run(cache, [(S, ["a", "b"])])
        before = cache.stats()
        req = ["b", "a", "c", "c"] if isinstance(cache, AlternativePathCache) else ["a", "b", "c"]
        peeked = cache.peek(S, req)
        assert cache.stats() == before
        got = cache.lookup(S, req, Recorder()).sources
        assert [p or "computed" for p in peeked] == got


def test_repeated_chunk_within_a_request():
    alt, plain = AlternativePathCache(), RadixPrefixCache()
    assert run(alt, [(S, ["a", "a"])])[0] == [["computed", "alt"]]
    assert run(plain, [(S, ["a", "a"])])[0] == [["computed", "computed"]]
    assert plain.stats().redundant_recomputations == 1


def test_alt_lru_eviction_by_bytes():
    alt = ObservedAlternativePathCache(max_bytes=30)
    run(alt, [(S, ["a"]), (S, ["b"])])  # 11 bytes each
    run(alt, [(S, ["a"])])  # a is now most recent
    run(alt, [(S, ["c"])])  # needs room: evicts b
    assert alt.peek(S, ["a", "b", "c"]) == ["prefix", None, "alt"]
    s = alt.stats()
    assert (s.evictions, s.entries, s.bytes_stored) == (1, 2, 22)
    run(alt, [(S, ["b"])])
    assert alt.stats().repeat_recomputations == 1  # b had been computed before (then evicted)
    assert alt.stats().redundant_recomputations == 0  # but no replica was cached


def test_oversize_values_are_returned_but_not_stored():
    for cache in (AlternativePathCache(max_bytes=5), RadixPrefixCache(max_bytes=5)):
        res = cache.lookup(S, ["abc"], Recorder())
        assert res.sources == ["computed"] and res.values[0].nbytes == 13
        assert len(cache) == 0 and cache.nbytes == 0


def test_radix_evicts_lru_leaves_and_protects_the_current_path():
    plain = RadixPrefixCache(max_bytes=22)  # room for two 11-byte chunks
    assert run(plain, [(S, ["a", "b", "c"])])[0] == [["computed"] * 3]
    # a and b were on the request's path, so c could not be kept
    assert plain.peek(S, ["a", "b", "c"]) == ["prefix", "prefix", None]
    assert len(plain) == 2
    run(plain, [(S, ["d"])])  # evicts the LRU leaf b (a is interior until b goes)
    assert plain.peek(S, ["a", "b"]) == ["prefix", None]
    assert plain.peek(S, ["d"]) == ["prefix"]
    assert plain.stats().evictions == 1
    run(plain, [(S, ["e"])])  # leaves a (older) and d: a goes
    assert plain.peek(S, ["a"]) == [None] and plain.peek(S, ["d"]) == ["prefix"]


def test_radix_insert_requires_the_parent_path():
    plain = RadixPrefixCache()
    try:
        plain.insert(S, ["a", "b"], Blob(1))
    except KeyError:
        pass
    else:
        raise AssertionError("expected KeyError")
    plain.insert(S, ["a"], Blob(1))
    plain.insert(S, ["a", "b"], Blob(1))
    assert plain.peek(S, ["a", "b"]) == ["prefix", "prefix"]


def test_concurrent_lookups_keep_one_replica_per_chunk():
    alt = AlternativePathCache()
    chunks = [f"c{i}" for i in range(12)]

    def worker(seed: int) -> None:
        order = chunks[seed:] + chunks[:seed]
        for i in range(0, 12, 3):
            alt.lookup(S, order[i : i + 4], Recorder())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = alt.stats()
    assert s.entries == 12 and s.bytes_stored == sum(size(c) for c in chunks)
    assert s.lookups == s.hits + s.recomputations
