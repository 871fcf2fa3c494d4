"""The device and pinned host tiers: same entries, budgets, invalidation, on the CPU and CUDA.

On the CPU the placements are plain copies (no pinned memory, no side stream), so these tests
check the stacking, budgets, heat and invalidation every device shares; the test marked ``gpu``
checks, on a GPU host, that entries land on the device from page-locked host memory.
"""

from __future__ import annotations

import pytest
import torch

from fusionrag.kvcache.device_tier import DevicePlacement, kv_tiers, map_entry, pin_entry
from fusionrag.kvcache.sources import DiskSource, KVSource, MemoryTier
from fusionrag.kvcache.store import KVStore
from kv_helpers import disk_source, random_kv

TOKENS = {0: [1, 2, 3], 1: [4, 5], 2: [6, 7, 8, 9]}



def _disk(tmp_path) -> DiskSource:
    return disk_source(tmp_path, TOKENS)


KEYS = [(c, "fused") for c in TOKENS]


def test_tiers_stack_and_serve_the_disk_entries_unchanged(tmp_path):
    disk = _disk(tmp_path)
    tiers = kv_tiers(disk, "cpu", host_bytes=1 << 20, device_bytes=1 << 20)
    assert isinstance(tiers, KVSource)
    try:
        ref = disk.get_many(KEYS)
        for _ in range(2):
            got = tiers.get_many(KEYS)
            for a, b in zip(got, ref, strict=True):
                assert torch.equal(a.kv.keys, b.kv.keys) and torch.equal(a.kv.values, b.kv.values)
                assert torch.equal(a.scores, b.scores) and a.kv.base_position == b.kv.base_position
        stats = tiers.stats()
        assert set(stats) == {"device", "host"}
        device = stats["device"]
        assert device.loads == 3 and device.gets == 6 and device.disk_hits == 0  # each entry copied up once
        assert device.memory_hits >= 3  # at least the second round from the device (the first may race its prefetch)
        assert stats["host"].loads == 3  # each entry read from the disk once
    finally:
        tiers.close()
        tiers.lower.close()


def test_no_budget_leaves_a_tier_out(tmp_path):
    disk = _disk(tmp_path)
    assert kv_tiers(disk, "cpu") is disk
    only_device = kv_tiers(disk, "cpu", device_bytes=1 << 20)
    assert isinstance(only_device, MemoryTier) and only_device.name == "device"
    below = only_device.lower  # the store's files, read as stored (int8 stays int8 below the device tier)
    assert isinstance(below, DiskSource) and below.kv_store is disk.kv_store and not below.dequantize
    assert disk.dequantize


def test_device_budget_keeps_what_fits_and_the_hotter_entry(tmp_path):
    disk = _disk(tmp_path)
    one = disk.get_many([(2, "fused")])[0].nbytes  # the biggest entry
    tiers = kv_tiers(disk, "cpu", device_bytes=one, half_life=None)
    try:
        for _ in range(3):
            tiers.get_many([(2, "fused")])
        tiers.get_many([(0, "fused")])  # colder than the resident: not admitted
        stats = tiers.stats()["device"]
        assert stats.memory_bytes <= one and stats.memory_items == 1
        assert tiers.cache.resident_keys() == [(2, "fused")]
        assert stats.rejections >= 1
    finally:
        tiers.close()


def test_invalidation_reaches_every_tier(tmp_path):
    disk = _disk(tmp_path)
    tiers = kv_tiers(disk, "cpu", host_bytes=1 << 20, device_bytes=1 << 20)
    try:
        tiers.get_many(KEYS)
        new = random_kv(3, 99)
        disk.kv_store.save(0, "fused", new, TOKENS[0])
        assert not torch.equal(tiers.get_many([(0, "fused")])[0].kv.keys, new.keys)  # both tiers still hold the old
        tiers.invalidate([(0, "fused")])
        assert torch.equal(tiers.get_many([(0, "fused")])[0].kv.keys, new.keys)
    finally:
        tiers.close()
        tiers.lower.close()


def test_prefetch_fills_the_device_tier_in_the_background(tmp_path):
    disk = _disk(tmp_path)
    tiers = kv_tiers(disk, "cpu", device_bytes=1 << 20)
    try:
        tiers.prefetch(KEYS)
        tiers.cache.close()  # waits for the loads in flight
        stats = tiers.stats()["device"]
        assert stats.prefetches == 3 and stats.memory_items == 3
    finally:
        tiers.close()


def test_map_entry_and_placements_on_the_cpu_keep_the_entry(tmp_path):
    entry = _disk(tmp_path).get_many([(1, "fused")])[0]
    doubled = map_entry(entry, lambda t: t * 2)
    assert torch.equal(doubled.kv.keys, entry.kv.keys * 2) and torch.equal(doubled.scores, entry.scores * 2)
    assert doubled.metadata == entry.metadata and doubled.kv.base_position == entry.kv.base_position
    if not torch.cuda.is_available():
        assert pin_entry(entry) is entry
    placed = DevicePlacement("cpu")(entry)
    assert torch.equal(placed.kv.values, entry.kv.values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the device tier's copies need a GPU")
def test_on_cuda_entries_come_from_pinned_memory_to_the_device(tmp_path):
    disk = _disk(tmp_path)
    tiers = kv_tiers(disk, "cuda", host_bytes=1 << 20, device_bytes=1 << 20)
    try:
        host = tiers.lower.get_many(KEYS)
        assert all(e.kv.keys.is_pinned() and e.scores.is_pinned() for e in host)
        got = tiers.get_many(KEYS)
        assert all(e.kv.keys.device.type == "cuda" for e in got)
        for a, b in zip(got, disk.get_many(KEYS), strict=True):
            assert torch.equal(a.kv.keys.cpu(), b.kv.keys) and torch.equal(a.scores.cpu(), b.scores)
        int8 = kv_tiers(_int8_disk(tmp_path / "int8"), "cuda", host_bytes=1 << 20, device_bytes=1 << 20)
        try:  # codes cross to the GPU and are dequantised there, to the CPU's very values
            for a, b in zip(int8.get_many(KEYS), _int8_disk(tmp_path / "int8").get_many(KEYS), strict=True):
                assert a.kv.keys.device.type == "cuda" and torch.equal(a.kv.keys.cpu(), b.kv.keys)
        finally:
            int8.close()
            int8.lower.close()
    finally:
        tiers.close()
        tiers.lower.close()


def _int8_disk(tmp_path) -> DiskSource:
    store = KVStore(tmp_path, "fp", "sys", "int8")
    for cid, ids in TOKENS.items():
        store.save(cid, "fused", random_kv(len(ids), cid), ids, scores=torch.arange(len(ids), dtype=torch.float32))
    return DiskSource(store, TOKENS.__getitem__)


def test_int8_entries_stay_int8_below_the_device_tier_and_are_dequantised_there(tmp_path):
    disk = _int8_disk(tmp_path)
    tiers = kv_tiers(disk, "cpu", host_bytes=1 << 20, device_bytes=1 << 20)
    try:
        host = tiers.lower.get_many(KEYS)  # what the host tier holds: codes and scales
        assert all(e.kv.keys.dtype == torch.int8 and e.scales is not None for e in host)
        ref = disk.get_many(KEYS)  # the store's own dequantisation
        assert all(h.nbytes < r.nbytes for h, r in zip(host, ref, strict=True))
        got = tiers.get_many(KEYS)
        for a, b in zip(got, ref, strict=True):
            assert a.scales is None and a.kv.keys.dtype == torch.float16
            assert torch.equal(a.kv.keys, b.kv.keys) and torch.equal(a.kv.values, b.kv.values)
            assert torch.equal(a.scores, b.scores)
        assert disk.dequantize  # the caller's source is left as it was
    finally:
        tiers.close()
        tiers.lower.close()


def test_a_raw_int8_entry_read_from_the_store_dequantises_to_the_stores_values(tmp_path):
    disk = _int8_disk(tmp_path)
    raw = disk.kv_store.load(1, "fused", token_ids=TOKENS[1], dequantize=False)
    assert raw.kv.keys.dtype == torch.int8 and raw.scales[0].dtype == torch.float16
    plain = disk.kv_store.load(1, "fused", token_ids=TOKENS[1])
    assert plain.scales is None and plain.dequantized() is plain
    assert torch.equal(raw.dequantized().kv.keys, plain.kv.keys)
