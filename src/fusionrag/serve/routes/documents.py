"""``/v1/documents``: add documents in the background (jobs), list them, look one up, delete one."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from fusionrag.serve.api_errors import APIError
from fusionrag.serve.bodies import parse_documents, read_json
from fusionrag.serve.documents import DocumentJob, check_job_size, document_json
from fusionrag.serve.schemas import DocumentsRequest, body_schema
from fusionrag.serve.state import ServerState, State, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/documents", openapi_extra=body_schema(DocumentsRequest))
async def add_documents(request: Request, server: State) -> JSONResponse:
    s, jobs = server.settings, server.jobs
    body = await read_json(request, s.max_body_bytes)
    if isinstance(body, dict) and set(body) - {"documents"}:
        unknown = sorted(set(body) - {"documents"})
        raise APIError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; send a list of {{title, text}} or "
                            "{\"documents\": [...]}", code="unsupported_parameter", param=unknown[0])
    items = body.get("documents") if isinstance(body, dict) else body
    docs = parse_documents(items, s, "documents")
    server.ensure_ready()
    server.writable()
    if len(jobs.in_progress()) >= s.max_document_jobs:
        raise APIError(429, f"too many document jobs in progress (limit {s.max_document_jobs})",
                       "rate_limit_error", "queue_full")
    await asyncio.to_thread(check_job_size, server.engine, docs, s)
    job = DocumentJob(uuid.uuid4().hex, docs)
    jobs.start(server.scheduler, job)
    return JSONResponse(job.to_json(), status_code=202)


@router.get("/v1/documents")
async def list_documents(server: State) -> JSONResponse:
    server.ensure_ready()
    if server.engine.store is None:
        return JSONResponse({"object": "list", "data": []})
    docs = await asyncio.to_thread(server.engine.store.documents.all)
    return JSONResponse({"object": "list", "data": [document_json(d) for d in docs]})


@router.get("/v1/documents/{job_id:path}")
async def document_status(job_id: str, server: State) -> JSONResponse:
    job = server.jobs.get(job_id)
    return JSONResponse(job.to_json() if job is not None else document_json(await _stored_document(server, job_id)))


@router.delete("/v1/documents/{job_id:path}")
async def delete_documents(job_id: str, server: State) -> JSONResponse:
    """A job id deletes that job's documents; any other id deletes the stored document of that id."""
    jobs, sched = server.jobs, server.scheduler
    job = jobs.get(job_id)
    if job is not None and job.status in ("pending", "running"):
        raise APIError(409, f"document job '{job_id}' is still {job.status}; delete it once it is ready",
                       code="conflict")
    if job is not None and job.status == "deleted":
        return JSONResponse(job.to_json())
    if job is None:
        await _stored_document(server, job_id)
    _no_job_in_progress(server)
    server.writable()
    if job is None:
        return JSONResponse(await asyncio.wrap_future(jobs.delete_document(sched, job_id)))
    if job.status in ("ready", "failed"):  # a failed job may have added some passages: remove them too
        await asyncio.wrap_future(jobs.delete(sched, job))
    job.status = "deleted"
    return JSONResponse(job.to_json())


def _no_job_in_progress(server: ServerState) -> None:
    """A delete re-fuses what the removal made stale, which while a job runs includes the job's own new chunks:
    the call would hold its connection for the job's whole preprocessing. It is refused at once instead (409),
    naming the job to wait for, and nothing is removed."""
    busy = server.jobs.in_progress()
    if busy:
        raise APIError(409, f"document job '{busy[0].id}' is {busy[0].status}; delete once it is ready (GET "
                            f"/v1/documents/{busy[0].id}); nothing was deleted", code="conflict")


async def _stored_document(server: ServerState, doc_id: str) -> Any:
    """The store's document of that id (a file's path, a posted id, ``api:JOB``), or a 404."""
    server.ensure_ready()
    server.has_store()
    found = await asyncio.to_thread(server.engine.store.documents.get, doc_id)
    if found is None:
        raise APIError(404, f"no document job and no document '{doc_id}'", code="not_found")
    return found
