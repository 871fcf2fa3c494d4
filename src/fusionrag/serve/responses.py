"""What goes back: chat and text completion bodies, their logprobs, and the SSE chunk stream.

One place for both endpoints, so that ``/v1/chat/completions`` and ``/v1/completions``
report the same things (usage, the ``fusionrag`` extension, logprobs) in each API's shape.
The answer text is the scheduler's (stop strings already cut), not a re-decode of the tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fusionrag.online.scheduled import Event
from fusionrag.online.state import Request
from fusionrag.serve.api_errors import as_api_error


def reuse_json(ans: Request) -> dict[str, Any]:
    """Where the prompt's passages came from, in ``usage.fusionrag`` (frameworks keep ``usage``, not extras).

    ``reused_chunks``: passages the store holds whose precomputed KV was reused (by content, its fused KV for
    ``fusionrag``); ``adhoc_chunks``: passages the store does not hold, of which ``prefix_cache_hits`` had
    their plain KV computed by an earlier request (the alternative-path prefix cache) and ``computed_chunks``
    were computed now; ``context_cache_hit``: the whole context came from an earlier request.
    ``precomputed_tokens``: context tokens whose KV came precomputed (store or cache); ``reused_tokens``: those
    of them served as they came, i.e. less the ones this request recomputed, and ``reused_tokens_by_origin``
    says where they came from (``store``, ``prefix_cache``, ``context_cache``). ``method: full`` reads no cache
    (the baseline an A/B test compares with computes its whole prompt).
    ``method`` is the method that ran (``auto`` resolved; ``note`` says why when it differs from the
    request's); ``sources``: each chunk's ``chunk_id, title, source, score, stored``, for citing, and ``part``:
    ``[first, stop]``, the stored chunk's tokens a part of it used (a client's own split), else null.
    ``ratio``: the share of the context the method was asked to recompute, or for ``ratio: "auto"`` the share it
    chose (then ``auto_ratio`` names the setting that sized it: ``fusionrag calibrate``).
    """
    stored = sum(c is not None for c in ans.chunk_ids)
    full = ans.method == "full"
    return {"method": ans.method, "kv": ans.kv, "ratio": ans.ratio, "auto_ratio": ans.auto_json(),
            "chunks": len(ans.chunk_ids),
            "reused_chunks": 0 if full else stored, "adhoc_chunks": len(ans.chunk_ids) - stored,
            "prefix_cache_hits": 0 if full else ans.kv_origins.count("prefix_cache"),
            "computed_chunks": len(ans.chunk_ids) if full else ans.kv_origins.count("computed"),
            "context_cache_hit": ans.context_cache_hit,
            "context_tokens": ans.context_tokens,
            "recomputed_tokens": ans.recomputed_tokens,
            "precomputed_tokens": ans.precomputed_tokens, "reused_tokens": ans.reused_tokens,
            "reused_tokens_by_origin": ans.reused_by_origin,
            "sources": ans.sources, "note": ans.note}


def cached_tokens(req: Request) -> int:
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens whose KV this request did not compute itself.

    OpenAI and vLLM count there the prompt tokens served from a cache instead of being prefilled; the
    clients that know no ``fusionrag`` extension (litellm, DSPy, the SDKs' typed ``usage``) read it. That
    is :attr:`Request.reused_tokens`, not ``precomputed_tokens``: the latter still counts the tokens this
    request found precomputed but recomputed anyway (FusionRAG's selected tokens, computed here like any
    prefill), so it would overstate what came from a cache; a whole context an earlier request computed
    (the context cache) counts too. ``method: full`` reads no cache and computes everything: 0. The
    system prompt's KV (computed once at startup) is not counted: the number is the passages' reuse only
    (equal to ``usage.fusionrag.reused_tokens``), a lower bound of what the request did not prefill.
    """
    return req.reused_tokens


def usage_json(req: Request, completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage`` object of a finished request (or of one ``completion_tokens`` into its answer), with
    ``prompt_tokens_details.cached_tokens`` (:func:`cached_tokens`), plus ``fusionrag`` (:func:`reuse_json`)."""
    done = len(req.token_ids) if completion_tokens is None else completion_tokens
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": done, "total_tokens": req.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(req)}, "fusionrag": reuse_json(req)}


def fusionrag_json(req: Request) -> dict[str, Any]:
    """The ``fusionrag`` extension object: the engine's TTFT breakdown plus the server's queueing view."""
    out = req.to_json()
    out.pop("answer", None)  # already the message content
    out["request_id"] = req.id
    out["server"] = {
        "queue_ms": round(req.queue_ms, 2),
        "ttft_ms": None if req.server_ttft_ms is None else round(req.server_ttft_ms, 2),
        "latency_ms": None if (end := req.answer.finished_at) is None else round((end - req.submitted_at) * 1000.0, 2),
    }
    return out


@dataclass
class Logprobs:
    """Log-probabilities collected from token events, rendered in the chat or the legacy completions shape."""

    decode: Callable[[int], str]
    items: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    def add(self, ev: Event) -> None:
        if ev.kind == "token" and ev.logprob is not None:
            self.items.append((int(ev.token), ev.logprob, ev.top_logprobs))

    def chat(self, start: int = 0) -> dict[str, Any]:
        def entry(tok: int, lp: float) -> dict[str, Any]:
            text = self.decode(tok)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, lp, top in self.items[start:]]}

    def legacy(self, start: int = 0, offset: int = 0) -> dict[str, Any]:
        tokens = [self.decode(t) for t, _, _ in self.items[start:]]
        offsets, pos = [], offset
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in self.items[start:]],
                "top_logprobs": [{self.decode(a): b for a, b in top} for _, _, top in self.items[start:]],
                "text_offset": offsets}


@dataclass
class Shape:
    """One endpoint's names: chat (``message``/``delta``) or text (``text``) completions."""

    chat: bool
    completion_id: str
    created: int
    model: str

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice(self, text: str, finish_reason: str | None, logprobs: dict | None, first: bool = False,
               final: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if final:
            delta: dict[str, Any] = {}
        elif first:
            delta = {"role": "assistant", "content": text}
        else:
            delta = {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}

    def chunk(self, choices: list[dict], **extra: Any) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.completion_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"


def completion_json(req: Request, done: Event, shape: Shape, logprobs: Logprobs | None) -> dict[str, Any]:
    """The non-streamed body of a request that ended with the ``done`` event."""
    text = req.answer.emitted.strip() if shape.chat else req.answer.emitted
    if shape.chat:
        lp = logprobs.chat() if logprobs is not None else None
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": done.finish_reason, "logprobs": lp}
    else:
        choice = shape.choice(text, done.finish_reason, logprobs.legacy() if logprobs is not None else None)
    return {"id": shape.completion_id, "object": shape.object, "created": shape.created, "model": shape.model,
            "choices": [choice], "usage": usage_json(req), "fusionrag": fusionrag_json(req)}


async def sse_stream(req: Request, first: Event, events: asyncio.Queue, shape: Shape, include_usage: bool,
                     logprobs: Logprobs | None, on_done: Callable[[Request], None],
                     timeout: float, continuous_usage: bool = False) -> AsyncIterator[str]:
    """OpenAI chunk stream: text deltas (chat: the role first), a final chunk, optional usage, ``[DONE]``.

    A delta is sent for every token that carries text or a logprob; ``on_done(req)`` runs
    once the answer is complete (the metrics count only finished answers). ``continuous_usage``
    (vLLM's ``stream_options.continuous_usage_stats``): every delta carries the usage so far.
    """
    finished = False
    sent_first, pos, count = False, 0, 0
    try:
        ev = first
        while ev.kind == "token":
            count += 1  # tokens this stream has read: the usage of its chunk (the model thread runs ahead)
            lp = None
            if logprobs is not None:
                logprobs.add(ev)
                lp = logprobs.chat(len(logprobs.items) - 1) if shape.chat else \
                    logprobs.legacy(len(logprobs.items) - 1, pos)
            if ev.text or lp is not None or not sent_first:
                extra = {"usage": usage_json(req, count)} if continuous_usage else {}
                yield shape.chunk([shape.choice(ev.text, None, lp, first=not sent_first)], **extra)
                sent_first = True
                pos += len(ev.text)
            ev = await asyncio.wait_for(events.get(), timeout)
        if ev.kind == "error":
            err = as_api_error(ev.error)
            finished = True
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'code': err.code}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        finished = True
        on_done(req)
        if ev.text or not sent_first:  # text held back until the end (an unfinished stop-string prefix)
            yield shape.chunk([shape.choice(ev.text, None, None, first=not sent_first)])
        yield shape.chunk([shape.choice("", ev.finish_reason, None, final=True)], fusionrag=fusionrag_json(req))
        if include_usage:
            yield shape.chunk([], usage=usage_json(req))
        yield "data: [DONE]\n\n"
    except TimeoutError:
        yield f"data: {json.dumps({'error': {'message': 'generation timed out', 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client disconnected or we timed out: free the batch slot
            req.cancel()
