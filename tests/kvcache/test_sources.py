"""KV sources: every tier answers with verified entries and forgets what it is told is stale."""

from __future__ import annotations

import torch

from fusionrag.kvcache.sources import ColdDiskSource, DiskSource, KVSource, MemoryTier, PreloadedSource
from kv_helpers import disk_source, random_kv

TOKENS = {0: [1, 2, 3], 1: [4, 5]}



def _disk(tmp_path) -> DiskSource:
    return disk_source(tmp_path, TOKENS)


def test_every_source_implements_the_interface(tmp_path):
    disk = _disk(tmp_path)
    for source in (disk, ColdDiskSource(disk.kv_store, TOKENS.__getitem__), PreloadedSource({}),
                   MemoryTier(disk, 1 << 20)):
        assert isinstance(source, KVSource)


def test_entries_carry_scores_and_are_identical_through_every_tier(tmp_path):
    disk = _disk(tmp_path)
    keys = [(0, "fused"), (1, "fused")]
    ref = disk.get_many(keys)
    assert torch.equal(ref[0].scores, torch.arange(3, dtype=torch.float32))
    tier = MemoryTier(disk, 1 << 20)
    try:
        for source in (ColdDiskSource(disk.kv_store, TOKENS.__getitem__), PreloadedSource.of(disk, keys), tier):
            got = source.get_many(keys)
            assert all(torch.equal(a.kv.keys, b.kv.keys) and torch.equal(a.scores, b.scores)
                       for a, b in zip(got, ref, strict=True))
    finally:
        tier.close()


def test_memory_tier_invalidation_rereads_the_changed_entry(tmp_path):
    disk = _disk(tmp_path)
    tier = MemoryTier(disk, 1 << 20)
    try:
        old = tier.get_many([(0, "fused")])[0]
        disk.kv_store.save(0, "fused", random_kv(3, 99), TOKENS[0])  # the store rewrote the entry
        assert torch.equal(tier.get_many([(0, "fused")])[0].kv.keys, old.kv.keys)  # stale until told
        tier.invalidate([(0, "fused")])
        fresh = tier.get_many([(0, "fused")])[0]
        assert torch.equal(fresh.kv.keys, random_kv(3, 99).keys) and tier.stats()["host"].memory_items == 1
    finally:
        tier.close()


def test_an_invalidated_load_in_flight_is_not_kept(tmp_path):
    from fusionrag.kvcache.tiers import TieredKVCache

    started, release = __import__("threading").Event(), __import__("threading").Event()

    def slow_load(key):
        started.set()
        release.wait(10)
        return random_kv(3, 1)

    cache = TieredKVCache(slow_load, 1 << 20)
    try:
        fut = cache.prefetch([(0, "fused")])[0]
        assert started.wait(10)
        cache.invalidate([(0, "fused")])
        release.set()
        fut.result(10)
        assert not cache.contains((0, "fused")) and cache.stats().staged_items == 0
    finally:
        cache.close()
