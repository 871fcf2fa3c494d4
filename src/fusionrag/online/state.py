"""``Request``: one request from its admission to its answer, whatever door it came through.

Like vLLM's ``Request``: created once, when a request is admitted (the server's parser, the CLI, the
Python API: :meth:`Request.of`), from a validated :class:`~fusionrag.online.request.ReuseRequest` and how
to pick its tokens, and handed to the scheduler (``submit``), the one way in. ``status`` says where it is,
and only the scheduler moves it (:meth:`Request.move`, along :data:`MOVES`). Apart from what its caller asked
(``reuse``, ``sampling``), each stage writes its own object, once: the prefetch its passages (``resolved``),
the prefill plan (:class:`~fusionrag.online.prefill_plan.PrefillPlan`) what it served
(:class:`~fusionrag.online.served.Served`: the prompt's KV and first logits, the method and ratio that ran,
the passages and where their KV came from; read through the request, ``req.method``, ``req.sources``, ...),
the output step (:mod:`fusionrag.online.output`) the :class:`Answer` (its tokens, text, finish reason and their
times; ``text``, ``token_ids`` and ``finish_reason`` read through). What the scheduler alone works with is the
request's :class:`Progress`. The caller's side (``events``, ``result``, ``cancel``) is thread-safe; ``emit``
runs on the model thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fusionrag.execution.generate import TextStreamer
from fusionrag.kvcache.kv import KV
from fusionrag.online.request import ReuseRequest
from fusionrag.online.sampling import SamplingParams, StopMatcher, TokenSampler
from fusionrag.online.scheduled import Event, Listener
from fusionrag.online.served import Served

log = logging.getLogger(__name__)


class Status(StrEnum):
    """Where a request is. Only the scheduler moves it (:meth:`Request.move`), along :data:`MOVES`, as vLLM's
    scheduler alone moves its ``RequestStatus``: waiting in its queue, its prefill being advanced, decoding in
    the batch, then finished one of four ways."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED_STOPPED = "finished_stopped"  # a stop token or string, or a structured answer that is complete
    FINISHED_LENGTH = "finished_length"  # its token budget (max_tokens, or the model's exact-reuse limit)
    FINISHED_ABORTED = "finished_aborted"  # cancelled by its caller
    FINISHED_ERROR = "finished_error"  # failed

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished_")


_ENDS = {Status.FINISHED_ABORTED, Status.FINISHED_ERROR}
#: The moves a request can make: forward only, and to an end (aborted, failed) from anywhere unfinished.
MOVES: dict[Status, set[Status]] = {
    Status.WAITING: {Status.PREFILLING, *_ENDS},
    Status.PREFILLING: {Status.DECODING, Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, *_ENDS},
    Status.DECODING: {Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, *_ENDS},
}


@dataclass
class Answer:
    """What the request answered, written by the output step alone (:mod:`fusionrag.online.output`) as tokens
    are picked and when it ends; the caller reads it (the server's responses and metrics, the Python API)."""

    token_ids: list[int] = field(default_factory=list)  # the generated tokens (a stop token is not one)
    emitted: str = ""  # the text sent so far (stop strings cut, held-back tails included at the end)
    text: str = ""  # the whole answer: the tokens as the streamer decoded them, once
    finish_reason: str | None = None  # "stop" | "length"
    first_token: int = -1  # the first answer token picked (a stop token included; Engine.prepare's greedy pick)
    first_token_ms: float | None = None  # how long picking it took after the prefill: TTFT's last stage
    first_token_at: float | None = None  # perf_counter() of the first generated token
    finished_at: float | None = None  # ... of the end (done or error)
    token_times: list[float] = field(default_factory=list)  # ... of each generated token (inter-token latency)


@dataclass
class Progress:
    """What the scheduler works with while a request runs and nobody else reads: its token sampler (bound to the
    end of turn and the grammar before the prefill), the stop-string matcher, the incremental detokeniser and
    the last token (the next decode step's input)."""

    sampler: TokenSampler
    stop_matcher: StopMatcher
    streamer: TextStreamer | None = None
    last_token: int = -1


class _FromServed:
    """A field of the request's :class:`Served`, read through the request (``empty()`` before its prefill). The
    prefill plan alone writes it, once, as a whole ``Served``: setting it on the request is refused."""

    def __init__(self, empty: Any, field_name: str | None = None) -> None:
        self.empty, self.field_name = empty, field_name

    def __set_name__(self, owner: type, name: str) -> None:
        self.field_name = self.field_name or name

    def __get__(self, req: Any, owner: type | None = None) -> Any:
        if req is None:
            return self
        return self.empty() if req.served is None else getattr(req.served, str(self.field_name))

    def __set__(self, req: Any, value: Any) -> None:
        raise AttributeError(f"{self.field_name} is what the prefill served (Request.served), written once by it")


class Request:
    """One request's state (see the module doc). Fields a stage has not filled yet are empty."""

    def __init__(self, reuse: ReuseRequest, max_new_tokens: int = 32, sampling: SamplingParams | None = None,
                 listener: Listener | None = None) -> None:
        self.id = uuid.uuid4().hex
        self.reuse = reuse  # the question and how to reuse KV for it (validated once: at its door or its prefill)
        self.max_new_tokens = int(max_new_tokens)
        self.sampling = sampling or SamplingParams()
        self._status = Status.WAITING
        self.submitted_at = time.perf_counter()
        # the prefetch: its Resolved passages, the request's own
        self.resolved: Future | None = None
        #: What the prefill served it (the plan's last stage writes it once): its KV, method, ratio, passages.
        self.served: Served | None = None
        #: The answer (the output step's): its tokens, text, finish reason and their times.
        self.answer = Answer()
        self.error: BaseException | None = None
        self.prefill_started_at: float | None = None
        #: The scheduler's working state (model thread only), apart from what the caller reads.
        self.progress = Progress(TokenSampler(self.sampling),
                                 StopMatcher(self.sampling.stop, self.sampling.include_stop_str_in_output))
        self._listener = listener
        self._events: queue.Queue[Event] | None = None if listener is not None else queue.Queue()
        self._cancelled = threading.Event()
        self._done = threading.Event()

    @classmethod
    def of(cls, question: str | ReuseRequest, max_new_tokens: int = 32, sampling: SamplingParams | None = None,
           **reuse_fields: Any) -> Request:
        """A request for ``question`` and its :class:`ReuseRequest` fields (method, ratio, top_k, chunks, kv,
        preamble, retrieval), or for a whole :class:`ReuseRequest`: what the Python API and tests submit."""
        reuse = question if isinstance(question, ReuseRequest) else ReuseRequest(question, **reuse_fields)
        return cls(reuse, max_new_tokens, sampling)

    @property
    def text(self) -> str:
        """The answer's text (:attr:`answer`)."""
        return self.answer.text

    @property
    def token_ids(self) -> list[int]:
        """The answer's tokens (:attr:`answer`)."""
        return self.answer.token_ids

    @property
    def finish_reason(self) -> str | None:
        """Why the answer ended, ``stop`` or ``length`` (:attr:`answer`)."""
        return self.answer.finish_reason

    @property
    def status(self) -> Status:
        return self._status

    def move(self, to: Status) -> None:
        """Move to ``to`` (the scheduler's call, along :data:`MOVES`; anything else is a scheduler bug)."""
        if to not in MOVES.get(self._status, set()):
            raise RuntimeError(f"request {self.id} cannot move from {self._status} to {to}")
        self._status = to

    def listen(self, listener: Listener) -> None:
        """Deliver this request's events to ``listener`` (on the model thread) instead of its queue."""
        self._listener, self._events = listener, None

    @property
    def question(self) -> str:
        return self.reuse.question

    def prefetched(self) -> Any:
        """The passages the prefetch found (``Resolved``; waiting for it: it is doing what the prefill would
        do), or None when it found none: the prefill then finds them."""
        if self.resolved is None:
            return None
        try:
            return self.resolved.result()
        except Exception:  # best effort: the prefill resolves the request itself
            return None

    # -- what the prefill served (:class:`Served`), read through; empty before the prefill ------------------

    pre = _FromServed(lambda: None)  # the prompt's KV and the logits of the first answer token (Prefilled)
    kv_kind = _FromServed(str)
    kv = _FromServed(str, "kv_kind")  # the answer's name for it: which stored KV the request reused
    auto_ratio = _FromServed(lambda: None)
    prompt_token_ids = _FromServed(list)
    chunk_ids = _FromServed(list)
    passages = _FromServed(list)
    chunk_token_ids = _FromServed(list)
    chunk_parts = _FromServed(list)
    fused_fallbacks = _FromServed(int)
    sources = _FromServed(list)
    note = _FromServed(str)
    context_cache_hit = _FromServed(bool)
    kv_origins = _FromServed(list)
    prompt_tokens = _FromServed(int)
    precomputed_tokens = _FromServed(int)
    reused_by_origin = _FromServed(dict)
    reused_tokens = _FromServed(int)
    context_tokens = _FromServed(int)
    recomputed_tokens = _FromServed(int)
    first_logits = _FromServed(lambda: None)
    selected = _FromServed(lambda: None)
    spans = _FromServed(list)

    @property
    def method(self) -> str:
        """The method that ran (``auto``'s choice), or before the prefill the one asked."""
        return self.reuse.method if self.served is None else self.served.method

    @property
    def ratio(self) -> float | str:
        """The ratio asked (a number, or "auto"); once prefilled, the one used ("auto": the share it chose)."""
        return self.reuse.ratio if self.served is None else self.served.ratio

    @property
    def first_token(self) -> int:
        """The first answer token (:attr:`Answer.first_token`); -1 before it is picked."""
        return self.answer.first_token

    @property
    def ttft_ms(self) -> dict[str, float]:
        """Time to first token by stage: the prefill's (retrieve / load / select / recompute), then picking the
        first token (``first_token``), and their ``total``."""
        stages = {} if self.served is None else dict(self.served.stages_ms)
        if self.answer.first_token_ms is not None:
            stages["first_token"] = self.answer.first_token_ms
            stages["total"] = stages.get("total", 0.0) + self.answer.first_token_ms
        return stages

    def take_kv(self) -> KV:
        """Hand the prompt KV to a decoder; this object stops holding it (so its memory can go)."""
        assert self.pre is not None
        kv = self.pre.kv
        self.pre.kv = KV.empty_like(kv, kv.base_position + len(kv))
        return kv

    # -- caller side --------------------------------------------------------------------

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at the next step (no-op once finished)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def queue_ms(self) -> float:
        """Time spent waiting for the model thread before this request's prefill started."""
        start = self.prefill_started_at if self.prefill_started_at is not None else time.perf_counter()
        return (start - self.submitted_at) * 1000.0

    @property
    def server_ttft_ms(self) -> float | None:
        """Time to first token as the scheduler saw it: submission (queueing included) to the first token."""
        first = self.answer.first_token_at
        return None if first is None else (first - self.submitted_at) * 1000.0

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield this request's events until ``done``/``error`` (only without a listener)."""
        if self._events is None:
            raise RuntimeError("this request delivers its events to a listener")
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} produced no event within {timeout} s") from None
            yield ev
            if ev.kind in ("done", "error"):
                return

    def result(self, timeout: float | None = None) -> Request:
        """Block until the request finishes; returns it, finished, or raises its error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    # -- model-thread side --------------------------------------------------------------

    def emit(self, ev: Event) -> None:
        if ev.kind in ("done", "error"):
            self.answer.finished_at = time.perf_counter()
        try:
            if self._listener is not None:
                self._listener(ev)
            else:
                assert self._events is not None
                self._events.put(ev)
        except Exception:  # a listener whose consumer is gone (closed event loop) must not stop the model
            log.debug("listener of request %s failed", self.id, exc_info=True)
        if ev.kind in ("done", "error"):
            self._done.set()

    def auto_json(self) -> dict | None:
        """For ``ratio="auto"``: the setting that sized the recompute and whether the store calibrated it."""
        return None if self.auto_ratio is None else self.auto_ratio.summary()

    def to_json(self) -> dict:
        return {
            "answer": self.text,
            "method": self.method,
            "kv": self.kv_kind,
            "ratio": self.ratio,
            "auto_ratio": self.auto_json(),
            "chunk_ids": self.chunk_ids,
            "context_tokens": self.context_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "generated_tokens": len(self.token_ids),
            "ttft_ms": {k: round(v, 2) for k, v in self.ttft_ms.items()},
            "fused_fallbacks": self.fused_fallbacks,
            "sources": self.sources,
            "note": self.note,
            "context_cache_hit": self.context_cache_hit,
        }
