"""The Python API: ``Engine`` answers questions over a knowledge store, through the server's own scheduler.

::

    engine = Engine.open("kb/", model="qwen2.5-0.5b")
    result = engine.answer("Who discovered polonium?", method="fusionrag", ratio=0.15)
    print(result.text, result.ttft_ms)

An :class:`Engine` is a :class:`~fusionrag.online.prefill_engine.PrefillEngine` (the store, its caches, the
prefill) with an inline :class:`~fusionrag.online.scheduler.BatchScheduler` of its own: :meth:`answer`,
:meth:`stream` and :meth:`prepare` submit a :class:`~fusionrag.online.state.Request` to it and run it on the
caller's thread as a batch of one, the same prefill plan, token choice, output step and decode steps as a
server's request (bench and demo time the path users run). The server builds its scheduler around an
engine the same way; neither the prefill engine nor the scheduler knows the other's class.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

from fusionrag.online.auto_ratio import Ratio
from fusionrag.online.prefill_engine import DEFAULT_CONTEXT_CACHE_BYTES, PrefillEngine
from fusionrag.online.request import DEFAULT_MAX_NEW_TOKENS, ReuseRequest
from fusionrag.online.resolved import Resolved
from fusionrag.online.sampling import SamplingParams
from fusionrag.online.scheduled import Event
from fusionrag.online.scheduler import BatchScheduler
from fusionrag.online.state import Request

__all__ = ["DEFAULT_CONTEXT_CACHE_BYTES", "Engine"]


class Engine(PrefillEngine):
    """Answers questions over a knowledge store with a chosen KV-reuse method (module doc)."""

    @functools.cached_property
    def scheduler(self) -> BatchScheduler:
        """The scheduler this engine's own calls run through, inline (no model thread)."""
        return BatchScheduler(self, autostart=False)

    def answer(self, question: str | ReuseRequest, method: str = "fusionrag", ratio: Ratio = 0.15,
               top_k: int | None = None, chunks: Sequence[dict] | None = None,
               max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, kv: str | None = None, preamble: str = "",
               retrieval: bool | None = None, sampling: SamplingParams | None = None) -> Request:
        """Answer ``question`` (greedy unless ``sampling`` says otherwise, up to ``max_new_tokens`` or the end of
        the answer); ``chunks`` (``{title, text}`` dicts, in order; ``[]`` for none) replaces retrieval, as does
        ``retrieval=False``. ``question`` may be a whole :class:`ReuseRequest` (its fields, not the keywords,
        then apply). A batch of one through the same scheduler as the server's requests."""
        req = Request.of(_reuse(question, method, ratio, top_k, chunks, kv, preamble, retrieval), max_new_tokens,
                         sampling)
        return _finished(self._run(req))

    def stream(self, question: str | ReuseRequest, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               sampling: SamplingParams | None = None, on_done: Callable[[Request], None] | None = None,
               **fields: object) -> Iterator[str]:
        """Yield the answer as text deltas (the first one as soon as the first token exists); ``fields`` are
        :meth:`answer`'s request fields. ``on_done`` is given the finished :class:`Request` (method, TTFT,
        sources: what :meth:`answer` returns) after the last delta."""
        for event in self._run(Request.of(question, max_new_tokens, sampling, **fields)):
            if event.kind == "error":
                raise event.error  # type: ignore[misc]
            if event.text:
                yield event.text
            if event.kind == "done" and on_done is not None:
                on_done(event.answer)

    def prepare(self, question: str | ReuseRequest | Request, method: str = "fusionrag", ratio: Ratio = 0.15,
                top_k: int | None = None, chunks: Sequence[dict] | None = None, kv: str | None = None,
                preamble: str = "", retrieval: bool | None = None, resolved: Resolved | None = None) -> Request:
        """Everything up to the first answer token (greedy), with the TTFT breakdown: the request run by the
        scheduler for one token, so what is timed is what users run. Takes the :class:`Request` admitted at its
        door, or a :class:`ReuseRequest` or its fields. ``preamble`` (a system message, earlier turns:
        :func:`fusionrag.prompt.conversation_preamble`) goes into the question segment, after the reused
        passages; retrieval uses ``question`` alone. ``resolved``: the request's passages found before
        (:meth:`prefetch`), used unless the store changed since. The request keeps its prompt KV (``pre``)."""
        req = question if isinstance(question, Request) else \
            Request.of(_reuse(question, method, ratio, top_k, chunks, kv, preamble, retrieval), 1)
        req.max_new_tokens = 1
        if resolved is not None:
            req.resolved = Future()
            req.resolved.set_result(resolved)
        return _finished(self._run(req))  # one token: it never joins a decode batch, so it keeps its KV

    def _run(self, req: Request) -> Iterator[Event]:
        with self.lock:
            yield from self.scheduler.run_inline(req)


def _reuse(question: str | ReuseRequest, method: str, ratio: Ratio, top_k: int | None, chunks: Sequence[dict] | None,
           kv: str | None, preamble: str, retrieval: bool | None) -> ReuseRequest:
    return question if isinstance(question, ReuseRequest) else \
        ReuseRequest(question, method, ratio, kv, top_k, chunks, preamble, retrieval)


def _finished(events: Iterator[Event]) -> Request:
    """The request its last event ends (raises its error)."""
    last = collections.deque(events, maxlen=1)
    done = last[0] if last else None
    assert done is not None and done.kind in ("done", "error")
    if done.kind == "error":
        raise done.error  # type: ignore[misc]
    return done.answer
