"""The whole-context cache as a data structure: keys, LRU by bytes, invalidation by chunk."""

from __future__ import annotations

from dataclasses import dataclass

from fusionrag.kvcache.context_cache import ContextCache, context_key


@dataclass
class Blob:
    nbytes: int


def test_keys_tell_contexts_and_ways_of_computing_them_apart():
    assert context_key([1, 2, 3], "full") == context_key([1, 2, 3], "full")
    assert context_key([1, 2, 3], "full") != context_key([1, 2, 3], "fusionrag|0.15")
    assert context_key([1, 2, 3], "full") != context_key([3, 2, 1], "full")
    assert context_key([1, 2], "full") != context_key([1, 2, 0], "full")
    assert context_key([70000], "x") != context_key([70000 % 65536], "x")  # ids beyond 16 bits kept


def test_the_first_key_held_is_returned_and_counted():
    cache = ContextCache(100)
    a, b = context_key([1], "a"), context_key([1], "b")
    cache.put(b, Blob(10))
    assert cache.get([a, b]).nbytes == 10 and cache.get([a]) is None
    st = cache.stats()
    assert (st.lookups, st.hits, st.entries, st.bytes_stored) == (2, 1, 1, 10)


def test_least_recently_used_goes_first_and_an_oversized_value_is_not_kept():
    cache = ContextCache(30)
    k = [context_key([i], "x") for i in range(4)]
    for key in k[:3]:
        cache.put(key, Blob(10))
    cache.get([k[0]])  # k[1] is now the least recently used
    cache.put(k[3], Blob(10))
    assert cache.get([k[1]]) is None and cache.get([k[0]]) is not None and cache.get([k[3]]) is not None
    assert cache.stats().evictions == 1 and cache.nbytes == 30
    assert not cache.put(context_key([9], "x"), Blob(31)) and len(cache) == 3
    assert not ContextCache(0).put(k[0], Blob(1))  # 0 bytes: off


def test_changed_chunks_drop_the_contexts_built_on_them():
    cache = ContextCache(100)
    cache.put(b"a", Blob(1), [1, 2])
    cache.put(b"b", Blob(1), [2, 3])
    cache.put(b"c", Blob(1), [None, 4])  # a passage the store does not hold has no chunk id
    assert cache.invalidate([3]) == 1 and cache.get([b"b"]) is None and cache.get([b"a"]) is not None
    assert cache.invalidate(None) == 2 and len(cache) == 0 and cache.nbytes == 0
