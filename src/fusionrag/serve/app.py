"""The HTTP server: an OpenAI-compatible chat endpoint answering with RAG over a knowledge store.

``create_app(engine, settings)`` builds a FastAPI app around an engine (or a factory that
builds one on the model thread, see :mod:`fusionrag.serve.batching`). Routes:

- ``POST /v1/chat/completions``: OpenAI chat completions (``messages``, ``max_tokens``,
  ``stream`` as server-sent events ending with ``data: [DONE]``). The last user message is
  the question; earlier messages are ignored (one RAG turn). Decoding is greedy whatever
  ``temperature``/``top_p`` say. Extra fields: ``method``, ``ratio``, ``top_k``, ``kv`` and
  ``documents`` (``[{title, text}]`` passages used instead of retrieval). The response has
  ``usage`` and a ``fusionrag`` object (TTFT breakdown, recomputed tokens, queueing).
- ``POST /v1/documents`` (a list of ``{title, text}`` or ``{"documents": [...]}``): added to
  the store in the background (chunk, embed, plain KV, incremental fused preprocess);
  ``GET /v1/documents/{id}`` reports pending/ready/failed and the chunk ids;
  ``DELETE /v1/documents/{id}`` removes them where the store supports it (501 otherwise).
- ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format).

Every error is JSON in OpenAI's shape ``{"error": {"message", "type", "code"}}`` with a 4xx
status for bad input (400 malformed JSON or invalid fields, 401 bad API key, 404, 413 body
too large, 429 queue full) and never takes the server down: handlers catch everything.
Engine work never runs on the event loop: it runs on the scheduler's model thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fusionrag.errors import FusionRAGError
from fusionrag.online.policies import METHODS
from fusionrag.serve.batching import (
    BatchScheduler,
    DecodeRequest,
    Event,
    PromptTooLongError,
    QueueFullError,
    RequestCancelledError,
    SchedulerClosedError,
)

log = logging.getLogger(__name__)

#: TTFT histogram buckets in seconds (CPU tiny models to GPU long contexts).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class ServerSettings:
    """Limits and defaults of one server; every limit exists so that bad input gets a 4xx, not an outage."""

    host: str = "127.0.0.1"  # loopback by default: exposing a model server is an explicit choice
    port: int = 8000
    api_key: str | None = None  # if set, every route but /health needs "Authorization: Bearer KEY"
    model_name: str | None = None  # the "model" reported in responses (default: the engine's model)
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_new_tokens: int = 512  # upper bound on a request's max_tokens
    default_max_tokens: int = 64
    max_documents: int = 64  # per request, for chat "documents" and for POST /v1/documents
    max_document_chars: int = 32_000
    max_top_k: int = 32
    max_queue: int = 64  # requests waiting for prefill; more -> 429
    max_batch: int = 8  # rows of one batched decode step
    max_document_jobs: int = 16  # document jobs pending at once; more -> 429
    default_method: str = "fusionrag"
    default_ratio: float = 0.15
    request_timeout_s: float = 600.0
    preprocess_top_n: int | None = 10  # fused preprocess after adding documents (None: plain KV only)
    keep_jobs: int = 1000  # finished document jobs remembered for GET

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["api_key"] = "set" if self.api_key else None
        return d


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.code, self.param)


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "code": code, "param": param}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _as_api_error(exc: BaseException) -> APIError:
    """Map engine/scheduler errors to statuses: the caller's fault is 4xx, ours is 5xx."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", "queue_full")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, SchedulerClosedError):
        return APIError(503, str(exc), "server_error", "unavailable")
    if isinstance(exc, RequestCancelledError):
        return APIError(499, str(exc), "invalid_request_error", "cancelled")
    if isinstance(exc, FusionRAGError):
        return APIError(400, str(exc), "invalid_request_error", "invalid_request")
    if isinstance(exc, TimeoutError):
        return APIError(504, f"the request did not finish in time: {exc}", "server_error", "timeout")
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, f"internal error ({type(exc).__name__}); see the server log", "server_error",
                    "internal_error")


# ---------------------------------------------------------------------------------- metrics


class _Histogram:
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
            adhoc = getattr(engine, "adhoc_entries", None)
            if isinstance(adhoc, int):
                metric("fusionrag_adhoc_kv_entries", "gauge", "Cached KVs of request-supplied passages.",
                       [("", adhoc)])
            prefix = getattr(engine, "prefix_cache", None)
            if prefix is not None:
                st = prefix.stats()
                metric("fusionrag_prefix_cache_lookups_total", "counter", "Request-supplied passage lookups.",
                       [('{result="prefix_hit"}', st.prefix_hits), ('{result="alt_path_hit"}', st.alt_hits),
                        ('{result="computed"}', st.recomputations)])
                metric("fusionrag_prefix_cache_bytes", "gauge", "KV bytes held for request-supplied passages.",
                       [("", st.bytes_stored)])
                metric("fusionrag_prefix_cache_bytes_saved", "gauge",
                       "Bytes a plain prefix cache would hold beyond the alternative path.", [("", st.bytes_saved)])
            tiers = tier_stats(engine)
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


def tier_stats(engine: Any) -> dict[str, dict[str, Any]]:
    """KV tier statistics from the engine or its store, whichever exposes them (``{tier: stats dict}``).

    Looked up by duck typing (``tier_stats()`` or a ``tiers`` mapping/object with ``stats()``)
    so the server keeps working whether or not the engine has the tiered cache wired in.
    """
    for obj in (engine, getattr(engine, "store", None)):
        if obj is None:
            continue
        try:
            fn = getattr(obj, "tier_stats", None)
            if callable(fn):
                return {str(k): _stats_dict(v) for k, v in dict(fn()).items()}
            tiers = getattr(obj, "tiers", None)
            if isinstance(tiers, dict):
                return {str(k): _stats_dict(t.stats()) for k, t in tiers.items()}
            if tiers is not None and hasattr(tiers, "stats"):
                return {"memory": _stats_dict(tiers.stats())}
        except Exception:  # metrics must never fail a scrape
            log.debug("tier statistics unavailable", exc_info=True)
    return {}


def _stats_dict(s: Any) -> dict[str, Any]:
    d = s.to_dict() if hasattr(s, "to_dict") else dict(s)
    return {k: v for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}


# ---------------------------------------------------------------------------------- requests


@dataclass
class ChatRequest:
    question: str
    max_tokens: int
    stream: bool
    include_usage: bool
    method: str
    ratio: float
    top_k: int | None
    kv: str | None
    documents: list[dict] | None
    model: str | None


def _int_field(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {value!r}", code="invalid_value", param=name)
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {value}", code="invalid_value", param=name)
    return value


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content: only text parts are supported",
                               code="invalid_value", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise APIError(400, f"messages[{index}].content must be a string or a list of text parts",
                   code="invalid_value", param="messages")


def parse_documents(items: Any, s: ServerSettings, param: str) -> list[dict]:
    """Validate ``[{title, text}]`` passages against the document limits."""
    if not isinstance(items, list) or not items:
        raise APIError(400, f"'{param}' must be a non-empty list of {{title, text}} objects", code="invalid_value",
                       param=param)
    if len(items) > s.max_documents:
        raise APIError(413, f"too many documents: {len(items)} (limit {s.max_documents})", code="too_many_documents",
                       param=param)
    docs = []
    for i, d in enumerate(items):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str) or not d["text"].strip():
            raise APIError(400, f"{param}[{i}] must be an object with a non-empty 'text' string",
                           code="invalid_value", param=param)
        title = d.get("title", "")
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise APIError(400, f"{param}[{i}].title must be a string", code="invalid_value", param=param)
        if len(d["text"]) + len(title) > s.max_document_chars:
            raise APIError(413, f"{param}[{i}] has {len(d['text']) + len(title)} characters "
                                f"(limit {s.max_document_chars})", code="document_too_large", param=param)
        docs.append({"title": title, "text": d["text"]})
    return docs


def parse_chat(body: Any, s: ServerSettings) -> ChatRequest:
    """Validate an OpenAI chat-completions body (plus FusionRAG's fields) into a :class:`ChatRequest`."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", code="invalid_value", param="messages")
    question = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", code="invalid_value",
                           param="messages")
        text = _message_text(m.get("content"), i)
        if m["role"] == "user":
            question = text
    if question is None:
        raise APIError(400, "no user message: the last user message is the question", code="invalid_value",
                       param="messages")
    if not question.strip():
        raise APIError(400, "the question (last user message) is empty", code="empty_question", param="messages")
    n = body.get("n")
    if n not in (None, 1):
        raise APIError(400, "only n=1 is supported", code="invalid_value", param="n")
    if body.get("stop") not in (None, [], ""):
        raise APIError(400, "'stop' sequences are not supported (generation ends at the model's end-of-turn token)",
                       code="unsupported", param="stop")
    max_tokens = _int_field(body, "max_tokens", 1, s.max_new_tokens)
    max_completion = _int_field(body, "max_completion_tokens", 1, s.max_new_tokens)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise APIError(400, "'stream' must be a boolean", code="invalid_value", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", code="invalid_value", param="stream_options")
    method = body.get("method", s.default_method)
    if method is None:
        method = s.default_method
    if not isinstance(method, str) or method not in METHODS:
        raise APIError(400, f"unknown method {method!r}; choose one of: {', '.join(METHODS)}", code="unknown_method",
                       param="method")
    ratio = body.get("ratio", s.default_ratio)
    if ratio is None:
        ratio = s.default_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not math.isfinite(ratio) \
            or not 0.0 <= ratio <= 1.0:
        raise APIError(400, f"'ratio' must be a number within [0, 1], got {ratio!r}", code="invalid_ratio",
                       param="ratio")
    top_k = _int_field(body, "top_k", 1, s.max_top_k)
    kv = body.get("kv")
    if kv not in (None, "plain", "fused"):
        raise APIError(400, f"'kv' must be 'plain' or 'fused', got {kv!r}", code="invalid_value", param="kv")
    documents = body.get("documents")
    docs = None if documents is None else parse_documents(documents, s, "documents")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise APIError(400, f"'{name}' must be a number", code="invalid_value", param=name)
    model = body.get("model")
    return ChatRequest(
        question=question.strip(),
        max_tokens=max_tokens or max_completion or s.default_max_tokens,
        stream=bool(stream),
        include_usage=bool(options.get("include_usage", False)),
        method=method,
        ratio=float(ratio),
        top_k=top_k,
        kv=kv,
        documents=docs,
        model=model if isinstance(model, str) else None,
    )


# ---------------------------------------------------------------------------------- documents


@dataclass
class DocumentJob:
    id: str
    documents: list[dict] = field(repr=False)
    status: str = "pending"  # pending -> running -> ready | failed; ready -> deleted
    chunk_ids: list[int] = field(default_factory=list)
    error: str | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None
    preprocess: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "document_job",
            "status": self.status,
            "documents": len(self.documents),
            "chunk_ids": self.chunk_ids,
            "error": self.error,
            "created": int(self.created),
            "finished": None if self.finished is None else int(self.finished),
            "preprocess": self.preprocess,
        }


def _report_dict(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None
    if hasattr(report, "to_dict"):
        return report.to_dict()
    with contextlib.suppress(TypeError):
        return asdict(report)
    return {"report": str(report)}


#: Store methods that remove a document's chunks from retrieval, in order of preference.


# ---------------------------------------------------------------------------------- the app


def create_app(engine: Any, settings: ServerSettings | None = None,
               scheduler: BatchScheduler | None = None) -> FastAPI:
    """The server around ``engine`` (an ``Engine`` or a zero-argument factory run on the model thread).

    Pass a factory when the store holds thread-bound resources (``KnowledgeStore``'s SQLite
    connection): built on the model thread, every store access stays on that thread.
    ``scheduler`` lets tests inject their own :class:`BatchScheduler`.
    """
    s = settings or ServerSettings()
    sched = scheduler or BatchScheduler(engine, max_batch=s.max_batch, max_queue=s.max_queue,
                                        max_prompt_tokens=s.max_prompt_tokens)
    metrics = Metrics()
    jobs: OrderedDict[str, DocumentJob] = OrderedDict()
    jobs_lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(sched.close)

    app = FastAPI(title="FusionRAG", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler = sched
    app.state.settings = s
    app.state.metrics = metrics
    app.state.jobs = jobs

    def model_name() -> str:
        if s.model_name:
            return s.model_name
        eng = sched.engine
        return getattr(getattr(eng, "lm", None), "name", None) or "fusionrag"

    # -- cross-cutting --------------------------------------------------------------------

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable) -> Response:
        try:
            response = await call_next(request)
        except Exception as exc:  # the last line of defence: never a bare 500 page or a crash
            response = _as_api_error(exc).response()
        route = request.scope.get("route")
        metrics.count_request(getattr(route, "path", "other"), response.status_code)
        return response

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, f"invalid request: {exc.errors()}", "invalid_request_error", "invalid_value")

    def check_auth(request: Request) -> None:
        if not s.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), s.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", "invalid_api_key")

    async def read_json(request: Request) -> Any:
        """The body as JSON, refusing more than ``max_body_bytes`` before reading it all (413)."""
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > s.max_body_bytes:
                    raise APIError(413, f"request body too large: {declared} bytes (limit {s.max_body_bytes})",
                                   code="body_too_large")
            except ValueError:
                raise APIError(400, "invalid Content-Length header") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > s.max_body_bytes:
                raise APIError(413, f"request body too large (limit {s.max_body_bytes} bytes)", code="body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad encoding, absurd nesting
            raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None

    def ensure_ready() -> None:
        if sched.load_error is not None:
            raise APIError(503, f"the model failed to load: {sched.load_error}", "server_error", "unavailable")
        if not sched.ready:
            raise APIError(503, "the model is still loading; retry shortly", "server_error", "loading")

    # -- chat -----------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            check_auth(request)
            chat = parse_chat(await read_json(request), s)
            ensure_ready()
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[Event] = asyncio.Queue()

            def listener(ev: Event) -> None:
                loop.call_soon_threadsafe(events.put_nowait, ev)

            kwargs: dict[str, Any] = {"method": chat.method, "ratio": chat.ratio}
            if chat.top_k is not None:
                kwargs["top_k"] = chat.top_k
            if chat.kv is not None:
                kwargs["kv"] = chat.kv
            if chat.documents is not None:
                kwargs["chunks"] = chat.documents
            req = sched.submit(chat.question, max_new_tokens=chat.max_tokens, listener=listener, **kwargs)
        except Exception as exc:
            return _as_api_error(exc).response()
        completion_id = f"chatcmpl-{req.id}"
        created = int(time.time())
        name = model_name()
        try:
            first = await asyncio.wait_for(events.get(), s.request_timeout_s)
        except BaseException as exc:  # timeout, or the client went away (cancellation)
            req.cancel()
            if isinstance(exc, TimeoutError):
                return APIError(504, "no first token in time", "server_error", "timeout").response()
            raise
        if first.kind == "error":
            return _as_api_error(first.error).response()
        if chat.stream:
            return StreamingResponse(
                _sse(req, first, events, completion_id, created, name, chat, metrics, s.request_timeout_s),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        ev = first
        try:
            while ev.kind == "token":
                ev = await asyncio.wait_for(events.get(), s.request_timeout_s)
        except BaseException as exc:
            req.cancel()
            if isinstance(exc, TimeoutError):
                return APIError(504, "the answer did not finish in time", "server_error", "timeout").response()
            raise
        if ev.kind == "error":
            return _as_api_error(ev.error).response()
        metrics.observe_answer(req)
        ans = ev.answer
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ans.text},
                         "finish_reason": ev.finish_reason, "logprobs": None}],
            "usage": _usage(req),
            "fusionrag": _fusionrag_json(req),
        }
        return JSONResponse(body)

    # -- documents --------------------------------------------------------------------------

    def ingest_job(job: DocumentJob) -> None:
        """Runs on the model thread (the store and the model are used by one thread at a time)."""
        job.status = "running"
        try:
            store = sched.engine.store
            if not hasattr(store, "add_passages"):
                raise FusionRAGError("this knowledge store cannot add documents (no add_passages)")
            job.chunk_ids = [int(c) for c in store.add_passages(job.documents, doc=f"api:{job.id}")]
            store_top_n = store.settings.get("top_n") if hasattr(store, "settings") else None
            if store_top_n is not None and hasattr(store, "preprocess"):
                # A preprocessed store: incremental over the whole store, with the store's own
                # settings; new chunks get fused KV, and chunks whose neighbour lists now include
                # a new chunk are re-fused (as 'fusionrag ingest' does).
                job.preprocess = _report_dict(store.preprocess(top_n=int(store_top_n), progress=False))
            elif s.preprocess_top_n is not None and hasattr(store, "settings"):
                # Never preprocessed: fuse only the new chunks, without switching the whole store
                # to fused mode (store.preprocess would record top_n and fuse everything).
                from fusionrag.offline.preprocess import DEFAULT_NEIGHBOUR_ORDER, run_preprocess

                job.preprocess = _report_dict(run_preprocess(
                    store, top_n=int(s.preprocess_top_n),
                    neighbour_order=store.settings.get("neighbour_order") or DEFAULT_NEIGHBOUR_ORDER,
                    same_document=bool(store.settings.get("same_document")), chunk_ids=job.chunk_ids,
                    progress=False))
            job.status = "ready"
        except Exception as exc:
            log.warning("document job %s failed: %s", job.id, exc)
            job.error = str(exc) if isinstance(exc, FusionRAGError) else f"{type(exc).__name__}: {exc}"
            job.status = "failed"
        finally:
            job.finished = time.time()

    def remember(job: DocumentJob) -> None:
        with jobs_lock:
            jobs[job.id] = job
            while len(jobs) > s.keep_jobs:
                oldest = next(iter(jobs))
                if jobs[oldest].status in ("pending", "running"):
                    break
                jobs.pop(oldest)

    def job_counts() -> dict[str, int]:
        with jobs_lock:
            return dict(Counter(j.status for j in jobs.values()))

    @app.post("/v1/documents")
    async def add_documents(request: Request) -> Response:
        try:
            check_auth(request)
            body = await read_json(request)
            items = body.get("documents") if isinstance(body, dict) else body
            docs = parse_documents(items, s, "documents")
            ensure_ready()
            if job_counts().get("pending", 0) + job_counts().get("running", 0) >= s.max_document_jobs:
                raise APIError(429, f"too many document jobs in progress (limit {s.max_document_jobs})",
                               "rate_limit_error", "queue_full")
            job = DocumentJob(uuid.uuid4().hex, docs)
            remember(job)
            sched.run_task(ingest_job, job)
        except Exception as exc:
            return _as_api_error(exc).response()
        return JSONResponse(job.to_json(), status_code=202)

    def get_job(job_id: str) -> DocumentJob:
        with jobs_lock:
            job = jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no document job '{job_id}'", code="not_found")
        return job

    @app.get("/v1/documents/{job_id}")
    async def document_status(job_id: str, request: Request) -> Response:
        try:
            check_auth(request)
            return JSONResponse(get_job(job_id).to_json())
        except Exception as exc:
            return _as_api_error(exc).response()

    @app.delete("/v1/documents/{job_id}")
    async def delete_documents(job_id: str, request: Request) -> Response:
        try:
            check_auth(request)
            job = get_job(job_id)
            if job.status in ("pending", "running"):
                raise APIError(409, f"document job '{job_id}' is still {job.status}; delete it once it is ready",
                               code="conflict")
            if job.status == "deleted":
                return JSONResponse(job.to_json())
            if job.status == "ready":
                await asyncio.wrap_future(sched.run_task(sched.engine.store.delete_doc, f"api:{job.id}"))
            job.status = "deleted"
            return JSONResponse(job.to_json())
        except Exception as exc:
            return _as_api_error(exc).response()

    # -- service ----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except Exception as exc:
            return _as_api_error(exc).response()
        return JSONResponse({"object": "list", "data": [
            {"id": model_name(), "object": "model", "created": 0, "owned_by": "fusionrag"}]})

    @app.get("/health")
    async def health() -> Response:
        if sched.load_error is not None:
            status, code = "error", 503
        elif not sched.ready:
            status, code = "loading", 503
        else:
            status, code = "ok", 200
        body = {"status": status, "model": model_name(), "queue_length": sched.queue_length,
                "active_requests": sched.active, "max_batch": s.max_batch, "max_queue": s.max_queue}
        if sched.load_error is not None:
            body["error"] = str(sched.load_error)
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        try:
            check_auth(request)
        except Exception as exc:
            return _as_api_error(exc).response()
        return PlainTextResponse(metrics.render(sched, job_counts()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _usage(req: DecodeRequest) -> dict[str, int]:
    done = len(req.tokens)
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": done, "total_tokens": req.prompt_tokens + done}


def _fusionrag_json(req: DecodeRequest) -> dict[str, Any]:
    out = req.answer.to_json()
    out.pop("answer", None)  # already the message content
    out["server"] = {
        "queue_ms": round(req.queue_ms, 2),
        "ttft_ms": None if req.ttft_ms is None else round(req.ttft_ms, 2),
        "latency_ms": None if req.finished_at is None else round((req.finished_at - req.submitted_at) * 1000.0, 2),
    }
    return out


def _chunk(completion_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
           **extra: Any) -> str:
    body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
    return f"data: {json.dumps(body)}\n\n"


async def _sse(req: DecodeRequest, first: Event, events: asyncio.Queue, completion_id: str, created: int,
               model: str, chat: ChatRequest, metrics: Metrics, timeout: float) -> AsyncIterator[str]:
    """OpenAI chunk stream: role + first text, text deltas, a final chunk, optional usage, ``[DONE]``."""
    finished = False
    try:
        ev = first
        role_sent = False
        while ev.kind == "token":
            if not role_sent:
                yield _chunk(completion_id, created, model, {"role": "assistant", "content": ev.text})
                role_sent = True
            elif ev.text:
                yield _chunk(completion_id, created, model, {"content": ev.text})
            ev = await asyncio.wait_for(events.get(), timeout)
        if ev.kind == "error":
            err = _as_api_error(ev.error)
            finished = True
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'code': err.code}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        finished = True
        metrics.observe_answer(req)
        if not role_sent:
            yield _chunk(completion_id, created, model, {"role": "assistant", "content": ""})
        yield _chunk(completion_id, created, model, {}, ev.finish_reason, fusionrag=_fusionrag_json(req))
        if chat.include_usage:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": _usage(req)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except TimeoutError:
        yield f"data: {json.dumps({'error': {'message': 'generation timed out', 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client disconnected or we timed out: free the batch slot
            req.cancel()
