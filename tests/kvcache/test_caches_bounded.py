"""The caches a server keeps for its lifetime hold nothing that grows with the stream: after thousands of
distinct requests every container inside each is at most its entries (before: the alternative-path cache
kept every chunk and prefix it had ever seen, for a study's counters, in every server)."""

from __future__ import annotations

import random
from collections.abc import Sized
from dataclasses import dataclass

from fusionrag.kvcache.context_cache import ContextCache, context_key
from fusionrag.kvcache.prefix_cache import AlternativePathCache


@dataclass(frozen=True)
class Blob:
    nbytes: int


def _containers(obj: object) -> dict[str, int]:
    return {name: len(v) for name, v in vars(obj).items() if isinstance(v, Sized) and not isinstance(v, str | bytes)}


def test_the_alternative_path_cache_keeps_nothing_beyond_its_entries():
    rng = random.Random(0)
    cache = AlternativePathCache(max_bytes=50 * 10)  # room for 50 chunks of 10 bytes
    for i in range(3000):
        chunks = [f"c{rng.randrange(100_000)}" for _ in range(rng.randint(1, 6))]
        if i % 7 == 0:
            cache.insert("s", chunks[:1], Blob(10))
        cache.lookup(f"s{i % 3}", chunks, lambda _s, _ctx, _c: Blob(10))
    stats = cache.stats()
    assert stats.recomputations > 10_000 and stats.entries <= 50
    sizes = _containers(cache)
    assert sizes and all(n <= stats.entries for n in sizes.values()), sizes


def test_the_context_cache_keeps_nothing_beyond_its_entries():
    cache = ContextCache(max_bytes=20 * 10)
    for i in range(3000):
        cache.put(context_key([i, i + 1], "full"), Blob(10), chunk_ids=[i, i + 1])
        cache.get([context_key([max(0, i - 5), i + 1], "full")])
    sizes = _containers(cache)
    assert len(cache) <= 20 and all(n <= len(cache) for n in sizes.values()), sizes
