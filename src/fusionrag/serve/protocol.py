"""The OpenAI-shaped wire protocol: request validation, response bodies and the SSE stream.

Kept apart from the routes so that what a client may send is in one place, testable
without a model (the bodies are :mod:`fusionrag.serve.schemas`; what goes back is
:mod:`fusionrag.serve.responses`; errors and their statuses :mod:`fusionrag.serve.api_errors`).
Every error is JSON in OpenAI's shape ``{"error": {"message", "type", "code", "param"}}``; bad input is
a 4xx, never a crash.
"""

from __future__ import annotations

import html
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ValidationError

from fusionrag.online.constraints import spec_of
from fusionrag.online.request import DEFAULT_TOP_K, InvalidRequest, ReuseRequest
from fusionrag.online.sampling import SamplingParams
from fusionrag.online.state import Request
from fusionrag.prompt import conversation_preamble, is_valid_text
from fusionrag.retrieval.stored_docs import identity_problem
from fusionrag.serve.api_errors import APIError, as_api_error, error_response  # noqa: F401 (re-exported)
from fusionrag.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RetrieveRequest,
    TextPart,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    validation_error,
)
from fusionrag.serve.settings import ServerSettings

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- requests


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


def parse_retrieve(body: Any, s: ServerSettings) -> RetrieveRequest:
    """A ``POST /v1/retrieve`` body ``{query, top_k?}``; top_k defaults to the engine's, bounded by the server's."""
    req = validated(RetrieveRequest, body)
    if not req.query.strip():
        raise APIError(400, "'query' is empty", code="empty_question", param="query")
    top_k = DEFAULT_TOP_K if req.top_k is None else req.top_k
    if top_k > s.max_top_k:
        raise APIError(400, f"'top_k' must be at most {s.max_top_k}, got {top_k}", code="invalid_value", param="top_k")
    return req.model_copy(update={"query": req.query.strip(), "top_k": top_k})


@dataclass(frozen=True)
class Wire:
    """How an answer goes back over HTTP: streamed or not, usage in the stream, the model name the body named."""

    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    continuous_usage: bool = False  # usage in every chunk (vLLM's stream_options.continuous_usage_stats)
    n: int = 1  # answers to the one prompt (each its own choice, sampled with its own seed)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability, this many alternatives
    echo: bool = False  # text completions: the prompt before the answer


#: A parsed completion body: the engine's request, admitted here, and how its answer goes back.
Parsed = tuple[Request, Wire]


def validated(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, code, param = validation_error(exc)
        raise APIError(400, message, code=code, param=param) from None


#: Fields accepted only at the value that asks for nothing: (field, is it neutral, why anything else is refused).
NEUTRAL_ONLY: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("store", lambda v: v is False, "storing completions is not supported (only store: false)"),
    ("tools", lambda v: v == [], "tool calling is not supported (only tools: [])"),
    ("tool_choice", lambda v: v == "none", 'tool calling is not supported (only tool_choice: "none")'),
    ("parallel_tool_calls", lambda v: v is False, "tool calling is not supported (only parallel_tool_calls: false)"),
)

#: The same for a message's fields: what an assistant turn read back from a response carries (the openai SDK's
#: ``message.model_dump()``), accepted when empty.
NEUTRAL_IN_MESSAGE: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("tool_calls", lambda v: v == [], "tool calls are not supported (only [] or null)"),
    ("refusal", lambda v: False, "only null is supported"),
    ("function_call", lambda v: False, "function calling is not supported (only null)"),
    ("audio", lambda v: False, "audio is not supported (only null)"),
    ("annotations", lambda v: v == [], "only [] or null is supported"),
)


def check_neutral(req: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the first field set to anything but its neutral value (None, i.e. absent, is fine)."""
    for name, neutral, why in NEUTRAL_ONLY:
        value = getattr(req, name, None)
        if value is not None and not neutral(value):
            raise APIError(400, f"'{name}': {why}", code="unsupported_parameter", param=name)
    for i, message in enumerate(getattr(req, "messages", ())):
        for name, neutral, why in NEUTRAL_IN_MESSAGE:
            value = getattr(message, name)
            if value is not None and not neutral(value):
                raise APIError(400, f"'messages[{i}].{name}': {why}", code="unsupported_parameter", param="messages")


def sampling_top_k(req: ChatCompletionRequest | CompletionRequest) -> int:
    """The sampling top-k: ``top_k`` (vLLM's: -1 or 0 is off), or the deprecated ``sample_top_k``."""
    if req.sample_top_k is not None and req.top_k is not None and req.sample_top_k != req.top_k:
        raise APIError(400, "'sample_top_k' is a deprecated name of 'top_k' (sampling); send 'top_k' only",
                       code="invalid_value", param="sample_top_k")
    top_k = req.top_k if req.top_k is not None else req.sample_top_k
    return max(0, top_k or 0)


def _common(req: ChatCompletionRequest | CompletionRequest, s: ServerSettings, question: str,
            documents: list[dict] | None, max_tokens: int | None, logprobs: bool, top_logprobs: int,
            preamble: str = "", raw_ids: list[int] | None = None, raw: bool = False) -> Parsed:
    """The checks chat and text completions share (limits from the server's settings). ``raw``: the question is
    a prompt continued as it is (``raw_ids``: its token ids, when the client sent ids)."""
    check_neutral(req)
    if max_tokens is not None and max_tokens > s.max_new_tokens:
        raise APIError(400, f"'max_tokens' must be at most {s.max_new_tokens}, got {max_tokens}",
                       code="invalid_value", param="max_tokens")
    method = req.method or s.default_method
    ratio = s.default_ratio if req.ratio is None else req.ratio
    if req.documents is not None:
        if documents:
            raise APIError(400, "passages were sent both in 'documents' and as <document> blocks in the message; "
                                "send them one way", code="ambiguous_documents", param="documents")
        documents = parse_documents([d.model_dump(exclude_none=True) for d in req.documents], s, "documents",
                                    allow_empty=True)
    else:
        documents = parse_documents(documents, s, "messages") if documents else None
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > s.max_stop or any(not x or len(x) > 200 for x in stops):
        raise APIError(400, f"'stop' takes at most {s.max_stop} non-empty strings of up to 200 characters",
                       code="invalid_value", param="stop")
    try:
        grammar = spec_of(req.response_format, req.structured_outputs)
    except ValueError as exc:
        param = "structured_outputs" if req.structured_outputs else "response_format"
        raise APIError(400, str(exc), code="invalid_value", param=param) from None
    try:
        bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    except ValueError:
        raise APIError(400, "'logit_bias' keys are token ids (strings of integers)", code="invalid_value",
                       param="logit_bias") from None
    sampling = SamplingParams(
        temperature=s.default_temperature if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p), top_k=sampling_top_k(req),
        min_p=0.0 if req.min_p is None else float(req.min_p),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        seed=req.seed, stop=tuple(stops), logprobs=logprobs, top_logprobs=top_logprobs,
        presence_penalty=float(req.presence_penalty or 0.0), frequency_penalty=float(req.frequency_penalty or 0.0),
        logit_bias=bias, min_tokens=int(req.min_tokens or 0), stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False, grammar=grammar)
    try:  # the one validation of this request: the engine takes it as it is
        retrieval = req.retrieval if req.retrieval is not None else \
            bool(req.retrieval_top_k) or (s.default_retrieval and not raw)  # a raw prompt is the whole prompt
        reuse = ReuseRequest(question if raw else question.strip(), method, ratio, req.kv, req.retrieval_top_k,
                             documents, preamble, retrieval, raw=raw,
                             prompt_ids=None if raw_ids is None else tuple(raw_ids),
                             skip_cache=bool(req.skip_reading_prefix_cache),
                             texts_checked=True).validated(max_top_k=s.max_top_k)  # read_json checked the texts
    except InvalidRequest as exc:
        if exc.code == "empty_question":  # the request's one empty-question check, said in the door's words
            raise APIError(400, "'prompt' is empty" if raw else "the question is empty (the last user message, "
                                "outside any <document> block)", code="empty_question",
                           param="prompt" if raw else "messages") from None
        param = "retrieval_top_k" if exc.param == "top_k" else exc.param
        raise APIError(400, str(exc).replace("'top_k'", "'retrieval_top_k'"), code=exc.code, param=param) from None
    request = Request(reuse, max_tokens or min(s.default_max_tokens, s.max_new_tokens), sampling)
    options = req.stream_options
    if (req.n or 1) > s.max_batch:
        raise APIError(400, f"'n' must be at most {s.max_batch} (the server's max_batch)", code="invalid_value",
                       param="n")
    echo = bool(getattr(req, "echo", None))
    if req.stream and (echo or req.prompt_logprobs is not None):
        raise APIError(400, "'echo' and 'prompt_logprobs' are not supported with stream: true", code="invalid_value",
                       param="echo" if echo else "prompt_logprobs")
    return request, Wire(bool(req.stream), bool(options and options.include_usage), req.model,
                         bool(options and options.continuous_usage_stats), int(req.n or 1), req.prompt_logprobs, echo)


def message_text(content: str | list[TextPart] | None) -> str:
    """A message's content as text (its text parts joined)."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def parse_chat(body: Any, s: ServerSettings, render: Callable[..., list[int] | None] | None = None) -> Parsed:
    """A chat-completions body: the last message is the question; system messages and earlier turns are used.

    A request that brings no passages and asks for no retrieval is the client's own prompt: its messages through
    the model's chat template (``render``, as ``/tokenize``) are the prompt, token for token, the stored chunks
    found in any message and reused (:mod:`fusionrag.online.client_prompt`). With passages (``documents`` or
    ``<document>`` blocks in the last user message, not both) or retrieval, fusionrag lays the prompt out:
    ``S``, whose KV every stored chunk was computed after, the passages, then the question segment.
    """
    req = validated(ChatCompletionRequest, body)
    *earlier, last = req.messages
    if last.role != "user":
        raise APIError(400, f"the last message must be the user's question, not '{last.role}' "
                            "(continuing an assistant message is not supported)", code="invalid_value",
                       param="messages")
    system, turns = [], []
    for i, m in enumerate(earlier):
        text = message_text(m.content)
        if DOCUMENT_TAG.search(text) or "<document" in text:
            raise APIError(400, f"messages[{i}]: <document> blocks belong in the last user message",
                           code="invalid_documents", param="messages")
        if m.role in ("system", "developer"):
            system.append(text)
        else:
            turns.append((m.role, text))
    question, docs = split_documents(message_text(last.content), f"messages[{len(earlier)}]")
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", code="invalid_value", param="top_logprobs")
    retrieval = req.retrieval is True or bool(req.retrieval_top_k) or (req.retrieval is None and s.default_retrieval)
    if not docs and req.documents is None and not retrieval and render is not None and question.strip():
        ids = render([{"role": m.role, "content": message_text(m.content)} for m in req.messages],
                     req.chat_template_kwargs)
        if ids is not None:  # the client's prompt, as it built it (its length is checked as any prompt's)
            return _common(req, s, question, None, max_tokens, bool(req.logprobs), req.top_logprobs or 0,
                           raw_ids=ids, raw=True)
    if req.chat_template_kwargs:
        raise APIError(400, "'chat_template_kwargs' needs a prompt the client builds (no documents, no retrieval)",
                       code="invalid_value", param="chat_template_kwargs")
    return _common(req, s, question, docs, max_tokens, bool(req.logprobs), req.top_logprobs or 0,
                   conversation_preamble(system, turns))


def parse_completion(body: Any, s: ServerSettings, decode: Callable[[list[int]], str],
                     vocab_size: int | None = None) -> Parsed:
    """A text-completions body: the prompt (a string, or token ids) continued as it is, as vLLM does.

    Token ids must lie within the vocabulary (``vocab_size``): anything else is a 400, not a decode error;
    they are prefilled as sent (``decode`` gives the text the answer page shows).

    A request that brings passages (``documents``, or ``<document>`` blocks in the prompt, as in chat) or
    asks for retrieval (``retrieval: true``, ``retrieval_top_k`` >= 1) is a RAG request instead: the prompt
    is its question, in the store's prompt (``S``, the passages, the question segment).
    """
    req = validated(CompletionRequest, body)
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", code="invalid_value", param="prompt")
        prompt = prompt[0]
    ids: list[int] | None = None
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "'prompt' is empty", code="empty_question", param="prompt")
        check_token_ids(prompt, vocab_size, "prompt")
        ids, prompt = list(prompt), decode(prompt)
    logprobs = req.logprobs is not None
    rag = req.documents is not None or bool(DOCUMENT_TAG.search(prompt)) or req.retrieval is True \
        or bool(req.retrieval_top_k)
    if not rag:
        return _common(req, s, prompt, None, req.max_tokens, logprobs, req.logprobs or 0, raw_ids=ids, raw=True)
    question, docs = split_documents(prompt, "prompt")
    return _common(req, s, question, docs, req.max_tokens, logprobs, req.logprobs or 0)



def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    """A 400 naming ``param`` when a token id lies outside the vocabulary (not a decode error later)."""
    hi = vocab_size if vocab_size is not None else 2**31
    bad = next((t for t in ids if not 0 <= t < hi), None)
    if bad is not None:
        raise APIError(400, f"'{param}' token id {bad} is outside the vocabulary (0..{hi - 1})",
                       code="invalid_value", param=param)


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``POST /tokenize`` body, vLLM's: ``{"prompt": ...}`` or ``{"messages": [...]}`` (with their options)."""
    chat = isinstance(body, dict) and "messages" in body
    return validated(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def parse_detokenize(body: Any, vocab_size: int) -> DetokenizeRequest:
    """A ``POST /detokenize`` body ``{"tokens": [...]}``: ids within the vocabulary."""
    req = validated(DetokenizeRequest, body)
    check_token_ids(req.tokens, vocab_size, "tokens")
    return req
