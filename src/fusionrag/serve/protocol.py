"""The OpenAI-shaped wire protocol: errors, request validation, response bodies and the SSE stream.

Kept apart from the routes so that what a client may send and what it gets back is in one
place, testable without a model. Every error is JSON in OpenAI's shape
``{"error": {"message", "type", "code", "param"}}``; bad input is a 4xx, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from fusionrag.errors import FusionRAGError
from fusionrag.online.policies import METHODS
from fusionrag.serve.requests import (
    DecodeRequest,
    Event,
    PromptTooLongError,
    QueueFullError,
    RequestCancelledError,
    SchedulerClosedError,
)
from fusionrag.serve.settings import ServerSettings

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- errors


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
    """The JSON error body (401 also says which scheme to use, as HTTP asks)."""
    body = {"error": {"message": message, "type": type_, "code": code, "param": param}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def as_api_error(exc: BaseException) -> APIError:
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


# ---------------------------------------------------------------------------------- requests


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, refusing more than ``max_bytes`` before reading it all (413)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise APIError(413, f"request body too large: {declared} bytes (limit {max_bytes})",
                               code="body_too_large")
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body too large (limit {max_bytes} bytes)", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad encoding, absurd nesting
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None


@dataclass
class ChatRequest:
    """A validated chat-completions request: the question and how to answer it."""

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

    def prepare_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.prepare``; options the client left out keep the engine's defaults."""
        kwargs: dict[str, Any] = {"method": self.method, "ratio": self.ratio}
        if self.top_k is not None:
            kwargs["top_k"] = self.top_k
        if self.kv is not None:
            kwargs["kv"] = self.kv
        if self.documents is not None:
            kwargs["chunks"] = self.documents
        return kwargs


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


# ---------------------------------------------------------------------------------- responses


def usage_json(req: DecodeRequest) -> dict[str, int]:
    """OpenAI's ``usage`` object of a finished request."""
    done = len(req.tokens)
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": done, "total_tokens": req.prompt_tokens + done}


def fusionrag_json(req: DecodeRequest) -> dict[str, Any]:
    """The ``fusionrag`` extension object: the engine's TTFT breakdown plus the server's queueing view."""
    out = req.answer.to_json()
    out.pop("answer", None)  # already the message content
    out["server"] = {
        "queue_ms": round(req.queue_ms, 2),
        "ttft_ms": None if req.ttft_ms is None else round(req.ttft_ms, 2),
        "latency_ms": None if req.finished_at is None else round((req.finished_at - req.submitted_at) * 1000.0, 2),
    }
    return out


def completion_json(req: DecodeRequest, done: Event, completion_id: str, created: int, model: str) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` body of a request that ended with the ``done`` event."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": done.answer.text},
                     "finish_reason": done.finish_reason, "logprobs": None}],
        "usage": usage_json(req),
        "fusionrag": fusionrag_json(req),
    }


def _chunk(completion_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
           **extra: Any) -> str:
    body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
    return f"data: {json.dumps(body)}\n\n"


async def sse_stream(req: DecodeRequest, first: Event, events: asyncio.Queue, completion_id: str, created: int,
                     model: str, chat: ChatRequest, on_done: Callable[[DecodeRequest], None],
                     timeout: float) -> AsyncIterator[str]:
    """OpenAI chunk stream: role + first text, text deltas, a final chunk, optional usage, ``[DONE]``.

    ``on_done(req)`` runs once the answer is complete (the metrics count only finished answers).
    """
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
            err = as_api_error(ev.error)
            finished = True
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'code': err.code}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        finished = True
        on_done(req)
        if not role_sent:
            yield _chunk(completion_id, created, model, {"role": "assistant", "content": ""})
        yield _chunk(completion_id, created, model, {}, ev.finish_reason, fusionrag=fusionrag_json(req))
        if chat.include_usage:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": usage_json(req)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except TimeoutError:
        yield f"data: {json.dumps({'error': {'message': 'generation timed out', 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client disconnected or we timed out: free the batch slot
            req.cancel()
