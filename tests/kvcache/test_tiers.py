"""Tiered KV cache: heat-based admission/eviction order (injected clock) and prefetch overlap."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from fusionrag.kvcache.tiers import TieredKVCache


@dataclass(frozen=True, eq=False)
class Blob:
    key: str
    nbytes: int = 10


class Loader:
    """Counts calls per key; optionally blocks until released or sleeps, to create overlaps."""

    def __init__(self, sizes: dict[str, int] | None = None, delay: float = 0.0) -> None:
        self.calls: Counter[str] = Counter()
        self.sizes = sizes or {}
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()
        self.fail: set[str] = set()

    def __call__(self, key: str) -> Blob:
        with self.lock:
            self.calls[key] += 1
        self.gate.wait(5)
        if self.delay:
            time.sleep(self.delay)
        if key in self.fail:
            raise OSError(f"cannot read {key}")
        return Blob(key, self.sizes.get(key, 10))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(max_bytes: int, half_life: float | None = None, **kw) -> tuple[TieredKVCache, Loader, Clock]:
    loader, clock = Loader(kw.pop("sizes", None)), Clock()
    return TieredKVCache(loader, max_bytes, half_life=half_life, clock=clock, **kw), loader, clock


def test_memory_hit_after_load_and_values_are_shared():
    cache, loader, _ = make(100)
    v = cache.get("a")
    assert cache.get("a") is v
    s = cache.stats()
    assert (s.disk_hits, s.memory_hits, s.loads, s.promotions, s.memory_bytes) == (1, 1, 1, 1, 10)
    assert loader.calls["a"] == 1


def test_admission_needs_strictly_more_heat_than_the_coldest():
    cache, loader, _ = make(30)  # three 10-byte items
    for k, n in (("a", 3), ("b", 2), ("c", 1)):
        for _ in range(n):
            cache.get(k)
    cache.get("d")  # heat 1 ties c (heat 1): residents win, d is served but not admitted
    assert sorted(cache.resident_keys()) == ["a", "b", "c"]
    assert cache.stats().rejections == 1
    cache.get("d")  # heat 2 > c's 1: c (the coldest) is evicted
    assert sorted(cache.resident_keys()) == ["a", "b", "d"]
    s = cache.stats()
    assert (s.evictions, s.promotions, s.disk_hits, loader.calls["d"]) == (1, 4, 5, 2)


def test_equal_heat_evicts_least_recently_used_first():
    cache, _, _ = make(20)
    cache.get("a")
    cache.get("b")
    cache.get("c")  # heat 1, ties: rejected
    cache.get("c")  # heat 2 beats a and b (both 1): a, accessed earlier, goes
    assert sorted(cache.resident_keys()) == ["b", "c"]


def test_heat_decays_with_the_clock():
    cache, _, clock = make(20, half_life=1.0)
    for _ in range(4):
        cache.get("a")
    cache.get("b")
    clock.t = 1.0
    cache.get("c")  # c: 1; a: 4 * 0.5 = 2; b: 0.5 -> evict b
    assert sorted(cache.resident_keys()) == ["a", "c"]
    assert cache.heat("a") == pytest.approx(2.0)
    clock.t = 4.0  # a: 4 * 2^-4 = 0.25, c: 1 * 2^-3 = 0.125
    cache.get("d")  # d: 1 > both; only one victim needed: c, the colder
    assert sorted(cache.resident_keys()) == ["a", "d"]


def test_big_item_must_beat_every_victim():
    cache, _, _ = make(30, sizes={"big": 20})
    cache.get("a")
    cache.get("b")
    cache.get("b")
    cache.get("b")
    cache.get("c")
    cache.get("big")
    cache.get("big")  # heat 2: needs two victims (a: 1, c: 1) -> admitted
    assert sorted(cache.resident_keys()) == ["b", "big"]
    cache2, _, _ = make(30, sizes={"big": 20})
    for k, n in (("a", 1), ("b", 3), ("c", 3)):
        for _ in range(n):
            cache2.get(k)
    for _ in range(2):
        cache2.get("big")  # victims would be a (1) and b (3): b is hotter -> rejected
    assert sorted(cache2.resident_keys()) == ["a", "b", "c"]


def test_oversize_item_is_served_never_admitted():
    cache, loader, _ = make(5)
    assert cache.get("a").nbytes == 10
    assert cache.get("a").nbytes == 10
    assert loader.calls["a"] == 2 and cache.stats().memory_items == 0 and cache.stats().rejections == 2


def test_put_offers_a_computed_value():
    cache, loader, _ = make(20)
    v = Blob("new")
    assert cache.put("new", v) is True
    assert cache.get("new") is v and loader.calls["new"] == 0


def test_prefetch_then_get_loads_once_and_counts_in_flight():
    cache, loader, _ = make(100)
    loader.gate.clear()
    (fut,) = cache.prefetch(["a"])
    assert cache.prefetch(["a"]) == []  # already in flight
    got: list[Blob] = []
    t = threading.Thread(target=lambda: got.append(cache.get("a")))
    t.start()
    time.sleep(0.05)
    assert not got  # waiting on the prefetch, not loading again
    loader.gate.set()
    t.join(5)
    assert got[0] is fut.result()
    s = cache.stats()
    assert (loader.calls["a"], s.inflight_hits, s.disk_hits, s.prefetches) == (1, 1, 0, 1)
    assert cache.get("a") is got[0] and cache.stats().memory_hits == 1
    cache.close()


def test_prefetch_into_a_full_tier_is_staged_until_used():
    cache, loader, _ = make(20)
    for k in ("a", "b"):
        cache.get(k)
        cache.get(k)
    cache.prefetch(["c"])[0].result(5)
    time.sleep(0.01)
    assert cache.stats().staged_items == 1 and sorted(cache.resident_keys()) == ["a", "b"]  # no eviction
    v = cache.get("c")  # taken from staging; heat 1 < residents' 2: not admitted
    s = cache.stats()
    assert v.key == "c" and loader.calls["c"] == 1 and s.inflight_hits == 1 and s.staged_items == 0
    assert sorted(cache.resident_keys()) == ["a", "b"]
    cache.close()


def test_concurrent_get_and_prefetch_load_each_key_once():
    loader = Loader(delay=0.01)
    cache: TieredKVCache = TieredKVCache(loader, 10_000, max_workers=3)
    keys = [f"k{i}" for i in range(8)]
    results: dict[str, set[int]] = {k: set() for k in keys}
    gets = Counter[str]()
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(20):
            if rng.random() < 0.4:
                cache.prefetch(rng.sample(keys, 3))
            else:
                k = rng.choice(keys)
                v = cache.get(k)
                with lock:
                    results[k].add(id(v))
                    gets["n"] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    cache.close()
    assert all(n == 1 for n in loader.calls.values())
    assert all(len(ids) <= 1 for ids in results.values())  # every caller got the same object
    s = cache.stats()
    assert s.loads == len(loader.calls) and s.gets == gets["n"]


def test_load_errors_propagate_and_are_retried():
    cache, loader, _ = make(100)
    loader.fail.add("bad")
    with pytest.raises(OSError):
        cache.get("bad")
    with pytest.raises(OSError):
        cache.prefetch(["bad"])[0].result(5)
    with pytest.raises(OSError):  # nothing stale left behind: a fresh load is tried
        cache.get("bad")
    assert loader.calls["bad"] == 3
    loader.fail.clear()
    assert cache.get("bad").key == "bad"
    cache.close()
    with pytest.raises(RuntimeError):
        cache.prefetch(["x"])


def test_get_many_overlaps_loads():
    """Four loads must be in flight at once: each waits at a 4-party barrier, so serial loads would break it."""
    barrier = threading.Barrier(4, timeout=5)

    def load(key: str) -> Blob:
        barrier.wait()  # raises BrokenBarrierError unless all four loads run concurrently
        return Blob(key)

    with TieredKVCache(load, 1000, max_workers=4) as cache:
        vals = cache.get_many(["a", "b", "c", "d"])
    assert [v.key for v in vals] == ["a", "b", "c", "d"]
