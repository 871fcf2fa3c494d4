"""The engine's scheduler: every request is admitted, prefilled and decoded here, whatever its door.

Continuous batching: concurrent requests decode together, one forward per step for all of them (decoding
one token is dominated by reading the weights, so B rows cost little more than one). Prefill stays per
request (its shape and KV-reuse path differ per method) and runs between decode steps, within a token
budget per step (``step_tokens``, vLLM's ``max_num_batched_tokens``): while others decode, a prefill runs
in pieces of at most the budget minus the decoding rows, one per decode step, so a long prompt delays
each stream by one piece instead of its whole prefill (``benchmarks/scheduler``); with nothing decoding
it runs in one pass: nobody waits on it.

One *model thread* owns the engine (:class:`BatchScheduler`): it prefills admitted requests
(``engine.prepare_pieces``), then decodes the active ones with the shared
:class:`~fusionrag.execution.decoder.BatchDecoder` (rows join and leave between steps); each request's
tokens and end are :mod:`fusionrag.online.outcomes`'. Shared chunk KV is never touched: a prefill gives
each request its own prompt KV, which the decoder takes over. A caller without a model thread
(``Engine.answer``, ``fusionrag ask``) runs the same steps inline, as a batch of one
(:meth:`BatchScheduler.run_inline`). The model thread also runs *tasks* (e.g. adding documents) between
steps, so the model runs one forward at a time and thread-bound resources (SQLite connections) stay on
the thread that made them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fusionrag.errors import PromptTooLongError, QueueFullError, RequestCancelledError, SchedulerClosedError
from fusionrag.execution.decoder import BatchDecoder
from fusionrag.online.limits import after_prefill, before_prefill, within_limit
from fusionrag.online.outcomes import emit_token, fail, finish
from fusionrag.online.request import ReuseRequest
from fusionrag.online.sampling import SamplingParams
from fusionrag.online.scheduled import Event, Listener, SchedulerStats, Task, drained
from fusionrag.online.state import Request

log = logging.getLogger(__name__)

#: Tokens one step computes by default: the decoding rows plus a piece of a prefill. On one CPU thread a
#: 512-token piece of qwen2.5-0.5b takes ~2-4 s, against ~70 s for a whole 8K prefill (benchmarks/scheduler).
DEFAULT_STEP_TOKENS = 512
#: The smallest piece a prefill is cut into, however many rows decode (below it, per-pass overhead dominates).
MIN_PIECE_TOKENS = 64


class BatchScheduler:
    """The model thread: prefill admitted requests, then decode all active requests together.

    ``engine`` is an :class:`~fusionrag.online.engine.Engine` (or anything with its surface: ``lm``,
    ``lock``, ``clock``, ``prepare_pieces``, ``finish``, ``prefetch``, ``prompt_tokens``) or a zero-argument factory
    that builds one; a factory runs on the model thread (so a store whose SQLite connection is
    bound to its creating thread works), and :meth:`wait_ready` reports a failure to load.

    ``max_batch`` bounds the rows of a decode step; ``max_queue`` bounds requests waiting for
    prefill (:class:`QueueFullError` beyond it); ``max_prompt_tokens`` refuses longer prompts
    (:class:`PromptTooLongError`); ``prefills_per_step`` bounds how many waiting requests are
    prefilled between two decode steps (more: lower TTFT under load; fewer: steadier decode);
    ``step_tokens`` is the tokens one step computes, decode rows plus a prefill's piece (``None``: a
    whole prefill between two decode steps).
    """

    def __init__(self, engine: Any, max_batch: int = 8, max_queue: int = 64, max_prompt_tokens: int | None = None,
                 prefills_per_step: int | None = None, stop_ids: list[int] | None = None, autostart: bool = True,
                 step_tokens: int | None = DEFAULT_STEP_TOKENS) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError("step_tokens must be >= 1 (or None: no budget)")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self._factory: Callable[[], Any] | None = engine if callable(engine) and not hasattr(engine, "prepare_pieces") \
            else None
        self.engine: Any = None if self._factory is not None else engine
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.max_prompt_tokens = max_prompt_tokens
        self.prefills_per_step = int(prefills_per_step or max_batch)
        self.step_tokens = step_tokens
        self._stop_override = stop_ids
        self.stop_ids: set[int] = set()
        self.load_error: BaseException | None = None
        self.stats = SchedulerStats()
        self._cond = threading.Condition()
        self._pending: collections.deque[Request] = collections.deque()
        self._tasks: collections.deque[Task] = collections.deque()
        self._closed = False
        self._prefetcher: ThreadPoolExecutor | None = None  # the asynchronous loader's resolver
        self._ready = threading.Event()
        self._beat = time.monotonic()  # last time the model thread finished a unit of work (or went idle)
        self._idle = True
        self._thread = threading.Thread(target=self._run, name="fusionrag-model", daemon=True)
        # batch state (model thread only)
        self._rows: dict[str, Request] = {}  # decoding, by request id (the decoder's row keys)
        self._joining: list[Request] = []
        self._prefilling: tuple[Request, Generator[None, None, Request]] | None = None  # a prefill in pieces
        self._decoder: BatchDecoder | None = None
        if autostart:
            self.start()

    # -- control ----------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the engine is loaded; raises the load error if loading failed."""
        ok = self._ready.wait(timeout)
        if self.load_error is not None:
            raise self.load_error
        return ok

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.load_error is None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the model thread; waiting and active requests fail with :class:`SchedulerClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False, cancel_futures=True)

    @property
    def queue_length(self) -> int:
        """Requests waiting for prefill (the ``max_queue`` bound applies to these)."""
        with self._cond:
            return len(self._pending)

    @property
    def active(self) -> int:
        """Requests prefilled and decoding."""
        return len(self._rows) + len(self._joining)

    @property
    def alive(self) -> bool:
        """The model thread is running (it ends only on close or when the engine failed to load)."""
        return self._thread.is_alive()

    def stalled_s(self) -> float:
        """Seconds the model thread has been busy without finishing a prefill, step or task (0 when idle).

        Liveness for ``/health``: a forward that never returns (a hung device, a deadlock)
        shows here while the event loop still answers.
        """
        return 0.0 if self._idle else max(0.0, time.monotonic() - self._beat)

    # -- submission -------------------------------------------------------------------

    def submit(self, question: str | ReuseRequest | Request, max_new_tokens: int = 32,
               listener: Listener | None = None, sampling: SamplingParams | None = None,
               **reuse_fields: Any) -> Request:
        """Admit a request: a :class:`Request` made at its door, a :class:`ReuseRequest` (validated or not: it is
        validated once, at the latest by its prefill), or a question and its fields (method, ratio, top_k,
        chunks, kv, preamble, retrieval). ``sampling`` picks the tokens (greedy by default), names stop strings.

        ``listener`` receives every :class:`Event` on the model thread (keep it cheap and
        non-blocking, e.g. ``loop.call_soon_threadsafe``); without one, read
        :meth:`Request.events` or :meth:`Request.result`.
        """
        req = Request.admitted(question, max_new_tokens, sampling, listener, **reuse_fields)
        reuse = req.reuse
        with self._cond:
            if self._closed or self.load_error is not None:
                raise SchedulerClosedError("the server is shutting down" if self._closed else
                                           f"the model failed to load: {self.load_error}")
            if len(self._pending) >= self.max_queue:
                raise QueueFullError(f"too many requests waiting ({len(self._pending)} queued, limit "
                                     f"{self.max_queue}); retry later")
            # Asynchronous loader: find this request's passages and start reading their KV while the model is
            # busy, off the caller's thread (it may be the event loop); the prefill takes the passages found,
            # so the future exists before the model thread can see the request.
            if self.engine is not None:
                if self._prefetcher is None:
                    self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="fusionrag-prefetch")
                req.resolved = self._prefetcher.submit(self._prefetch, reuse)
            self._pending.append(req)
            self._cond.notify_all()
        return req

    def _prefetch(self, reuse: Any) -> Any:
        """The prefetch thread's work for a queued request: nothing for one whose texts alone are over the limit
        (its prefill says so at once), else the engine's prefetch."""
        return self.engine.prefetch(reuse) if within_limit(self.engine, reuse, self.max_prompt_tokens) else None

    def run_task(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on the model thread between decode steps; returns a Future.

        ``fn`` may take the engine: pass it explicitly or read ``scheduler.engine`` inside.
        While a task runs, decoding pauses (the model runs one thing at a time).
        """
        task = Task(fn, args, kwargs)
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            self._tasks.append(task)
            self._cond.notify_all()
        return task.future

    # -- model thread -----------------------------------------------------------------

    def run_inline(self, request: str | ReuseRequest | Request, max_new_tokens: int = 32,
                   sampling: SamplingParams | None = None, **reuse_fields: Any) -> Iterator[Event]:
        """A batch of one on the caller's thread, without the model thread: the request's events as they happen
        (the same prefill, token choice and decode steps as a queued request). For an engine given as an
        object; the caller must not also run the model thread of this scheduler."""
        if self._decoder is None:
            self._load()
        events: collections.deque[Event] = collections.deque()
        req = Request.admitted(request, max_new_tokens, sampling, events.append, **reuse_fields)
        with torch.no_grad():
            self._prefill(req)
            yield from drained(events)
            while self._prefilling or self._rows or self._joining:
                if self._prefilling:
                    self._advance()
                self._step()
                yield from drained(events)

    def _load(self) -> None:
        if self._factory is not None:
            self.engine = self._factory()
        lm = self.engine.lm
        self._decoder = BatchDecoder(lm)
        self.stop_ids = set(lm.stop_token_ids if self._stop_override is None else self._stop_override)

    def _run(self) -> None:
        # Grad mode is per thread: without this every forward here would record autograd graphs.
        with torch.no_grad():
            try:
                self._load()
            except BaseException as exc:  # reported by wait_ready / submit / health
                self.load_error = exc
                log.error("engine failed to load: %s", exc)
            finally:
                self._ready.set()
            if self.load_error is not None:
                self._drain(SchedulerClosedError(f"the model failed to load: {self.load_error}"))
                return
            while True:
                with self._cond:
                    while not (self._closed or self._pending or self._tasks or self._rows or self._joining
                               or self._prefilling):
                        self._idle = True
                        self._cond.wait()
                    self._idle, self._beat = False, time.monotonic()
                    if self._closed:
                        break
                    # A task waits for a prefill in pieces to end (it may change the store under it).
                    task = self._tasks.popleft() if self._tasks and self._prefilling is None else None
                    n = 0 if self._prefilling else min(self.max_batch - self.active, self.prefills_per_step,
                                                       len(self._pending))
                    admitted = [self._pending.popleft() for _ in range(max(0, n))]
                if task is not None:
                    self._run_task(task)
                    self._beat = time.monotonic()
                if self._prefilling:
                    self._advance()
                for i, req in enumerate(admitted):
                    self._prefill(req)
                    self._beat = time.monotonic()
                    if self._prefilling:  # it runs in pieces: the others wait for it, first in line
                        with self._cond:
                            self._pending.extendleft(reversed(admitted[i + 1:]))
                        break
                if self._rows or self._joining:
                    try:
                        self._step()
                    except Exception as exc:  # never let one bad step kill the server
                        log.exception("batched decode step failed")
                        for req in [*self._rows.values(), *self._joining]:
                            fail(req, exc, self.stats)
                        self._reset_batch()
            self._drain(SchedulerClosedError("the server is shutting down"))

    def _drain(self, exc: BaseException) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
            tasks, self._tasks = list(self._tasks), collections.deque()
        if self._prefilling:
            pending.append(self._prefilling[0])
            self._prefilling[1].close()
            self._prefilling = None
        for req in [*pending, *self._rows.values(), *self._joining]:
            fail(req, exc, self.stats)
        for task in tasks:
            task.future.set_exception(exc)
        self._reset_batch()

    def _lock(self) -> threading.RLock:
        """The engine's own lock, so direct ``engine.answer`` calls elsewhere never overlap ours."""
        return self.engine.lock

    def _run_task(self, task: Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        self.stats.tasks += 1
        try:
            with self._lock():
                result = task.fn(*task.args, **task.kwargs)
        except BaseException as exc:
            task.future.set_exception(exc)
        else:
            task.future.set_result(result)

    def _prefill(self, req: Request) -> None:
        """Start ``req``'s prefill: in one pass when nothing decodes (nobody waits on it), else in pieces of
        the step's token budget left by the decoding rows, one piece per decode step (:meth:`_advance`)."""
        req.prefill_started_at = time.perf_counter()
        if req.cancelled:
            fail(req, RequestCancelledError("cancelled before prefill"), self.stats)
            return
        t0 = time.perf_counter()
        try:
            req.reuse = reuse = req.reuse.validated()
            resolved = before_prefill(self.engine, reuse, req.prefetched, self.max_prompt_tokens)
            decoding = len(self._rows) + len(self._joining)
            piece = None if not decoding or self.step_tokens is None else \
                max(MIN_PIECE_TOKENS, self.step_tokens - decoding)
            pieces = self.engine.prepare_pieces(req, resolved, piece)
        except Exception as exc:
            self.stats.prefills += 1
            fail(req, exc, self.stats)
            return
        finally:
            self.stats.prefill_seconds += time.perf_counter() - t0
        self._prefilling = (req, pieces)
        self._advance()

    def _advance(self) -> None:
        """Run the prefill in pieces: its next piece while others decode, else every piece left."""
        assert self._prefilling is not None
        req, pieces = self._prefilling
        t0 = time.perf_counter()
        try:
            while True:
                if req.cancelled:
                    raise RequestCancelledError("cancelled during its prefill")
                with self._lock():
                    next(pieces)
                self.stats.prefill_pieces += 1
                if self._rows or self._joining:
                    return
        except StopIteration:
            self.stats.prefill_pieces += 1
        except Exception as exc:
            pieces.close()
            self._prefilling = None
            self.stats.prefills += 1
            fail(req, exc, self.stats)
            return
        finally:
            self.stats.prefill_seconds += time.perf_counter() - t0
        self._prefilling = None
        self.stats.prefills += 1
        try:
            req.max_new_tokens = after_prefill(self.engine, req.prompt_tokens, req.max_new_tokens,
                                               self.max_prompt_tokens)
        except PromptTooLongError as exc:
            fail(req, exc, self.stats)
            return
        if req.max_new_tokens <= 0:
            finish(self.engine, req, "length", self.stats)
            return
        # the first token needs no forward
        if emit_token(self.engine, req, req.pre.last_logits, self.stop_ids, self.stats):
            self._joining.append(req)

    # -- the batch ----------------------------------------------------------------------

    def _reset_batch(self) -> None:
        self._rows, self._joining = {}, []
        if self._decoder is not None:
            self._decoder.clear()

    def _leave(self, gone: list[str]) -> None:
        for rid in gone:
            self._rows.pop(rid, None)
        assert self._decoder is not None
        before = self._decoder.compactions
        self._decoder.drop(gone)
        self.stats.compactions += self._decoder.compactions - before

    def _step(self) -> None:
        """One batched decode step: the last token of every row, each at its own position."""
        assert self._decoder is not None
        for req in self._joining:  # the decoder holds the only copy of the prompt KV from now on
            self._decoder.join(req.id, req.take_kv())
            self._rows[req.id] = req
        self._joining = []
        # Requests cancelled since the last step leave before spending a forward on them.
        gone = [rid for rid, r in self._rows.items() if r.cancelled]
        for rid in gone:
            fail(self._rows[rid], RequestCancelledError("cancelled while decoding"), self.stats)
        if gone:
            self._leave(gone)
        if not self._rows:
            return
        t0 = time.perf_counter()
        batch = len(self._rows)
        with self._lock():
            logits = self._decoder.step({rid: r.last_token for rid, r in self._rows.items()})
        self.stats.decode_steps += 1
        self.stats.decode_rows += batch
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, batch)
        gone = [rid for rid, req in list(self._rows.items())
                if not emit_token(self.engine, req, logits[rid], self.stop_ids, self.stats)]
        self._beat = time.monotonic()
        if gone:
            self._leave(gone)
        self.stats.decode_seconds += time.perf_counter() - t0
