"""Every route's request body: read within its size, parsed as JSON, its texts checked, validated.

What a client may send, before any route reads it: the size (413 before reading more), JSON (400), every
string valid Unicode (checked once per request, here: a lone surrogate JSON can carry reaches no tokenizer),
the body's schema (:mod:`fusionrag.serve.schemas`), passages (``documents``, ``<document>`` blocks) and token
ids checked against the server's limits and the vocabulary. The completion routes turn a checked body into
the engine's request in :mod:`fusionrag.serve.protocol`; errors are :class:`~fusionrag.serve.api_errors.APIError`.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ValidationError

from fusionrag.online.request import DEFAULT_TOP_K
from fusionrag.prompt import is_valid_text
from fusionrag.retrieval.stored_docs import identity_problem
from fusionrag.serve.api_errors import APIError
from fusionrag.serve.schemas import (
    DetokenizeRequest,
    RetrieveRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    validation_error,
)
from fusionrag.serve.settings import ServerSettings


async def read_json(request: HTTPRequest, max_bytes: int) -> Any:
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
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad encoding, absurd nesting
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from None
    check_text(body)  # the request's one Unicode check: every string of the body, at every door
    return body


def invalid_text_path(value: Any, path: str = "body") -> str | None:
    """Where ``value`` (parsed JSON) holds a string that is not valid Unicode (a lone surrogate such as
    ``\\ud800``, which JSON can encode and no tokenizer can read), or None."""
    if isinstance(value, str):
        return None if is_valid_text(value) else path
    if isinstance(value, dict):
        for k, v in value.items():
            found = invalid_text_path(k, path) or invalid_text_path(v, f"{path}.{k}" if path != "body" else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = invalid_text_path(v, f"{path}[{i}]")
            if found:
                return found
    return None


def check_text(body: Any) -> None:
    """A 400 naming the field if any string in the body is not valid Unicode."""
    where = invalid_text_path(body)
    if where is not None:
        raise APIError(400, f"'{where}' is not valid Unicode text (a lone surrogate?)", code="invalid_unicode",
                       param=where.split(".")[0].split("[")[0])


def validated(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, code, param = validation_error(exc)
        raise APIError(400, message, code=code, param=param) from None


DOCUMENT_KEYS = frozenset({"title", "text", "source", "id"})


def parse_documents(items: Any, s: ServerSettings, param: str, allow_empty: bool = False) -> list[dict]:
    """Validate ``[{title, text}]`` passages against the document limits (``allow_empty``: ``[]`` is no passages).

    As strict as a request's top level: an unknown key is a 400, not silently dropped. The same
    passage twice in one list is kept once (its KV would be computed and reused identically)."""
    if allow_empty and items == []:
        return []
    if not isinstance(items, list) or not items:
        raise APIError(400, f"'{param}' must be a non-empty list of {{title, text}} objects", code="invalid_value",
                       param=param)
    if len(items) > s.max_documents:
        raise APIError(413, f"too many documents: {len(items)} (limit {s.max_documents})", code="too_many_documents",
                       param=param)
    docs = []
    seen: set[tuple[str, str]] = set()
    for i, d in enumerate(items):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str) or not d["text"].strip():
            raise APIError(400, f"{param}[{i}] must be an object with a non-empty 'text' string",
                           code="invalid_value", param=param)
        unknown = sorted(set(d) - DOCUMENT_KEYS)
        if unknown:
            raise APIError(400, f"{param}[{i}]: unknown field(s) {', '.join(map(repr, unknown))}; a passage is "
                                "{title, text, source, id}", code="unsupported_parameter", param=param)
        title = d.get("title", "")
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise APIError(400, f"{param}[{i}].title must be a string", code="invalid_value", param=param)
        if len(d["text"]) + len(title) > s.max_document_chars:
            raise APIError(413, f"{param}[{i}] has {len(d['text']) + len(title)} characters "
                                f"(limit {s.max_document_chars})", code="document_too_large", param=param)
        for key in ("source", "id"):
            why = identity_problem(key, d[key]) if d.get(key) is not None else None
            if why:
                raise APIError(400, f"{param}[{i}].{key}: {why}", code="invalid_value", param=param)
        if (title, d["text"]) in seen:
            continue
        seen.add((title, d["text"]))
        docs.append({"title": title, "text": d["text"], **{k: d[k] for k in ("source", "id") if d.get(k) is not None}})
    return docs


#: The message convention for clients that cannot send extra fields (README, "Passages from the client").
DOCUMENT_TAG = re.compile(r'<document(?:\s+title="([^"<>]*)")?\s*>(.*?)</document>', re.DOTALL)


def split_documents(text: str, where: str) -> tuple[str, list[dict]]:
    """``<document title="...">text</document>`` blocks out of ``text``: (what is left, the passages).

    Anything that looks like the convention but is not well formed (an unclosed or nested
    tag, a stray ``</document>``) is refused rather than guessed at.
    """
    docs = [{"title": html.unescape(t or ""), "text": html.unescape(body).strip()}
            for t, body in DOCUMENT_TAG.findall(text)]
    rest = DOCUMENT_TAG.sub("", text)
    if "<document" in rest or "</document>" in rest:
        raise APIError(400, f"{where}: a <document> tag is not well formed (write "
                            '<document title="...">text</document>, one per passage, not nested)',
                       code="invalid_documents", param="messages")
    if any(not d["text"] for d in docs):
        raise APIError(400, f"{where}: a <document> block is empty", code="invalid_documents", param="messages")
    return rest.strip(), docs


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    """A 400 naming ``param`` when a token id lies outside the vocabulary (not a decode error later)."""
    hi = vocab_size if vocab_size is not None else 2**31
    bad = next((t for t in ids if not 0 <= t < hi), None)
    if bad is not None:
        raise APIError(400, f"'{param}' token id {bad} is outside the vocabulary (0..{hi - 1})",
                       code="invalid_value", param=param)


def parse_retrieve(body: Any, s: ServerSettings) -> RetrieveRequest:
    """A ``POST /v1/retrieve`` body ``{query, top_k?}``; top_k defaults to the engine's, bounded by the server's."""
    req = validated(RetrieveRequest, body)
    if not req.query.strip():
        raise APIError(400, "'query' is empty", code="empty_question", param="query")
    top_k = DEFAULT_TOP_K if req.top_k is None else req.top_k
    if top_k > s.max_top_k:
        raise APIError(400, f"'top_k' must be at most {s.max_top_k}, got {top_k}", code="invalid_value", param="top_k")
    return req.model_copy(update={"query": req.query.strip(), "top_k": top_k})


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``POST /tokenize`` body, vLLM's: ``{"prompt": ...}`` or ``{"messages": [...]}`` (with their options)."""
    chat = isinstance(body, dict) and "messages" in body
    return validated(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def parse_detokenize(body: Any, vocab_size: int) -> DetokenizeRequest:
    """A ``POST /detokenize`` body ``{"tokens": [...]}``: ids within the vocabulary."""
    req = validated(DetokenizeRequest, body)
    check_token_ids(req.tokens, vocab_size, "tokens")
    return req
