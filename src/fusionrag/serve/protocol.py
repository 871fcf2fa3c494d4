"""A chat or text completion body as the engine's request, and how its answer goes back over HTTP.

Kept apart from the routes so that what a completion may ask is in one place, testable without a model: the
body was read and checked by :mod:`fusionrag.serve.bodies` (its schema :mod:`fusionrag.serve.schemas`); here
its fields become a :class:`~fusionrag.online.state.Request` (vLLM's sampling names, retrieval only when asked
or when ``default_retrieval`` is on, a raw completion prompt, the ``<document>`` message convention) and a
:class:`Wire`; what goes back is :mod:`fusionrag.serve.responses`, errors :mod:`fusionrag.serve.api_errors`.
Every error is JSON in OpenAI's shape; bad input is a 4xx, never a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionrag.online.constraints import spec_of
from fusionrag.online.request import InvalidRequest, ReuseRequest
from fusionrag.online.sampling import SamplingParams
from fusionrag.online.state import Request
from fusionrag.prompt import conversation_preamble
from fusionrag.serve.api_errors import APIError
from fusionrag.serve.bodies import DOCUMENT_TAG, check_token_ids, parse_documents, split_documents, validated
from fusionrag.serve.schemas import ChatCompletionRequest, CompletionRequest, TextPart
from fusionrag.serve.settings import ServerSettings

log = logging.getLogger(__name__)


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



