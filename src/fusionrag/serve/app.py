"""The HTTP server: OpenAI-compatible chat and text completions answering with RAG over a knowledge store.

``create_app(engine, settings)`` builds a FastAPI app around an engine (or a factory that
builds one on the model thread, see :mod:`fusionrag.online.scheduler`). Routes:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's bodies
  (:mod:`fusionrag.serve.schemas`; unknown fields are a 400), sampling with vLLM's names
  (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop``,
  ``logprobs``), streaming as server-sent events. In chat the last user message is the question;
  system messages and earlier turns go into the question segment. A text completion continues
  its prompt as it is (no template), unless it brings passages or asks for retrieval. Passages:
  ``documents`` (``[{title, text}]``) or ``<document title="...">`` blocks in the message, used
  instead of retrieval. Extra fields: ``method``, ``ratio``, ``retrieval_top_k`` (retrieval
  depth), ``retrieval``, ``kv``. The response has ``usage`` (with ``usage.fusionrag``: reused
  chunks and tokens) and a ``fusionrag`` object (TTFT breakdown, recomputed tokens, queueing,
  the ``request_id``).
- ``POST /tokenize``, ``POST /detokenize`` (vLLM's bodies), ``GET /version``.
- ``GET /v1/explain/{request_id}``: which tokens of a recent answer were recomputed (HTML);
  ``GET /ui``: a page to ask questions and see the answer, TTFT breakdown and selection.
- ``POST /v1/documents`` (a list of ``{title, text, source?, id?}`` or ``{"documents": [...]}``):
  added to the store in the background (an ``id`` names the document: the same id again replaces
  it); ``GET /v1/documents`` lists the store's documents; ``GET/DELETE /v1/documents/{id}`` take a
  job id or a document id.
- ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (liveness: ``degraded`` when the model thread is
  stuck), ``GET /ready`` (readiness: the model is loaded and the queue has room) and
  ``GET /metrics`` (Prometheus, vLLM's metric names; :mod:`fusionrag.serve.metrics`).

The routes are module-level routers (:mod:`fusionrag.serve.routes`) sharing one
:class:`~fusionrag.serve.state.ServerState`; the API key is one dependency. Every error is JSON in
OpenAI's shape ``{"error": {"message", "type", "code", "param"}}`` with a 4xx status for bad input
and never takes the server down: routes raise, :mod:`fusionrag.serve.api_errors` answers, in one
place. Engine work never runs on the event loop: it runs on the scheduler's model thread. Every
request is one line on the ``fusionrag.access`` logger (:mod:`fusionrag.serve.access_log`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from fusionrag.online.scheduler import BatchScheduler
from fusionrag.serve.access_log import AccessLog
from fusionrag.serve.api_errors import install_error_handlers
from fusionrag.serve.documents import DocumentJobs
from fusionrag.serve.routes import ROUTERS
from fusionrag.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DocumentsRequest,
    RetrieveRequest,
    TokenizeRequest,
    component_schemas,
)
from fusionrag.serve.settings import ServerSettings
from fusionrag.serve.state import ServerState
from fusionrag.version import __version__


def create_app(engine: Any, settings: ServerSettings | None = None,
               scheduler: BatchScheduler | None = None) -> FastAPI:
    """The server around ``engine`` (an ``Engine`` or a zero-argument factory run on the model thread).

    Pass a factory when the store holds thread-bound resources (``KnowledgeStore``'s SQLite
    connection): built on the model thread, every store access stays on that thread.
    ``scheduler`` lets tests inject their own :class:`BatchScheduler`.
    """
    s = settings or ServerSettings()
    sched = scheduler or BatchScheduler(engine, max_batch=s.max_batch, max_queue=s.max_queue,
                                        max_prompt_tokens=s.max_prompt_tokens,
                                        step_tokens=s.max_num_batched_tokens or None)
    jobs = DocumentJobs(s)
    jobs.resume(sched)  # jobs a previous server left unfinished (runs once the engine is loaded)
    sched.run_task(_index_chunks, sched)
    state = ServerState(s, sched, jobs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(sched.close)

    app = FastAPI(title="FusionRAG", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.fusionrag = state
    app.state.scheduler, app.state.settings, app.state.metrics, app.state.jobs = sched, s, state.metrics, jobs
    install_error_handlers(app, state.metrics.count_request)
    app.add_middleware(AccessLog)  # outermost: the status the client gets, the whole (streamed) response
    for router in ROUTERS:
        app.include_router(router)
    _document_nested_bodies(app)
    return app


def _index_chunks(sched: BatchScheduler) -> None:
    """Build the store's chunk locator at start, before a request needs it: the first prompt that places no
    passages would otherwise wait for every chunk to be read (7.8 s at 100K chunks, benchmarks/vllm/results/locator)."""
    store = getattr(sched.engine, "store", None)
    if store is not None:
        len(store.locator)


def _document_nested_bodies(app: FastAPI) -> None:
    """FastAPI's OpenAPI document, plus the nested models of the bodies the routes read themselves."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = default_openapi()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(
                component_schemas(ChatCompletionRequest, CompletionRequest, DocumentsRequest, RetrieveRequest,
                                  TokenizeRequest, DetokenizeRequest))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
