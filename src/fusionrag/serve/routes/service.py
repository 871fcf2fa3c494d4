"""The service's own routes: ``GET /v1/models`` and ``/v1/models/{id}`` (keyed), ``/health``, ``/ready``,
``/version`` and ``/metrics`` (open, as in vLLM)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from fusionrag.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fusionrag.serve.state import State, check_api_key, require_api_key
from fusionrag.version import __version__

keyed = APIRouter(dependencies=[Depends(require_api_key)])
open_router = APIRouter()


@keyed.get("/v1/models")
async def models(server: State) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_card(name) for name in server.served_names()]})


@keyed.get("/v1/models/{model_id:path}")
async def model(model_id: str, server: State) -> JSONResponse:
    """One served model's card (``client.models.retrieve``); another id is a 404 ``model_not_found``."""
    server.check_model(model_id)
    return JSONResponse(_card(model_id))


def _card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "fusionrag", "root": name, "parent": None}


@open_router.get("/version")
async def version() -> JSONResponse:
    """The package's version, as vLLM's ``/version`` (open: it names no data)."""
    return JSONResponse({"version": __version__})


@open_router.get("/health")
async def health(server: State) -> JSONResponse:
    """Liveness: 'degraded' (503) once the busy model thread has finished nothing for ``stall_after_s``."""
    sched, s = server.scheduler, server.settings
    stalled = sched.stalled_s()
    if sched.load_error is not None:
        status, code = "error", 503
    elif not sched.ready:
        status, code = "loading", 503
    elif not sched.alive or stalled > s.stall_after_s:
        status, code = "degraded", 503
    else:
        status, code = "ok", 200
    body = {"status": status, "model": server.model_name(), "queue_length": sched.queue_length,
            "active_requests": sched.active, "max_batch": s.max_batch, "max_queue": s.max_queue,
            "model_thread_stalled_s": round(stalled, 3)}
    if sched.load_error is not None:
        body["error"] = str(sched.load_error)
    return JSONResponse(body, status_code=code)


@open_router.get("/ready")
async def ready(server: State) -> JSONResponse:
    """Readiness (apart from liveness): send traffic only when the model is loaded and the queue has room."""
    sched = server.scheduler
    reasons = []
    if not sched.ready:
        reasons.append("the model failed to load" if sched.load_error is not None else "the model is loading")
    elif not sched.alive:
        reasons.append("the model thread has stopped")
    if sched.queue_length >= server.settings.max_queue:
        reasons.append(f"the queue is full ({sched.queue_length} waiting)")
    body = {"ready": not reasons, "reasons": reasons, "queue_length": sched.queue_length}
    return JSONResponse(body, status_code=200 if not reasons else 503)


@open_router.get("/metrics")
async def prometheus(request: Request, server: State) -> Response:
    """Open by default (vLLM's habit: a Prometheus scrape sends no token); ``metrics_need_key`` keys it."""
    if server.settings.metrics_need_key:
        check_api_key(server.settings, request)
    return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)
