"""The counters behind ``GET /metrics``, rendered in the Prometheus text format.

Written by hand (no client library dependency). Everything the scrape reads from the
engine is looked up by duck typing, and a failing lookup never fails the scrape.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from fusionrag.serve.batching import BatchScheduler
from fusionrag.serve.requests import DecodeRequest

log = logging.getLogger(__name__)

#: TTFT histogram buckets in seconds (CPU tiny models to GPU long contexts).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    """Cumulative Prometheus buckets per label (e.g. per method), plus sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, label: str, value: float) -> None:
        counts = self.counts.setdefault(label, [0] * (len(self.buckets) + 1))
        for i, b in enumerate(self.buckets):
            if value <= b:
                counts[i] += 1
        counts[-1] += 1
        self.sums[label] = self.sums.get(label, 0.0) + value

    def render(self, name: str, label_name: str, lines: list[str]) -> None:
        for label in sorted(self.counts):
            counts = self.counts[label]
            lab = f'{label_name}="{_escape(label)}"'
            for b, c in zip(self.buckets, counts, strict=False):
                lines.append(f'{name}_bucket{{{lab},le="{_fmt(b)}"}} {c}')
            lines.append(f'{name}_bucket{{{lab},le="+Inf"}} {counts[-1]}')
            lines.append(f"{name}_sum{{{lab}}} {_fmt(self.sums[label])}")
            lines.append(f"{name}_count{{{lab}}} {counts[-1]}")


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Metrics:
    """Counters behind ``/metrics``, written in the Prometheus text format by hand (no new dependency)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = Counter()  # (route, status) -> n
        self.ttft = _Histogram(TTFT_BUCKETS)  # server-side: arrival to first token, per method
        self.engine_ttft = _Histogram(TTFT_BUCKETS)  # engine.prepare total, per method
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.recomputed_tokens = 0
        self.context_tokens = 0
        self.fused_fallbacks = 0

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, str(status))] += 1

    def observe_answer(self, req: DecodeRequest) -> None:
        ans = req.answer
        with self._lock:
            if req.ttft_ms is not None:
                self.ttft.observe(ans.method, req.ttft_ms / 1000.0)
            self.engine_ttft.observe(ans.method, ans.ttft_ms.get("total", 0.0) / 1000.0)
            self.prompt_tokens += req.prompt_tokens
            self.completion_tokens += len(ans.token_ids)
            self.recomputed_tokens += ans.recomputed_tokens
            self.context_tokens += ans.context_tokens
            self.fused_fallbacks += ans.fused_fallbacks

    def render(self, scheduler: BatchScheduler, jobs: dict[str, int]) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_fmt(value)}")

        with self._lock:
            metric("fusionrag_requests_total", "counter", "HTTP requests by route and status code.",
                   [(f'{{route="{_escape(r)}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
            lines.append("# HELP fusionrag_ttft_seconds Time to first token seen by the server (queueing included).")
            lines.append("# TYPE fusionrag_ttft_seconds histogram")
            self.ttft.render("fusionrag_ttft_seconds", "method", lines)
            lines.append("# HELP fusionrag_prefill_seconds Engine time to first token (retrieve, load, select, "
                         "recompute).")
            lines.append("# TYPE fusionrag_prefill_seconds histogram")
            self.engine_ttft.render("fusionrag_prefill_seconds", "method", lines)
            metric("fusionrag_prompt_tokens_total", "counter", "Prompt tokens of completed requests.",
                   [("", self.prompt_tokens)])
            metric("fusionrag_completion_tokens_total", "counter", "Generated tokens of completed requests.",
                   [("", self.completion_tokens)])
            metric("fusionrag_recomputed_tokens_total", "counter", "Context tokens recomputed by prefill.",
                   [("", self.recomputed_tokens)])
            metric("fusionrag_context_tokens_total", "counter", "Context (chunk) tokens of completed requests.",
                   [("", self.context_tokens)])
            metric("fusionrag_fused_fallbacks_total", "counter",
                   "Chunks served with plain KV because their fused KV was missing.", [("", self.fused_fallbacks)])
        st = scheduler.stats
        metric("fusionrag_queue_length", "gauge", "Requests waiting for prefill.", [("", scheduler.queue_length)])
        metric("fusionrag_active_requests", "gauge", "Requests decoding.", [("", scheduler.active)])
        metric("fusionrag_decode_steps_total", "counter", "Batched decode forwards.", [("", st.decode_steps)])
        metric("fusionrag_decode_rows_total", "counter", "Tokens decoded by batched forwards (sum of batch sizes).",
               [("", st.decode_rows)])
        metric("fusionrag_requests_finished_total", "counter", "Requests by outcome in the scheduler.",
               [('{outcome="completed"}', st.completed), ('{outcome="failed"}', st.failed),
                ('{outcome="cancelled"}', st.cancelled)])
        metric("fusionrag_document_jobs", "gauge", "Document jobs by status.",
               [(f'{{status="{s}"}}', n) for s, n in sorted(jobs.items())])
        engine = scheduler.engine
        if engine is not None:
            try:
                es = engine.stats()
            except Exception:  # metrics must never fail a scrape
                log.debug("engine statistics unavailable", exc_info=True)
                es = {}
            if "adhoc_entries" in es:
                metric("fusionrag_adhoc_kv_entries", "gauge", "Cached KVs of request-supplied passages.",
                       [("", es["adhoc_entries"])])
            if es.get("prefix_cache") is not None:
                st = es["prefix_cache"]
                metric("fusionrag_prefix_cache_lookups_total", "counter", "Request-supplied passage lookups.",
                       [('{result="prefix_hit"}', st.prefix_hits), ('{result="alt_path_hit"}', st.alt_hits),
                        ('{result="computed"}', st.recomputations)])
                metric("fusionrag_prefix_cache_bytes", "gauge", "KV bytes held for request-supplied passages.",
                       [("", st.bytes_stored)])
                metric("fusionrag_prefix_cache_bytes_saved", "gauge",
                       "Bytes a plain prefix cache would hold beyond the alternative path.", [("", st.bytes_saved)])
            tiers = {str(k): _stats_dict(v) for k, v in es.get("tiers", {}).items()}
            if tiers:
                hits = []
                for tier, s in sorted(tiers.items()):
                    for source in ("memory_hits", "inflight_hits", "disk_hits"):
                        if source in s:
                            hits.append((f'{{tier="{_escape(tier)}",source="{source.removesuffix("_hits")}"}}',
                                         s[source]))
                metric("fusionrag_kv_tier_hits_total", "counter",
                       "KV cache lookups by tier and where they were served.", hits)
                for key, name, kind in (("memory_bytes", "fusionrag_kv_tier_bytes", "gauge"),
                                        ("memory_items", "fusionrag_kv_tier_items", "gauge"),
                                        ("evictions", "fusionrag_kv_tier_evictions_total", "counter"),
                                        ("promotions", "fusionrag_kv_tier_promotions_total", "counter")):
                    metric(name, kind, f"KV tier {key.replace('_', ' ')}.",
                           [(f'{{tier="{_escape(t)}"}}', s[key]) for t, s in sorted(tiers.items()) if key in s])
        return "\n".join(lines) + "\n"


def _stats_dict(s: Any) -> dict[str, Any]:
    d = s.to_dict() if hasattr(s, "to_dict") else dict(s)
    return {k: v for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}
