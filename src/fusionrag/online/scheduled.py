"""A request in the scheduler: its lifecycle, its events, and the errors it can end with.

The caller's side (``events``, ``result``, ``cancel``) is thread-safe; the ``_emit`` side runs
on the model thread (:mod:`fusionrag.online.scheduler`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fusionrag.execution.generate import TextStreamer
from fusionrag.online.request import ReuseRequest
from fusionrag.online.sampling import SamplingParams, StopMatcher, TokenSampler

log = logging.getLogger(__name__)


@dataclass
class Event:
    """One thing that happened to a request, in order: ``token``* then ``done`` or ``error``."""

    kind: str  # "token" | "done" | "error"
    token: int | None = None
    text: str = ""  # the text delta (may be "" inside a multi-byte character or a possible stop string);
    #                 on "done": the text held back until the end, if any
    answer: Any = None  # the finished fusionrag.online.state.Request, on "done"
    logprob: float | None = None  # of this token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length", on "done"
    error: BaseException | None = None


Listener = Callable[[Event], None]


@dataclass
class SchedulerStats:
    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over steps (tokens decoded by batched forwards)
    max_batch_seen: int = 0
    tokens_generated: int = 0  # including each request's first token (from the prefill logits)
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    tasks: int = 0
    compactions: int = 0  # batch caches re-packed because padding outgrew the KV
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mean_batch"] = self.decode_rows / self.decode_steps if self.decode_steps else 0.0
        return d


@dataclass
class Task:
    """Work run on the model thread between decode steps (e.g. a document job's slice), and its result."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    future: Future = dataclasses.field(default_factory=Future)


def drained(events: collections.deque[Event]) -> Iterator[Event]:
    """The events gathered so far, oldest first, removed as they are read."""
    while events:
        yield events.popleft()


class DecodeRequest:
    """A submitted request: its events, its result, and its place in the batch."""

    def __init__(self, reuse: ReuseRequest, max_new_tokens: int, listener: Listener | None,
                 sampling: SamplingParams | None = None) -> None:
        self.id = uuid.uuid4().hex
        self.reuse = reuse  # the question and how to reuse KV for it (validated once, by the door or the prefill)
        self.resolved: Future | None = None  # the prefetch's Resolved passages, the request's own
        self.max_new_tokens = int(max_new_tokens)
        self.sampling = sampling or SamplingParams()
        self.sampler = TokenSampler(self.sampling)
        self.stop_matcher = StopMatcher(self.sampling.stop)
        self.text = ""  # what was emitted so far (stop strings cut, held-back tails included at the end)
        self.submitted_at = time.perf_counter()
        self.prefill_started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.prep: Any = None  # the prepared fusionrag.online.state.Request, after prefill
        self.prompt_tokens = 0
        self.tokens: list[int] = []
        self.token_times: list[float] = []  # perf_counter() of each generated token (inter-token latency)
        self.answer: Any = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._listener = listener
        self._events: queue.Queue[Event] | None = None if listener is not None else queue.Queue()
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._streamer: TextStreamer | None = None
        self.last_token = -1  # decode state (model thread only)

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
    def ttft_ms(self) -> float | None:
        """Server-side time to first token: submission (queueing included) to the first token."""
        return None if self.first_token_at is None else (self.first_token_at - self.submitted_at) * 1000.0

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

    def result(self, timeout: float | None = None) -> Any:
        """Block until the request finishes; returns its finished ``Request`` or raises its error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.answer

    # -- model-thread side --------------------------------------------------------------

    def _emit(self, ev: Event) -> None:
        if ev.kind in ("done", "error"):
            self.finished_at = time.perf_counter()
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
