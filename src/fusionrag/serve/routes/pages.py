"""Pages for people: ``GET /v1/explain/{request_id}`` (which tokens were recomputed) and ``GET /ui``."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse

from fusionrag.online.explain import render_explain_html
from fusionrag.online.methods import methods
from fusionrag.serve.api_errors import APIError
from fusionrag.serve.state import State, require_api_key
from fusionrag.serve.ui import ui_page

router = APIRouter()


@router.get("/v1/explain/{request_id}", dependencies=[Depends(require_api_key)])
async def explain(request_id: str, server: State) -> HTMLResponse:
    found = server.recent.get(request_id)
    if found is None:
        raise APIError(404, f"no recent answer '{request_id}' (the server keeps the last "
                            f"{server.settings.explain_keep})", code="not_found")
    question, answer = found
    return HTMLResponse(render_explain_html(answer, question, server.engine.lm.tokenizer, answer.chunk_token_ids))


@router.get("/ui")
async def ui(server: State) -> HTMLResponse:
    s = server.settings
    return HTMLResponse(ui_page(methods(), s.default_method, s.default_ratio, bool(s.api_key)))
