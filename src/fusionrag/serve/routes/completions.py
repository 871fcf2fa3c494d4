"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one generation handler, two body parsers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from fusionrag.prompt import chat_prompt_ids
from fusionrag.serve.generation import generate
from fusionrag.serve.protocol import Parsed, parse_chat, parse_completion
from fusionrag.serve.schemas import ChatCompletionRequest, CompletionRequest, body_schema
from fusionrag.serve.settings import ServerSettings
from fusionrag.serve.state import State, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request, server: State) -> Response:
    tokenizer = server.engine.lm.tokenizer if server.engine is not None else None

    def parse(body: Any, settings: ServerSettings) -> Parsed:
        return parse_chat(body, settings, None if tokenizer is None else
                          lambda m, kw=None: chat_prompt_ids(tokenizer, m, template_kwargs=kw))

    return await generate(server, request, True, parse)


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request, server: State) -> Response:
    tokenizer = server.engine.lm.tokenizer

    def parse(body: Any, settings: ServerSettings) -> Parsed:
        return parse_completion(body, settings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                len(tokenizer))

    return await generate(server, request, False, parse)
