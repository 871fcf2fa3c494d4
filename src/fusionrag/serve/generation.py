"""One handler for ``/v1/chat/completions`` and ``/v1/completions``: submit, wait, answer or stream.

Both endpoints differ only in how the body is parsed and in the shape of what goes back
(:class:`~fusionrag.serve.responses.Shape`); queueing, timeouts, cancellation when the
client goes away, metrics and the explain page's record are the same code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fusionrag.online.prompt_logprobs import prompt_logprobs
from fusionrag.online.scheduled import Event
from fusionrag.online.state import Request
from fusionrag.serve.access_log import set_request_id
from fusionrag.serve.api_errors import APIError, as_api_error
from fusionrag.serve.bodies import read_json
from fusionrag.serve.choices import answer_many, copies, stream_many
from fusionrag.serve.protocol import Parsed
from fusionrag.serve.responses import Logprobs, Shape, completion_json, sse_stream
from fusionrag.serve.settings import ServerSettings
from fusionrag.serve.state import ServerState


async def generate(server: ServerState, request: HTTPRequest, chat: bool,
                   parse: Callable[[Any, ServerSettings], Parsed]) -> Response:
    """Validate, queue, then answer as JSON or as server-sent events. What fails before the first event is
    raised (the app answers it); an engine error or a timeout after it is answered here, the stream's own."""
    s, sched = server.settings, server.scheduler
    body = await read_json(request, s.max_body_bytes)
    server.ensure_ready()
    req, wire = parse(body, s)
    set_request_id(request.state, req.id)
    server.check_model(wire.model)
    check_with_model(req, sched.engine)
    loop = asyncio.get_running_loop()
    reqs = copies(req, wire.n)
    queues: list[asyncio.Queue[Event]] = [asyncio.Queue() for _ in reqs]
    for i, (r, q) in enumerate(zip(reqs, queues, strict=True)):
        try:
            sched.submit(r, listener=lambda ev, q=q: loop.call_soon_threadsafe(q.put_nowait, ev))
        except BaseException:  # a full queue for the i-th answer: the ones already queued go too
            for queued in reqs[:i]:
                queued.cancel()
            raise
    events = queues[0]
    shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{req.id}", int(time.time()), server.model_name())
    tokenizer = sched.engine.lm.tokenizer

    def logprobs_of() -> Logprobs | None:
        return Logprobs(lambda t: tokenizer.decode([t])) if req.sampling.logprobs else None

    if len(reqs) > 1:
        return await _many(server, reqs, queues, shape, wire, logprobs_of)
    logprobs = logprobs_of()
    first = await _next_event(events, req, s.request_timeout_s, "no first token in time")
    if isinstance(first, Response):
        return first
    if first.kind == "error":
        return as_api_error(first.error).response()
    if wire.stream:
        return StreamingResponse(
            sse_stream(req, first, events, shape, wire.include_usage, logprobs, server.on_done, s.request_timeout_s,
                       wire.continuous_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    ev: Event | Response = first
    while isinstance(ev, Event) and ev.kind == "token":
        if logprobs is not None:
            logprobs.add(ev)
        ev = await _next_event(events, req, s.request_timeout_s, "the answer did not finish in time")
    if isinstance(ev, Response):
        return ev
    if ev.kind == "error":
        return as_api_error(ev.error).response()
    server.on_done(req)
    body = completion_json(req, ev, shape, logprobs)
    if wire.prompt_logprobs is not None or wire.echo:
        await _with_prompt(body, req, wire, sched, tokenizer, chat)
    return JSONResponse(body)


def check_with_model(req: Request, engine: Any) -> None:
    """What only the model can say about a request, before it is queued: its structured output compiles for this
    tokenizer, its ``logit_bias`` and ``stop_token_ids`` name tokens of this vocabulary."""
    p = req.sampling
    vocab = int(engine.lm.model.config.vocab_size)
    for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("stop_token_ids", list(p.stop_token_ids))):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"'{name}': token {bad[0]} is not in the model's vocabulary (0..{vocab - 1})",
                           code="invalid_value", param=name)
    if p.grammar is not None:
        try:
            engine.grammars.compiled(p.grammar)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value", param="response_format") from None


async def _with_prompt(body: dict, req: Request, wire: Any, sched: Any, tokenizer: Any, chat: bool) -> None:
    """``prompt_logprobs`` and ``echo`` (:mod:`fusionrag.online.prompt_logprobs`), computed on the model thread once
    the answer is out: the prompt's own log-probabilities need a Full Attention forward of it."""
    legacy = wire.echo and body["choices"][0].get("logprobs") is not None
    top = max(wire.prompt_logprobs or 0, req.sampling.top_logprobs if legacy else 0)
    need = wire.prompt_logprobs is not None or legacy
    ids = list(req.prompt_token_ids)

    def decode(t: int) -> str:
        return tokenizer.decode([t])

    found = await asyncio.wrap_future(sched.run_task(prompt_logprobs, sched.engine.lm, ids, top, decode)) \
        if need else None
    if wire.prompt_logprobs is not None:
        (body if chat else body["choices"][0])["prompt_logprobs"] = found
    if wire.echo and not chat:
        choice = body["choices"][0]
        choice["text"] = tokenizer.decode(ids, skip_special_tokens=req.sampling.skip_special_tokens) + choice["text"]
        if legacy and found is not None:
            lp = choice["logprobs"]
            texts = [decode(t) for t in ids]
            first = [None] + [entry[str(t)]["logprob"] for entry, t in zip(found[1:], ids[1:], strict=True)]
            tops = [None] + [{e["decoded_token"]: e["logprob"] for e in entry.values()} for entry in found[1:]]
            offsets = [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
            shift = sum(len(x) for x in texts)
            lp["tokens"] = texts + lp["tokens"]
            lp["token_logprobs"] = first + lp["token_logprobs"]
            lp["top_logprobs"] = tops + lp["top_logprobs"]
            lp["text_offset"] = offsets + [o + shift for o in lp["text_offset"]]


async def _many(server: ServerState, reqs: list[Request], queues: list[asyncio.Queue[Event]], shape: Shape,
                wire: Any, logprobs_of: Callable[[], Logprobs | None]) -> Response:
    """``n`` > 1 answers (:mod:`fusionrag.serve.choices`)."""
    timeout = server.settings.request_timeout_s
    if not wire.stream:
        return await answer_many(reqs, queues, shape, logprobs_of, _next_event, timeout, server.on_done)
    firsts = []
    for r, q in zip(reqs, queues, strict=True):
        first = await _next_event(q, r, timeout, "no first token in time")
        if isinstance(first, Response) or first.kind == "error":
            for other in reqs:
                other.cancel()
            return first if isinstance(first, Response) else as_api_error(first.error).response()
        firsts.append(first)
    return stream_many(reqs, firsts, queues, shape, wire.include_usage, logprobs_of, server.on_done, timeout,
                       wire.continuous_usage)


async def _next_event(events: asyncio.Queue[Event], req: Request, timeout: float, late: str) -> Event | Response:
    """The request's next event; a 504 response after ``timeout``. Either way a request left behind is cancelled
    (also when the client goes away: the cancellation propagates after the request's slot is freed)."""
    try:
        return await asyncio.wait_for(events.get(), timeout)
    except BaseException as exc:
        req.cancel()
        if isinstance(exc, TimeoutError):
            return APIError(504, late, "server_error", "timeout").response()
        raise
