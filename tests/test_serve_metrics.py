"""``/metrics`` rendering from the engine's statistics, without a model (duck-typed engine and scheduler)."""

from __future__ import annotations

from types import SimpleNamespace

from fusionrag.kvcache.prefix_cache import AlternativePathCache
from fusionrag.kvcache.tiers import TierStats
from fusionrag.serve.metrics import Metrics
from fusionrag.serve.requests import SchedulerStats


def test_metrics_include_kv_tiers_when_the_engine_has_them():
    prefix_cache = AlternativePathCache()
    prefix_cache.lookup("S", ["a", "b"], lambda *_: SimpleNamespace(nbytes=10))
    prefix_cache.lookup("S", ["b", "a"], lambda *_: SimpleNamespace(nbytes=10))
    engine = SimpleNamespace(stats=lambda: {
        "tiers": {"host": TierStats(memory_hits=3, disk_hits=1, memory_bytes=4096)},
        "prefix_cache": prefix_cache.stats(), "adhoc_entries": 1})
    sched = SimpleNamespace(queue_length=2, active=1, stats=SchedulerStats(), engine=engine)
    text = Metrics().render(sched, {"ready": 1})
    assert 'fusionrag_kv_tier_hits_total{tier="host",source="memory"} 3' in text
    assert 'fusionrag_kv_tier_hits_total{tier="host",source="disk"} 1' in text
    assert 'fusionrag_kv_tier_bytes{tier="host"} 4096' in text
    assert "fusionrag_queue_length 2" in text and "fusionrag_adhoc_kv_entries 1" in text
    assert 'fusionrag_document_jobs{status="ready"} 1' in text
    assert 'fusionrag_prefix_cache_lookups_total{result="computed"} 2' in text
    assert 'fusionrag_prefix_cache_lookups_total{result="alt_path_hit"} 1' in text  # "a" after "b"
    assert 'fusionrag_prefix_cache_lookups_total{result="prefix_hit"} 1' in text  # "b" first
