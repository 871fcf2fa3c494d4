"""``n`` > 1: several answers to one prompt, each its own choice, as vLLM and OpenAI return them.

Each choice is a request of its own on the scheduler (they decode in one batch), sampled with its own seed
(``seed + i`` when the request names one); the prompt is computed once and reused by the others through the
engine's whole-context cache, where it is on. The answer is one body (or one stream) with ``choices[i]``
(``index`` i), the prompt counted once in ``usage`` and the completions summed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from fusionrag.online.scheduled import Event
from fusionrag.online.state import Request
from fusionrag.serve.api_errors import as_api_error
from fusionrag.serve.responses import Logprobs, Shape, completion_json, sse_stream


def copies(req: Request, n: int) -> list[Request]:
    """``req`` and ``n - 1`` more like it, each with its own seed (``seed + i``, or a random one)."""
    out = [req]
    for i in range(1, n):
        seed = None if req.sampling.seed is None else (req.sampling.seed + i) % 2 ** 64
        out.append(Request(req.reuse, req.max_new_tokens, replace(req.sampling, seed=seed)))
    return out


async def answer_many(reqs: list[Request], queues: list[asyncio.Queue[Event]], shape: Shape,
                      logprobs_of: Callable[[], Logprobs | None], next_event: Callable[..., Any], timeout: float,
                      on_done: Callable[[Request], None]) -> Response:
    """The non-streamed body of ``n`` answers."""
    bodies = []
    for req, events in zip(reqs, queues, strict=True):
        logprobs = logprobs_of()
        ev = await next_event(events, req, timeout, "the answer did not finish in time")
        while isinstance(ev, Event) and ev.kind == "token":
            if logprobs is not None:
                logprobs.add(ev)
            ev = await next_event(events, req, timeout, "the answer did not finish in time")
        if isinstance(ev, Response):
            _cancel(reqs)
            return ev
        if ev.kind == "error":
            _cancel(reqs)
            return as_api_error(ev.error).response()
        on_done(req)
        bodies.append(completion_json(req, ev, shape, logprobs))
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    body["usage"] = _summed([b["usage"] for b in bodies])
    return JSONResponse(body)


def stream_many(reqs: list[Request], firsts: list[Event], queues: list[asyncio.Queue[Event]], shape: Shape,
                include_usage: bool, logprobs_of: Callable[[], Logprobs | None], on_done: Callable[[Request], None],
                timeout: float, continuous_usage: bool) -> StreamingResponse:
    """One server-sent event stream of ``n`` answers: each answer's chunks as they come, its choices numbered,
    then one usage chunk (when asked for) and ``[DONE]``."""

    async def merged() -> AsyncIterator[str]:
        lines: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
        usages: list[dict] = []

        async def pump(i: int) -> None:
            try:
                async for line in sse_stream(reqs[i], firsts[i], queues[i], shape, True, logprobs_of(), on_done,
                                             timeout, continuous_usage):
                    await lines.put((i, line))
            finally:
                await lines.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(reqs))]
        open_streams = len(reqs)
        try:
            while open_streams:
                i, line = await lines.get()
                if line is None:
                    open_streams -= 1
                    continue
                if not line.startswith("data: {"):
                    continue  # each answer's [DONE]: one for all, at the end
                chunk = json.loads(line[6:])
                if "choices" in chunk and not chunk["choices"] and "usage" in chunk:
                    usages.append(chunk["usage"])  # each answer's usage: summed into one
                    continue
                for choice in chunk.get("choices", []):
                    choice["index"] = i
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage and usages:
                yield shape.chunk([], usage=_summed(usages))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            _cancel(reqs)

    return StreamingResponse(merged(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _summed(usages: list[dict]) -> dict:
    """One usage for ``n`` answers to one prompt: the prompt once, the completions summed."""
    out = dict(usages[0])
    out["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def _cancel(reqs: list[Request]) -> None:
    for req in reqs:
        if not req.finished:
            req.cancel()
