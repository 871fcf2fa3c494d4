"""A bounded load generator for the server (the paper's Figure 15: TTFT and throughput vs request rate).

Requests arrive open-loop (Poisson, seeded) at each rate, for each method, on loopback
only: the generator refuses any other host, and every (method, rate) cell is bounded in
request count and in time. TTFT is measured client-side, from sending the request to
the first streamed chunk (the server sends it once the first token exists), so it
includes queueing, prefill and transport. Throughput is completed requests (and
generated tokens, from the streamed ``usage``) per second of the cell's wall time.

:func:`run_load_test` writes ``loadtest.json``, ``loadtest.md`` and ``loadtest.png``.
``fusionrag bench serve --store`` starts the server in-process
(:class:`fusionrag.serve.server_thread.ServerThread`); ``--url`` targets a running one.

:func:`closed_loop` is the other shape of load: a fixed number of clients, each sending its
next request as soon as its last one finished (what ``benchmarks/gpu/gpu_serve.py`` runs:
8 clients with 16K-token prompts), bounded the same way in count and time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fusionrag.bench.datasets import load_questions
from fusionrag.bench.loadtest_report import write_report
from fusionrag.errors import FusionRAGError
from fusionrag.online.request import ReuseRequest

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DEFAULT_METHODS = ("full", "cacheblend:0.15", "fusionrag:0.15")
MAX_REQUESTS_PER_CELL = 2000


@dataclass(frozen=True)
class MethodSpec:
    method: str
    ratio: float

    @property
    def label(self) -> str:
        return self.method if self.method in ("full", "reuse") else f"{self.method} {self.ratio:.0%}"


def parse_method(spec: Any) -> MethodSpec:
    """``"full"``, ``"cacheblend:0.15"``, ``("fusionrag", 0.15)`` or ``{"method", "ratio"}``."""
    if isinstance(spec, MethodSpec):
        return spec
    if isinstance(spec, dict):
        method, ratio = spec.get("method"), spec.get("ratio", 0.15)
    elif isinstance(spec, list | tuple):
        method, ratio = spec[0], spec[1] if len(spec) > 1 else 0.15
    else:
        method, _, r = str(spec).partition(":")
        ratio = float(r) if r else 0.15
    req = ReuseRequest("-", str(method), ratio).fields_validated()
    return MethodSpec(req.method, req.ratio)


def check_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname or ""
    if host not in LOOPBACK:
        raise FusionRAGError(f"the load test only targets loopback (127.0.0.1/localhost), not '{host or base_url}'")


def question_items(path: str | Path, limit: int | None = None, with_documents: bool = True,
                   max_passages: int | None = None) -> list[dict]:
    """Questions of a ``../shared/data`` JSONL file as request items, each with its passages as ``documents``.

    Read by :func:`fusionrag.bench.datasets.load_questions` (one parser, one validation for
    every benchmark); the items are the ``{"question", "documents"?}`` dicts that
    :func:`run_load_test` and :func:`ingest_documents` send.
    """
    out = []
    for ex in load_questions(path, limit=limit or None):
        item: dict[str, Any] = {"question": ex.question}
        if with_documents and ex.passages:
            passages = ex.passages[:max_passages] if max_passages else ex.passages
            item["documents"] = [{"title": p.title, "text": p.text} for p in passages]
        out.append(item)
    if not out:
        raise FusionRAGError(f"{path} has no questions")
    return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _one(client: Any, url: str, headers: dict, item: dict, spec: MethodSpec, max_tokens: int,
               top_k: int | None, t_offset: float) -> dict[str, Any]:
    body: dict[str, Any] = {  # no "model": the server's served model (vLLM's habit, as fusionrag's)
        "messages": [{"role": "user", "content": item["question"]}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "method": spec.method,
        "ratio": spec.ratio,
    }
    if top_k:
        body["retrieval_top_k"] = top_k
    if item.get("documents"):
        body["documents"] = item["documents"]
    else:  # retrieval mode: the server searches its store (it does only when a request asks)
        body["retrieval"] = True
    t0 = time.perf_counter()
    res: dict[str, Any] = {"sent_at": t_offset, "ok": False, "status": None, "ttft_s": None, "latency_s": None,
                           "tokens": 0, "prompt_tokens": None, "error": None}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                res["error"] = text[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res["error"] = str(obj["error"])[:300]
                    return res
                if res["ttft_s"] is None and obj.get("choices"):
                    res["ttft_s"] = time.perf_counter() - t0
                if obj.get("usage"):
                    res["tokens"] = int(obj["usage"].get("completion_tokens", 0))
                    res["prompt_tokens"] = obj["usage"].get("prompt_tokens")
        res["latency_s"] = time.perf_counter() - t0
        res["ok"] = res["ttft_s"] is not None
    except Exception as exc:  # connection errors, timeouts: counted, never fatal to the run
        res["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return res


async def _cell(base_url: str, items: Sequence[dict], spec: MethodSpec, rate: float, n: int, duration_s: float,
                max_tokens: int, top_k: int | None, api_key: str | None, timeout_s: float, seed: int,
                start_index: int) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/chat/completions"
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max(8, n), max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        tasks = []
        t_start = time.perf_counter()
        t_next = 0.0
        for i in range(n):
            if t_next > duration_s:
                break
            delay = t_start + t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            item = items[(start_index + i) % len(items)]
            tasks.append(asyncio.create_task(_one(client, url, headers, item, spec, max_tokens, top_k, t_next)))
            t_next += rng.expovariate(rate)
        done, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t_start
    results = [t.result() for t in tasks if t in done]
    return {"rate": rate, **_summary(spec, results, len(tasks), len(pending), wall)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 2)


def _summary(spec: MethodSpec, results: Sequence[dict], sent: int, unfinished: int, wall: float) -> dict[str, Any]:
    """A cell's counts, TTFT and latency percentiles and throughput (completed requests / ``wall``)."""
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft_s"] for r in ok]
    lats = [r["latency_s"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            key = str(r["status"] or "error")
            errors[key] = errors.get(key, 0) + 1
    if unfinished:
        errors["timeout"] = unfinished
    prompt = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    return {
        "method": spec.method,
        "ratio": spec.ratio,
        "label": spec.label,
        "sent": sent,
        "ok": len(ok),
        "errors": errors,
        "wall_s": round(wall, 3),
        "ttft_ms_p50": _ms(_percentile(ttfts, 0.5)),
        "ttft_ms_p95": _ms(_percentile(ttfts, 0.95)),
        "ttft_ms_p99": _ms(_percentile(ttfts, 0.99)),
        "ttft_ms_mean": _ms(sum(ttfts) / len(ttfts)) if ttfts else None,
        "latency_ms_p50": _ms(_percentile(lats, 0.5)),
        "latency_ms_p95": _ms(_percentile(lats, 0.95)),
        "throughput_rps": round(len(ok) / wall, 3) if wall > 0 else None,
        "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "completion_tokens": tokens,
        "prompt_tokens_p50": _percentile(prompt, 0.5),
        "first_error": next((r["error"] for r in results if r["error"]), None),
    }


async def _closed_cell(base_url: str, items: Sequence[dict], spec: MethodSpec, clients: int, n: int | None,
                       duration_s: float, max_tokens: int, api_key: str | None, timeout_s: float,
                       start_index: int) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limit = min(n if n is not None else MAX_REQUESTS_PER_CELL, MAX_REQUESTS_PER_CELL)
    results: list[dict] = []
    issued = 0
    stopped_at: list[float] = []  # when the first client found the bounds reached: the end of the full-load window
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        t_start = time.perf_counter()

        async def worker() -> None:
            nonlocal issued
            while True:
                now = time.perf_counter() - t_start
                if issued >= limit or now >= duration_s:
                    stopped_at.append(now)
                    return
                item = items[(start_index + issued) % len(items)]
                issued += 1
                res = await _one(client, url, headers, item, spec, max_tokens, None, now)
                res["done_at"] = time.perf_counter() - t_start
                results.append(res)

        tasks = [asyncio.create_task(worker()) for _ in range(max(1, clients))]
        _, pending = await asyncio.wait(tasks, timeout=duration_s + timeout_s)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t_start
    window = min(stopped_at) if stopped_at else wall
    in_window = [r for r in results if r["ok"] and r["done_at"] <= window]
    cell = {"clients": clients, **_summary(spec, results, issued, issued - len(results), wall)}
    if window > 0 and in_window:  # every client busy until the first one stopped: the steady state
        cell["throughput_rps"] = round(len(in_window) / window, 3)
        cell["throughput_tok_s"] = round(sum(r["tokens"] for r in in_window) / window, 2)
    cell["window_s"] = round(window if in_window else wall, 3)
    return cell


def closed_loop(base_url: str, items: Sequence[str | dict], method: Any, clients: int = 8,
                duration_s: float | None = 60.0, n_requests: int | None = None, max_tokens: int = 32,
                api_key: str | None = None, timeout_s: float = 600.0, start_index: int = 0) -> dict[str, Any]:
    """``clients`` concurrent clients, each sending its next request (``items`` in turn) once its last one ended.

    Stops issuing at ``n_requests`` requests or ``duration_s`` seconds (at least one bound; capped by
    :data:`MAX_REQUESTS_PER_CELL`), then lets the requests in flight finish (at most ``timeout_s``).
    Throughput is counted over the window in which every client was busy (from the start to the moment
    the first client stopped issuing: ``window_s``), so the drain of the last requests, run by fewer
    clients, does not lower it; TTFT and latency percentiles cover every completed request.
    """
    cases = _checked(base_url, items, duration_s, n_requests)
    duration = float("inf") if duration_s is None else float(duration_s)
    return asyncio.run(_closed_cell(base_url, cases, parse_method(method), int(clients), n_requests, duration,
                                    max_tokens, api_key, timeout_s, start_index))


def _checked(base_url: str, questions: Sequence[str | dict], duration_s: float | None,
             n_requests: int | None) -> list[dict]:
    """The request items, once the target is loopback and the load is bounded."""
    check_loopback(base_url)
    if duration_s is None and n_requests is None:
        raise FusionRAGError("bound the load test with duration_s or n_requests")
    items = [{"question": q} if isinstance(q, str) else dict(q) for q in questions]
    if not items:
        raise FusionRAGError("no questions to send")
    return items


def run_load_test(
    base_url: str,
    questions: Sequence[str | dict],
    rates: Iterable[float] = (0.5, 1.0, 2.0, 4.0),
    methods: Iterable[Any] = DEFAULT_METHODS,
    duration_s: float | None = 30.0,
    n_requests: int | None = None,
    out_dir: str | Path | None = None,
    max_tokens: int = 16,
    top_k: int | None = None,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    seed: int = 0,
    warmup: int = 1,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send ``questions`` at each rate (requests/s) for each method; report TTFT and throughput.

    Each (method, rate) cell sends ``n_requests`` requests, or as many as arrive within
    ``duration_s`` (whichever bound is hit first; at least one bound is required, and
    :data:`MAX_REQUESTS_PER_CELL` caps it), then waits at most ``timeout_s`` for them.
    ``questions`` are strings or ``{"question", "documents"?}`` dicts (see :func:`question_items`).
    """
    items = _checked(base_url, questions, duration_s, n_requests)
    rates = [float(r) for r in rates]
    if not rates or any(r <= 0 for r in rates):
        raise FusionRAGError("request rates must be positive")
    specs = [parse_method(m) for m in methods]
    duration = float("inf") if duration_s is None else float(duration_s)

    async def main() -> list[dict[str, Any]]:
        cells = []
        for si, spec in enumerate(specs):
            if warmup:  # first-call costs (KV loads, allocator) are not the steady state being measured
                await _cell(base_url, items, spec, 1000.0, warmup, float("inf"), max_tokens, top_k, api_key,
                            timeout_s, seed, 0)
            for ri, rate in enumerate(rates):
                n = n_requests if n_requests is not None else max(1, math.ceil(rate * duration))
                n = min(n, MAX_REQUESTS_PER_CELL)
                cells.append(await _cell(base_url, items, spec, rate, n, duration, max_tokens, top_k, api_key,
                                         timeout_s, seed + 1000 * si + ri, start_index=ri * n))
        return cells

    t0 = time.time()
    cells = asyncio.run(main())
    report = {
        "base_url": base_url,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
        "seconds": round(time.time() - t0, 2),
        "questions": len(items),
        "with_documents": any("documents" in it for it in items),
        "rates": rates,
        "methods": [asdict(s) | {"label": s.label} for s in specs],
        "duration_s": duration_s,
        "n_requests": n_requests,
        "max_tokens": max_tokens,
        "arrivals": "poisson",
        "ttft": "client-side, request sent to first streamed chunk",
        "meta": meta or {},
        "cells": cells,
    }
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def ingest_documents(base_url: str, questions: Sequence[dict], api_key: str | None = None, batch: int = 64,
                     timeout_s: float = 3600.0) -> list[int]:
    """POST every distinct passage of ``questions`` to ``/v1/documents`` and wait until all jobs are ready.

    With the passages in the store, a request that carries them as ``documents`` reuses
    their stored (fused) KV instead of computing it on the fly.
    """
    import httpx

    check_loopback(base_url)
    seen, docs = set(), []
    for q in questions:
        for d in q.get("documents", []):
            key = (d.get("title", ""), d["text"])
            if key not in seen:
                seen.add(key)
                docs.append(d)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chunk_ids: list[int] = []
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, headers=headers, timeout=60.0, trust_env=False) as client:
        job_ids = []
        for i in range(0, len(docs), batch):
            r = client.post("/v1/documents", json={"documents": docs[i:i + batch]})
            if r.status_code != 202:
                raise FusionRAGError(f"adding documents failed: {r.status_code} {r.text[:300]}")
            job_ids.append(r.json()["id"])
        for jid in job_ids:
            while True:
                job = client.get(f"/v1/documents/{jid}").json()
                if job["status"] == "ready":
                    chunk_ids.extend(job["chunk_ids"])
                    break
                if job["status"] == "failed":
                    raise FusionRAGError(f"document job {jid} failed: {job['error']}")
                if time.monotonic() > deadline:
                    raise FusionRAGError(f"document job {jid} not ready after {timeout_s} s")
                time.sleep(0.2)
    return chunk_ids
