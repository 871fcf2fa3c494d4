"""``/metrics`` rendering from the engine's statistics, without a model (duck-typed engine and scheduler).

The output is read back with ``prometheus_client``'s own parser, as a Prometheus server would.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from fusionrag.kvcache.prefix_cache import AlternativePathCache
from fusionrag.kvcache.tiers import TierStats
from fusionrag.online.scheduled import SchedulerStats
from fusionrag.serve.metrics import Metrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_include_kv_tiers_when_the_engine_has_them():
    prefix_cache = AlternativePathCache()
    prefix_cache.lookup("S", ["a", "b"], lambda *_: SimpleNamespace(nbytes=10))
    prefix_cache.lookup("S", ["b", "a"], lambda *_: SimpleNamespace(nbytes=10))
    engine = SimpleNamespace(stats=lambda: {
        "tiers": {"host": TierStats(memory_hits=3, disk_hits=1, memory_bytes=4096)},
        "prefix_cache": prefix_cache.stats(), "adhoc_entries": 1})
    sched = SimpleNamespace(queue_length=2, active=1, stats=SchedulerStats(), engine=engine)
    got = samples(Metrics(lambda: "m", sched, lambda: {"ready": 1}).render().decode())
    assert got[("fusionrag_kv_tier_hits_total", (("source", "memory"), ("tier", "host")))] == 3
    assert got[("fusionrag_kv_tier_hits_total", (("source", "disk"), ("tier", "host")))] == 1
    assert got[("fusionrag_kv_tier_bytes", (("tier", "host"),))] == 4096
    assert got[("vllm:num_requests_waiting", (("model_name", "m"),))] == 2
    assert got[("vllm:num_requests_running", (("model_name", "m"),))] == 1
    assert got[("fusionrag_adhoc_kv_entries", ())] == 1
    assert got[("fusionrag_document_jobs", (("status", "ready"),))] == 1
    assert got[("fusionrag_prefix_cache_lookups_total", (("result", "computed"),))] == 2
    assert got[("fusionrag_prefix_cache_lookups_total", (("result", "alt_path_hit"),))] == 1  # "a" after "b"
    assert got[("fusionrag_prefix_cache_lookups_total", (("result", "prefix_hit"),))] == 1  # "b" first


def _sched_on(device: str) -> SimpleNamespace:
    import torch

    engine = SimpleNamespace(stats=lambda: {}, lm=SimpleNamespace(device=torch.device(device)))
    return SimpleNamespace(queue_length=0, active=0, stats=SchedulerStats(), engine=engine)


def test_no_gpu_memory_gauges_for_a_model_on_the_cpu():
    got = samples(Metrics(lambda: "m", _sched_on("cpu")).render().decode())
    assert not any(name.startswith("fusionrag_cuda_memory") for name, _ in got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU memory gauges need a GPU")
def test_gpu_memory_gauges_follow_the_allocator():
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB live
    got = samples(Metrics(lambda: "m", _sched_on("cuda")).render().decode())
    assert got[("fusionrag_cuda_memory_allocated_bytes", ())] >= held.numel()
    assert got[("fusionrag_cuda_memory_reserved_bytes", ())] >= got[("fusionrag_cuda_memory_allocated_bytes", ())]
    assert got[("fusionrag_cuda_memory_max_allocated_bytes", ())] >= held.numel()


def test_a_failing_engine_never_fails_the_scrape():
    def broken() -> dict:
        raise RuntimeError("engine gone")

    sched = SimpleNamespace(queue_length=0, active=0, stats=SchedulerStats(), engine=SimpleNamespace(stats=broken))
    metrics = Metrics(lambda: "m", sched)
    metrics.count_request("/v1/models", 200)
    got = samples(metrics.render().decode())
    assert got[("fusionrag_http_requests_total", (("route", "/v1/models"), ("status", "200")))] == 1
