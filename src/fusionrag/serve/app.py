"""The HTTP server: OpenAI-compatible chat and text completions answering with RAG over a knowledge store.

``create_app(engine, settings)`` builds a FastAPI app around an engine (or a factory that
builds one on the model thread, see :mod:`fusionrag.serve.batching`). Routes:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's bodies
  (:mod:`fusionrag.serve.schemas`; unknown fields are a 400), sampling (``temperature``,
  ``top_p``, ``sample_top_k``, ``seed``, ``stop``, ``logprobs``), streaming as server-sent
  events. The last user message (or the prompt) is the question; system messages and
  earlier turns go into the question segment. Passages: ``documents`` (``[{title, text}]``)
  or ``<document title="...">`` blocks in the message, used instead of retrieval. Extra
  fields: ``method``, ``ratio``, ``top_k`` (retrieval depth), ``kv``. The response has
  ``usage`` (with ``usage.fusionrag``: reused chunks and tokens) and a ``fusionrag`` object
  (TTFT breakdown, recomputed tokens, queueing, the ``request_id``).
- ``GET /v1/explain/{request_id}``: which tokens of a recent answer were recomputed (HTML);
  ``GET /ui``: a page to ask questions and see the answer, TTFT breakdown and selection.
- ``POST /v1/documents`` (a list of ``{title, text, source?, id?}`` or ``{"documents": [...]}``):
  added to the store in the background (an ``id`` names the document: the same id again replaces
  it); ``GET /v1/documents`` lists the store's documents; ``GET/DELETE /v1/documents/{id}`` take a
  job id or a document id.
- ``GET /v1/models``, ``GET /health`` (liveness: ``degraded`` when the model thread is
  stuck), ``GET /ready`` (readiness: the model is loaded and the queue has room) and
  ``GET /metrics`` (Prometheus, vLLM's metric names; :mod:`fusionrag.serve.metrics`).

Every error is JSON in OpenAI's shape ``{"error": {"message", "type", "code", "param"}}``
with a 4xx status for bad input and never takes the server down: handlers catch everything.
Engine work never runs on the event loop: it runs on the scheduler's model thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fusionrag.online.explain import render_explain_html
from fusionrag.online.methods import methods
from fusionrag.serve.batching import BatchScheduler
from fusionrag.serve.documents import DocumentJob, DocumentJobs, check_job_size, document_json
from fusionrag.serve.generation import RecentAnswers, Server, generate
from fusionrag.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fusionrag.serve.metrics import Metrics
from fusionrag.serve.protocol import (
    APIError,
    GenerateRequest,
    as_api_error,
    error_response,
    parse_chat,
    parse_completion,
    parse_documents,
    parse_retrieve,
    read_json,
)
from fusionrag.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DocumentsRequest,
    RetrieveRequest,
    body_schema,
    component_schemas,
)
from fusionrag.serve.settings import ServerSettings
from fusionrag.serve.ui import ui_page


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
    jobs = DocumentJobs(s)
    jobs.resume(sched)  # jobs a previous server left unfinished (runs once the engine is loaded)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(sched.close)

    app = FastAPI(title="FusionRAG", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)

    def served_names() -> list[str]:
        """The names clients may ask for (the first is reported): ``--served-model-name``, else the model's."""
        if s.served_model_name:
            return list(s.served_model_name)
        return [sched.engine.lm.name if sched.engine is not None else "fusionrag"]

    def model_name() -> str:
        return served_names()[0]

    def check_model(name: str | None) -> None:
        """vLLM's habit: a ``model`` the server does not serve is a 404 (absent means the served one)."""
        if name is not None and name not in served_names():
            raise APIError(404, f"the model '{name}' does not exist on this server (it serves "
                                f"{', '.join(map(repr, served_names()))}; see GET /v1/models)",
                           "invalid_request_error", "model_not_found", "model")

    metrics = Metrics(model_name, sched, jobs.counts)
    app.state.scheduler = sched
    app.state.settings = s
    app.state.metrics = metrics
    app.state.jobs = jobs

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
        return error_response(400, f"invalid request: {exc.errors()}", "invalid_request_error", "invalid_value")

    def check_auth(request: Request) -> None:
        if not s.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), s.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", "invalid_api_key")

    def has_store() -> None:
        if sched.engine is not None and sched.engine.store is None:
            raise APIError(409, "this server has no knowledge store (started without --store): send passages "
                                "with each request, or start it with --store DIR", code="no_store")

    def writable() -> None:
        """Document jobs change the store: a store opened read-only refuses them (chats still work)."""
        has_store()
        if sched.engine is not None and getattr(sched.engine.store, "read_only", False):
            raise APIError(409, "the store is read-only (read-only media or no write permission): documents cannot "
                                "be added or deleted; questions are answered as usual", code="read_only_store")

    def ensure_ready() -> None:
        if sched.load_error is not None:
            raise APIError(503, f"the model failed to load: {sched.load_error}", "server_error", "unavailable")
        if not sched.ready:
            raise APIError(503, "the model is still loading; retry shortly", "server_error", "loading")

    server = Server(sched, s, metrics, model_name, check_auth, ensure_ready, RecentAnswers(s.explain_keep),
                    check_model)

    # -- completions ------------------------------------------------------------------------

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await generate(server, request, True, parse_chat)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        def parse(body: Any, settings: ServerSettings) -> GenerateRequest:
            tokenizer = sched.engine.lm.tokenizer
            return parse_completion(body, settings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                    len(tokenizer))

        return await generate(server, request, False, parse)

    @app.get("/v1/explain/{request_id}")
    async def explain(request_id: str, request: Request) -> Response:
        try:
            check_auth(request)
            found = server.recent.get(request_id)
            if found is None:
                raise APIError(404, f"no recent answer '{request_id}' (the server keeps the last "
                                    f"{s.explain_keep})", code="not_found")
            question, answer = found
            page = render_explain_html(answer, question, sched.engine.lm.tokenizer, answer.chunk_token_ids)
        except Exception as exc:
            return as_api_error(exc).response()
        return HTMLResponse(page)

    @app.get("/ui")
    async def ui() -> Response:
        return HTMLResponse(ui_page(methods(), s.default_method, s.default_ratio, bool(s.api_key)))

    # -- retrieval --------------------------------------------------------------------------

    @app.post("/v1/retrieve", openapi_extra=body_schema(RetrieveRequest))
    async def retrieve(request: Request) -> Response:
        """The store's chunks for a query, as passages a request can send back (``documents``) unchanged."""
        try:
            check_auth(request)
            body = await read_json(request, s.max_body_bytes)
            req = parse_retrieve(body, s)
            ensure_ready()
            has_store()
            hits = await asyncio.to_thread(_retrieve, sched.engine, req.query, req.top_k)
        except Exception as exc:
            return as_api_error(exc).response()
        return JSONResponse({"object": "list", "data": hits})

    # -- documents --------------------------------------------------------------------------

    @app.post("/v1/documents", openapi_extra=body_schema(DocumentsRequest))
    async def add_documents(request: Request) -> Response:
        try:
            check_auth(request)
            body = await read_json(request, s.max_body_bytes)
            if isinstance(body, dict) and set(body) - {"documents"}:
                raise APIError(400, f"unknown field(s) {', '.join(map(repr, sorted(set(body) - {'documents'})))}; "
                                    "send a list of {title, text} or {\"documents\": [...]}",
                               code="unsupported_parameter", param=sorted(set(body) - {"documents"})[0])
            items = body.get("documents") if isinstance(body, dict) else body
            docs = parse_documents(items, s, "documents")
            ensure_ready()
            writable()
            if jobs.counts().get("pending", 0) + jobs.counts().get("running", 0) >= s.max_document_jobs:
                raise APIError(429, f"too many document jobs in progress (limit {s.max_document_jobs})",
                               "rate_limit_error", "queue_full")
            await asyncio.to_thread(check_job_size, sched.engine, docs, s)
            job = DocumentJob(uuid.uuid4().hex, docs)
            jobs.start(sched, job)
        except Exception as exc:
            return as_api_error(exc).response()
        return JSONResponse(job.to_json(), status_code=202)

    async def stored_document(doc_id: str) -> Any:
        """The store's document of that id (a file's path, a posted id, ``api:JOB``), or a 404."""
        ensure_ready()
        has_store()
        found = await asyncio.to_thread(sched.engine.store.document, doc_id)
        if found is None:
            raise APIError(404, f"no document job and no document '{doc_id}'", code="not_found")
        return found

    @app.get("/v1/documents")
    async def list_documents(request: Request) -> Response:
        try:
            check_auth(request)
            ensure_ready()
            if sched.engine.store is None:
                return JSONResponse({"object": "list", "data": []})
            docs = await asyncio.to_thread(sched.engine.store.documents)
            return JSONResponse({"object": "list", "data": [document_json(d) for d in docs]})
        except Exception as exc:
            return as_api_error(exc).response()

    @app.get("/v1/documents/{job_id:path}")
    async def document_status(job_id: str, request: Request) -> Response:
        try:
            check_auth(request)
            job = jobs.get(job_id)
            return JSONResponse(job.to_json() if job is not None else document_json(await stored_document(job_id)))
        except Exception as exc:
            return as_api_error(exc).response()

    @app.delete("/v1/documents/{job_id:path}")
    async def delete_documents(job_id: str, request: Request) -> Response:
        """A job id deletes that job's documents; any other id deletes the stored document of that id."""
        try:
            check_auth(request)
            job = jobs.get(job_id)
            if job is None:
                await stored_document(job_id)
                writable()
                return JSONResponse(await asyncio.wrap_future(jobs.delete_document(sched, job_id)))
            if job.status in ("pending", "running"):
                raise APIError(409, f"document job '{job_id}' is still {job.status}; delete it once it is ready",
                               code="conflict")
            if job.status == "deleted":
                return JSONResponse(job.to_json())
            writable()
            if job.status in ("ready", "failed"):  # a failed job may have added some passages: remove them too
                await asyncio.wrap_future(jobs.delete(sched, job))
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
            {"id": name, "object": "model", "created": 0, "owned_by": "fusionrag", "root": name, "parent": None}
            for name in served_names()]})

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 'degraded' (503) once the busy model thread has finished nothing for ``stall_after_s``."""
        stalled = sched.stalled_s()
        if sched.load_error is not None:
            status, code = "error", 503
        elif not sched.ready:
            status, code = "loading", 503
        elif not sched.alive or stalled > s.stall_after_s:
            status, code = "degraded", 503
        else:
            status, code = "ok", 200
        body = {"status": status, "model": model_name(), "queue_length": sched.queue_length,
                "active_requests": sched.active, "max_batch": s.max_batch, "max_queue": s.max_queue,
                "model_thread_stalled_s": round(stalled, 3)}
        if sched.load_error is not None:
            body["error"] = str(sched.load_error)
        return JSONResponse(body, status_code=code)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness (apart from liveness): send traffic only when the model is loaded and the queue has room."""
        reasons = []
        if not sched.ready:
            reasons.append("the model failed to load" if sched.load_error is not None else "the model is loading")
        elif not sched.alive:
            reasons.append("the model thread has stopped")
        if sched.queue_length >= s.max_queue:
            reasons.append(f"the queue is full ({sched.queue_length} waiting)")
        body = {"ready": not reasons, "reasons": reasons, "queue_length": sched.queue_length}
        return JSONResponse(body, status_code=200 if not reasons else 503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        """Open by default (vLLM's habit: a Prometheus scrape sends no token); ``metrics_need_key`` keys it."""
        try:
            if s.metrics_need_key:
                check_auth(request)
        except Exception as exc:
            return as_api_error(exc).response()
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the nested models of the bodies the routes read themselves."""
        if app.openapi_schema is None:
            spec = default_openapi()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(
                component_schemas(ChatCompletionRequest, CompletionRequest, DocumentsRequest, RetrieveRequest))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _retrieve(engine: Any, query: str, top_k: int | None) -> list[dict]:
    """The store's chunks for ``query``, after taking in another process's changes (a CLI ingest or delete)."""
    engine.follow_store()
    return engine.store.retrieve(query, top_k)
