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

This module holds the routes only: the wire format is :mod:`fusionrag.serve.protocol`,
the counters :mod:`fusionrag.serve.metrics`, the document jobs :mod:`fusionrag.serve.documents`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fusionrag.serve.batching import BatchScheduler
from fusionrag.serve.documents import DocumentJob, DocumentJobs, delete_document_job, run_document_job
from fusionrag.serve.metrics import Metrics
from fusionrag.serve.protocol import (
    APIError,
    as_api_error,
    completion_json,
    error_response,
    parse_chat,
    parse_documents,
    read_json,
    sse_stream,
)
from fusionrag.serve.requests import Event
from fusionrag.serve.settings import ServerSettings


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
    jobs = DocumentJobs(s)

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
        return sched.engine.lm.name if sched.engine is not None else "fusionrag"

    # -- cross-cutting --------------------------------------------------------------------

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable) -> Response:
        try:
            response = await call_next(request)
        except Exception as exc:  # the last line of defence: never a bare 500 page or a crash
            response = as_api_error(exc).response()
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
            chat = parse_chat(await read_json(request, s.max_body_bytes), s)
            ensure_ready()
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[Event] = asyncio.Queue()

            def listener(ev: Event) -> None:
                loop.call_soon_threadsafe(events.put_nowait, ev)

            req = sched.submit(chat.question, max_new_tokens=chat.max_tokens, listener=listener,
                               **chat.prepare_kwargs())
        except Exception as exc:
            return as_api_error(exc).response()
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
            return as_api_error(first.error).response()
        if chat.stream:
            return StreamingResponse(
                sse_stream(req, first, events, completion_id, created, name, chat, metrics.observe_answer,
                           s.request_timeout_s),
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
            return as_api_error(ev.error).response()
        metrics.observe_answer(req)
        return JSONResponse(completion_json(req, ev, completion_id, created, name))

    # -- documents --------------------------------------------------------------------------

    @app.post("/v1/documents")
    async def add_documents(request: Request) -> Response:
        try:
            check_auth(request)
            body = await read_json(request, s.max_body_bytes)
            items = body.get("documents") if isinstance(body, dict) else body
            docs = parse_documents(items, s, "documents")
            ensure_ready()
            if jobs.counts().get("pending", 0) + jobs.counts().get("running", 0) >= s.max_document_jobs:
                raise APIError(429, f"too many document jobs in progress (limit {s.max_document_jobs})",
                               "rate_limit_error", "queue_full")
            job = DocumentJob(uuid.uuid4().hex, docs)
            jobs.remember(job)
            sched.run_task(run_document_job, sched.engine, job, s)
        except Exception as exc:
            return as_api_error(exc).response()
        return JSONResponse(job.to_json(), status_code=202)

    def get_job(job_id: str) -> DocumentJob:
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
            return as_api_error(exc).response()

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
                await asyncio.wrap_future(sched.run_task(delete_document_job, sched.engine, job))
            job.status = "deleted"
            return JSONResponse(job.to_json())
        except Exception as exc:
            return as_api_error(exc).response()

    # -- service ----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except Exception as exc:
            return as_api_error(exc).response()
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
            return as_api_error(exc).response()
        return PlainTextResponse(metrics.render(sched, jobs.counts()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
