"""``POST /v1/retrieve``: the store's chunks for a query, as passages a request can send back unchanged."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from fusionrag.serve.bodies import parse_retrieve, read_json
from fusionrag.serve.schemas import RetrieveRequest, body_schema
from fusionrag.serve.state import State, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/retrieve", openapi_extra=body_schema(RetrieveRequest))
async def retrieve(request: Request, server: State) -> JSONResponse:
    body = await read_json(request, server.settings.max_body_bytes)
    req = parse_retrieve(body, server.settings)
    server.ensure_ready()
    server.has_store()
    hits = await asyncio.to_thread(_retrieve, server.engine, req.query, req.top_k)
    return JSONResponse({"object": "list", "data": hits})


def _retrieve(engine: Any, query: str, top_k: int | None) -> list[dict]:
    """The store's chunks for ``query``, after taking in another process's changes (a CLI ingest or delete)."""
    engine.follow_store()
    return engine.store.retrieve(query, top_k)
