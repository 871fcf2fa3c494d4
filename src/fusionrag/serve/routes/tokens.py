"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, in vLLM's shapes.

A prompt is tokenized as a raw ``/v1/completions`` prompt prefills it; messages through the model's
chat template, as vLLM does. That is not the prompt a chat completion here prefills: fusionrag's
prompt is the store's (``S``, the passages, the question segment), whose length each answer's
``usage.prompt_tokens`` reports. Keyed like the ``/v1`` routes (vLLM keys ``/v1`` only): both run
the tokenizer on a request body and name the vocabulary.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from fusionrag.prompt import chat_prompt_ids
from fusionrag.serve.api_errors import APIError
from fusionrag.serve.bodies import parse_detokenize, parse_tokenize, read_json
from fusionrag.serve.protocol import message_text
from fusionrag.serve.schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest, body_schema
from fusionrag.serve.state import State, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
async def tokenize(request: Request, server: State) -> JSONResponse:
    body = await read_json(request, server.settings.max_body_bytes)
    req = parse_tokenize(body)
    server.check_model(req.model)
    server.ensure_ready()
    tokenizer = server.engine.lm.tokenizer
    ids = await asyncio.to_thread(_token_ids, tokenizer, req)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": server.settings.max_prompt_tokens, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


@router.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
async def detokenize(request: Request, server: State) -> JSONResponse:
    body = await read_json(request, server.settings.max_body_bytes)
    server.ensure_ready()
    tokenizer = server.engine.lm.tokenizer
    req = parse_detokenize(body, len(tokenizer))
    server.check_model(req.model)
    return JSONResponse({"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)})


def _token_ids(tokenizer: Any, req: Any) -> list[int]:
    if not isinstance(req, TokenizeChatRequest):
        return list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    messages = [{"role": m.role, "content": message_text(m.content)} for m in req.messages]
    ids = chat_prompt_ids(tokenizer, messages, req.add_generation_prompt, req.add_special_tokens,
                          req.chat_template_kwargs)
    if ids is None:
        raise APIError(400, "the served model has no chat template: tokenize a 'prompt' instead",
                       code="invalid_value", param="messages")
    return ids
