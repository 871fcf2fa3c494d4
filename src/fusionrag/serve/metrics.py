"""``GET /metrics``: Prometheus metrics with vLLM's names for what both servers measure.

Why vLLM's names: a vLLM Grafana dashboard (``vllm:time_to_first_token_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:num_requests_running`` ..., labelled by
``model_name``) then works unchanged for the shared metrics; what only fusionrag has
(recomputed and reused tokens, KV tier hits, the prefix cache of request-supplied
passages) is under ``fusionrag_``.

Each app has its own :class:`~prometheus_client.CollectorRegistry` (tests build several
apps in one process). Gauges that mirror live state (queue, batch, tiers) are read at
scrape time by a collector; a failing read never fails the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fusionrag.online.state import Request

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: vLLM's TTFT buckets (seconds), extended for CPU prefill of long prompts.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The counters and histograms of one app, in their own registry."""

    def __init__(self, model_name: Callable[[], str], scheduler: Any = None,
                 jobs: Callable[[], dict[str, int]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (queueing included).", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two generated tokens.", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting for the model thread before "
                               "prefill.", m, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Prefill time (retrieve, load, select, "
                                 "recompute).", m, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", m,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               [*m, "finished_reason"], registry=r)
        self.fr_ttft = Histogram("fusionrag_ttft_seconds", "Time to first token by method.", [*m, "method"],
                                 buckets=TTFT_BUCKETS, registry=r)
        self.recomputed = Counter("fusionrag_recomputed_tokens", "Context tokens recomputed by prefill.",
                                  [*m, "method"], registry=r)
        self.reused = Counter("fusionrag_reused_tokens", "Context tokens served from reused KV.", [*m, "method"],
                              registry=r)
        self.context = Counter("fusionrag_context_tokens", "Context (passage) tokens of finished requests.",
                               [*m, "method"], registry=r)
        self.fused_fallbacks = Counter("fusionrag_fused_fallbacks", "Chunks served with plain KV because their "
                                       "fused KV was missing.", m, registry=r)
        self.http = Counter("fusionrag_http_requests", "HTTP requests by route and status code.",
                            ["route", "status"], registry=r)
        if scheduler is not None:
            self.registry.register(_LiveState(scheduler, model_name, jobs or dict))

    def count_request(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def observe_answer(self, req: Request) -> None:
        """Record a finished request (never raises: metrics must not fail an answer)."""
        try:
            self._observe(req)
        except Exception:
            log.warning("could not record the metrics of request %s", req.id, exc_info=True)

    def _observe(self, req: Request) -> None:
        name, ans = self._model_name(), req
        if req.server_ttft_ms is not None:
            self.ttft.labels(name).observe(req.server_ttft_ms / 1000.0)
            self.fr_ttft.labels(name, ans.method).observe(req.server_ttft_ms / 1000.0)
        answer = req.answer
        if answer.finished_at is not None:
            self.e2e.labels(name).observe(answer.finished_at - req.submitted_at)
        for a, b in zip(answer.token_times, answer.token_times[1:], strict=False):
            self.itl.labels(name).observe(b - a)
        self.queue.labels(name).observe(req.queue_ms / 1000.0)
        self.prefill.labels(name).observe(ans.ttft_ms.get("total", 0.0) / 1000.0)
        self.prompt_tokens.labels(name).inc(req.prompt_tokens)
        self.generation_tokens.labels(name).inc(len(answer.token_ids))
        self.success.labels(name, answer.finish_reason or "unknown").inc()
        self.recomputed.labels(name, ans.method).inc(ans.recomputed_tokens)
        self.context.labels(name, ans.method).inc(ans.context_tokens)
        if ans.method != "full":
            self.reused.labels(name, ans.method).inc(ans.reused_tokens)
        self.fused_fallbacks.labels(name).inc(ans.fused_fallbacks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveState(Collector):
    """Gauges read from the scheduler and the engine at scrape time."""

    def __init__(self, scheduler: Any, model_name: Callable[[], str], jobs: Callable[[], dict[str, int]]) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.jobs = jobs

    def collect(self) -> Iterator[Any]:
        try:
            yield from self._collect()
        except Exception:  # metrics must never fail a scrape
            log.debug("live metrics unavailable", exc_info=True)

    def _collect(self) -> Iterator[Any]:
        sched, name = self.scheduler, self.model_name()
        for metric, help_, value in (("vllm:num_requests_running", "Requests decoding.", sched.active),
                                     ("vllm:num_requests_waiting", "Requests waiting for prefill.",
                                      sched.queue_length)):
            g = GaugeMetricFamily(metric, help_, labels=["model_name"])
            g.add_metric([name], value)
            yield g
        st = sched.stats
        c = CounterMetricFamily("fusionrag_decode_steps", "Batched decode forwards.", labels=["model_name"])
        c.add_metric([name], st.decode_steps)
        yield c
        c = CounterMetricFamily("fusionrag_decode_rows", "Tokens decoded by batched forwards (sum of batch sizes).",
                                labels=["model_name"])
        c.add_metric([name], st.decode_rows)
        yield c
        c = CounterMetricFamily("fusionrag_requests_finished", "Requests by outcome in the scheduler.",
                                labels=["outcome"])
        for outcome in ("completed", "failed", "cancelled"):
            c.add_metric([outcome], getattr(st, outcome))
        yield c
        g = GaugeMetricFamily("fusionrag_document_jobs", "Document jobs by status.", labels=["status"])
        for status, n in sorted(self.jobs().items()):
            g.add_metric([status], n)
        yield g
        if sched.engine is not None:
            yield from _engine_metrics(sched.engine.stats())
            yield from _device_memory(getattr(getattr(sched.engine, "lm", None), "device", None))


def _device_memory(device: Any) -> Iterator[Any]:
    """The GPU memory torch's caching allocator holds for the model's device (nothing on a CPU): weights,
    the device KV tier, requests' prompt KV, temporaries (the tier's own share is ``fusionrag_kv_tier_bytes``)."""
    import torch

    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_initialized():
        return
    for name, value, doc in (
            ("fusionrag_cuda_memory_allocated_bytes", torch.cuda.memory_allocated(device), "Bytes in live tensors."),
            ("fusionrag_cuda_memory_reserved_bytes", torch.cuda.memory_reserved(device),
             "Bytes the caching allocator holds (allocated + cached)."),
            ("fusionrag_cuda_memory_max_allocated_bytes", torch.cuda.max_memory_allocated(device),
             "Peak bytes in live tensors since start.")):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], value)
        yield g


def _engine_metrics(es: dict[str, Any]) -> Iterator[Any]:
    """KV tier hits and sizes, and the prefix cache of request-supplied passages, from ``Engine.stats()``."""
    if "adhoc_entries" in es:
        g = GaugeMetricFamily("fusionrag_adhoc_kv_entries", "Cached KVs of request-supplied passages.")
        g.add_metric([], es["adhoc_entries"])
        yield g
    for key, name, doc in (("adhoc_bytes", "fusionrag_adhoc_kv_bytes", "Bytes of cached KVs of request-supplied "
                            "passages."), ("adhoc_limit_bytes", "fusionrag_adhoc_kv_limit_bytes",
                                           "Their cap (--adhoc-cache-mb; 0 when unbounded).")):
        if es.get(key) is not None:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], es[key])
            yield g
    pc = es.get("prefix_cache")
    if pc is not None:
        c = CounterMetricFamily("fusionrag_prefix_cache_lookups", "Request-supplied passage lookups.",
                                labels=["result"])
        for label, value in (("prefix_hit", pc.prefix_hits), ("alt_path_hit", pc.alt_hits),
                             ("computed", pc.recomputations)):
            c.add_metric([label], value)
        yield c
        g = GaugeMetricFamily("fusionrag_prefix_cache_bytes", "KV bytes held for request-supplied passages.")
        g.add_metric([], pc.bytes_stored)
        yield g
    tiers = {str(k): _stats_dict(v) for k, v in es.get("tiers", {}).items()}
    if not tiers:
        return
    hits = CounterMetricFamily("fusionrag_kv_tier_hits", "KV cache lookups by tier and where they were served.",
                               labels=["tier", "source"])
    for tier, s in sorted(tiers.items()):
        for source in ("memory_hits", "inflight_hits", "disk_hits"):
            if source in s:
                hits.add_metric([tier, source.removesuffix("_hits")], s[source])
    yield hits
    for key, metric, family in (("memory_bytes", "fusionrag_kv_tier_bytes", GaugeMetricFamily),
                                ("memory_items", "fusionrag_kv_tier_items", GaugeMetricFamily),
                                ("evictions", "fusionrag_kv_tier_evictions", CounterMetricFamily),
                                ("promotions", "fusionrag_kv_tier_promotions", CounterMetricFamily)):
        fam = family(metric, f"KV tier {key.replace('_', ' ')}.", labels=["tier"])
        for tier, s in sorted(tiers.items()):
            if key in s:
                fam.add_metric([tier], s[key])
        yield fam


def _stats_dict(s: Any) -> dict[str, Any]:
    d = s.to_dict() if hasattr(s, "to_dict") else dict(s)
    return {k: v for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}
