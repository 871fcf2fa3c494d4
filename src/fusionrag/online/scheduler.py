"""The engine's scheduler: every request is admitted, prefilled and decoded here, whatever its door.

Continuous batching: concurrent requests decode together, one forward per step for all of them (decoding
one token is dominated by reading the weights, so B rows cost little more than one). Prefill stays per
request (its shape and KV-reuse path differ per method) and runs between decode steps, within a token
budget per step (``step_tokens``, vLLM's ``max_num_batched_tokens``): while others decode, a prefill runs
in pieces of at most the budget minus the decoding rows, one per decode step, so a long prompt delays
each stream by one piece instead of its whole prefill (``benchmarks/scheduler``); with nothing decoding
it runs in one pass: nobody waits on it.

One *model thread* owns the engine (:class:`BatchScheduler`): it advances admitted requests' prefill plans
(:class:`~fusionrag.online.prefill_plan.PrefillPlan`, from the engine's ``plan``), then decodes the active
ones with the shared :class:`~fusionrag.execution.decoder.BatchDecoder` (rows join and leave between steps);
each token goes through the output step (:mod:`fusionrag.online.output`). The scheduler alone moves a
request through its states (waiting -> prefilling -> decoding -> finished_*, :data:`~fusionrag.online.state.MOVES`),
and its queues say the same (:meth:`BatchScheduler.states`). It knows the engine only as a
:class:`~fusionrag.online.prefill_plan.Prefiller`. Shared chunk KV is never touched: a prefill gives
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
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fusionrag.errors import PromptTooLongError, RequestCancelledError, SchedulerClosedError
from fusionrag.online.admission import Admission
from fusionrag.online.decode_batch import DecodeBatch
from fusionrag.online.limits import after_prefill, before_prefill, within_limit
from fusionrag.online.output import closing_text, take_token
from fusionrag.online.prefill_plan import Prefiller, PrefillPlan
from fusionrag.online.scheduled import Event, Task, drained
from fusionrag.online.state import Request, Status

log = logging.getLogger(__name__)

#: Tokens one step computes by default: the decoding rows plus a piece of a prefill. On one CPU thread a
#: 512-token piece of qwen2.5-0.5b takes ~2-4 s, against ~70 s for a whole 8K prefill (benchmarks/scheduler).
DEFAULT_STEP_TOKENS = 512
#: The smallest piece a prefill is cut into, however many rows decode (below it, per-pass overhead dominates).
MIN_PIECE_TOKENS = 64


class BatchScheduler(Admission):
    """The model thread: prefill admitted requests, then decode all active requests together.

    ``engine`` is a :class:`~fusionrag.online.prefill_plan.Prefiller` (an :class:`~fusionrag.online.engine.Engine`)
    or a zero-argument factory that builds one; a factory runs on the model thread (so a store whose SQLite
    connection is bound to its creating thread works), and :meth:`wait_ready` reports a failure to load.

    ``max_batch`` bounds the rows of a decode step; ``max_queue`` bounds requests waiting for
    prefill (:class:`QueueFullError` beyond it); ``max_prompt_tokens`` refuses longer prompts
    (:class:`PromptTooLongError`); ``prefills_per_step`` bounds how many waiting requests are
    prefilled between two decode steps (more: lower TTFT under load; fewer: steadier decode);
    ``step_tokens`` is the tokens one step computes, decode rows plus a prefill's piece (``None``: a
    whole prefill between two decode steps).
    """

    def __init__(self, engine: Prefiller | Callable[[], Prefiller], max_batch: int = 8, max_queue: int = 64,
                 max_prompt_tokens: int | None = None,
                 prefills_per_step: int | None = None, stop_ids: list[int] | None = None, autostart: bool = True,
                 step_tokens: int | None = DEFAULT_STEP_TOKENS) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError("step_tokens must be >= 1 (or None: no budget)")
        super().__init__(max_queue)
        self._factory: Callable[[], Prefiller] | None = None if hasattr(engine, "plan") else engine  # type: ignore
        self.engine: Prefiller = None if self._factory is not None else engine  # type: ignore[assignment]
        self.max_batch = int(max_batch)
        self.max_prompt_tokens = max_prompt_tokens
        self.prefills_per_step = int(prefills_per_step or max_batch)
        self.step_tokens = step_tokens
        self._stop_override = stop_ids
        self.stop_ids: set[int] = set()
        # model thread only
        self._prefilling: PrefillPlan | None = None  # a prefill in pieces
        self._batch: DecodeBatch | None = None  # the decoding requests
        if autostart:
            self.start()

    @property
    def active(self) -> int:
        """Requests prefilled and decoding."""
        return len(self._batch) if self._batch is not None else 0

    def _prefetch(self, reuse: Any) -> Any:
        """The prefetch thread's work for a queued request: nothing for one whose texts alone are over the limit
        (its prefill says so at once), else the engine's prefetch."""
        return self.engine.prefetch(reuse) if within_limit(self.engine, reuse, self.max_prompt_tokens) else None

    # -- model thread -----------------------------------------------------------------

    def run_inline(self, request: Request) -> Iterator[Event]:
        """A batch of one on the caller's thread, without the model thread: the request's events as they happen
        (the same prefill plan, output step and decode steps as a queued request). For an engine given as an
        object; the caller must not also run the model thread of this scheduler."""
        if self._batch is None:
            self._load()
        events: collections.deque[Event] = collections.deque()
        request.listen(events.append)
        with torch.no_grad():
            self._prefill(request)
            yield from drained(events)
            while self._prefilling or self.active:
                if self._prefilling:
                    self._advance()
                self._step()
                yield from drained(events)

    def states(self) -> dict[Status, list[str]]:
        """The request ids each container holds, by the status that container means: the queue's are waiting,
        the prefill in pieces is prefilling, the batch's rows are decoding (a test holds the statuses to it)."""
        with self._cond:
            waiting = [r.id for r in self._pending]
        return {Status.WAITING: waiting,
                Status.PREFILLING: [self._prefilling.req.id] if self._prefilling is not None else [],
                Status.DECODING: self._batch.ids() if self._batch is not None else []}

    def _load(self) -> None:
        if self._factory is not None:
            self.engine = self._factory()
        lm = self.engine.lm
        self._batch = DecodeBatch(lm, self.stats)
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
                    while not (self._closed or self._pending or self._tasks or self.active or self._prefilling):
                        self._idle = True
                        self._cond.wait()
                    self._idle, self._beat = False, time.monotonic()
                    if self._closed:
                        break
                    # A task waits for a prefill in pieces to end (it may change the store under it).
                    task = self._tasks.popleft() if self._tasks and self._prefilling is None else None
                if task is not None:
                    self._run_task(task)
                    self._beat = time.monotonic()
                if self._prefilling:
                    self._advance()
                for _ in range(self.prefills_per_step):  # a request leaves the queue as its prefill starts
                    if self._prefilling or self.active >= self.max_batch:
                        break  # one prefill in pieces at a time: the others wait for it, first in line
                    with self._cond:
                        req = self._pending.popleft() if self._pending else None
                    if req is None:
                        break
                    self._prefill(req)
                    self._beat = time.monotonic()
                if self.active:
                    try:
                        self._step()
                    except Exception as exc:  # never let one bad step kill the server
                        log.exception("batched decode step failed")
                        self._fail_batch(exc)
            self._drain(SchedulerClosedError("the server is shutting down"))

    def _drain(self, exc: BaseException) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
            tasks, self._tasks = list(self._tasks), collections.deque()
        if self._prefilling:
            pending.append(self._prefilling.req)
            self._prefilling.close()
            self._prefilling = None
        for req in pending:
            self._fail(req, exc)
        self._fail_batch(exc)
        for task in tasks:
            task.future.set_exception(exc)

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
        """Start ``req``'s prefill plan: in one pass when nothing decodes (nobody waits on it), else in pieces of
        the step's token budget left by the decoding rows, one piece per decode step (:meth:`_advance`)."""
        req.prefill_started_at = time.perf_counter()
        if req.cancelled:
            self._fail(req, RequestCancelledError("cancelled before prefill"))
            return
        req.move(Status.PREFILLING)
        t0 = time.perf_counter()
        try:
            req.reuse = reuse = req.reuse.validated()
            resolved = before_prefill(self.engine, reuse, req.prefetched, self.max_prompt_tokens)
            decoding = self.active
            piece = None if not decoding or self.step_tokens is None else \
                max(MIN_PIECE_TOKENS, self.step_tokens - decoding)
            plan = self.engine.plan(req, resolved, piece)
        except Exception as exc:
            self.stats.prefills += 1
            self._fail(req, exc)
            return
        finally:
            self.stats.prefill_seconds += time.perf_counter() - t0
        self._prefilling = plan
        self._advance()

    def _advance(self) -> None:
        """Advance the prefill plan: its next piece while others decode, else every piece left; then the first
        token (its logits are the prefill's: no forward), and the request joins the batch unless that ended it."""
        plan = self._prefilling
        assert plan is not None
        req = plan.req
        t0 = time.perf_counter()
        try:
            while True:
                if req.cancelled:
                    raise RequestCancelledError("cancelled during its prefill")
                with self._lock():
                    prefilled = plan.advance()
                self.stats.prefill_pieces += 1
                if prefilled:
                    break
                if self.active:
                    return
        except Exception as exc:
            plan.close()
            self._prefilling = None
            self.stats.prefills += 1
            self._fail(req, exc)
            return
        finally:
            self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefills += 1
        try:
            req.max_new_tokens = after_prefill(self.engine, req.prompt_tokens, req.max_new_tokens,
                                               self.max_prompt_tokens)
        except PromptTooLongError as exc:
            self._fail(req, exc)
            return
        if req.max_new_tokens <= 0:
            self._finish(req, "length")
            return
        assert req.pre is not None and self._batch is not None
        if self._emit(req, req.pre.last_logits):  # the first token, sent while the request is still prefilling
            req.move(Status.DECODING)
            self._batch.add(req)
            self._prefilling = None

    # -- a request's tokens and end: only here is a request moved ------------------------

    def _emit(self, req: Request, logits: torch.Tensor) -> bool:
        """The output step for ``req``'s next token; False once the request has ended (finished or failed)."""
        try:
            reason = take_token(req, logits, self.stop_ids, self.engine.lm.tokenizer, self.engine.clock, self.stats)
        except Exception as exc:  # this request's sampling, not the batch, failed
            log.warning("sampling failed for request %s", req.id, exc_info=True)
            self._fail(req, exc)
            return False
        if reason is not None:
            self._finish(req, reason)
            return False
        return True

    def _release(self, req: Request) -> None:
        """``req`` leaves the container it is in (its prefill, the batch): an ended request is held nowhere."""
        if self._prefilling is not None and self._prefilling.req is req:
            self._prefilling = None
        if self._batch is not None:
            self._batch.release(req)

    def _finish(self, req: Request, reason: str) -> None:
        """End ``req`` with its answer (``reason``: ``stop`` or ``length``), sending what was held back."""
        self._release(req)
        try:
            tail = closing_text(req)
        except Exception as exc:
            self._fail(req, exc)
            return
        req.answer.finish_reason = reason
        req.move(Status.FINISHED_STOPPED if reason == "stop" else Status.FINISHED_LENGTH)
        self.stats.completed += 1
        req.emit(Event("done", answer=req, finish_reason=reason, text=tail))

    def _fail(self, req: Request, exc: BaseException) -> None:
        """End ``req`` with ``exc`` (cancelled or failed), once."""
        if req.status.finished:
            return
        self._release(req)
        req.error = exc
        cancelled = isinstance(exc, RequestCancelledError)
        if cancelled:
            self.stats.cancelled += 1
        else:
            self.stats.failed += 1
        req.move(Status.FINISHED_ABORTED if cancelled else Status.FINISHED_ERROR)
        req.emit(Event("error", error=exc))

    # -- the batch ----------------------------------------------------------------------

    def _fail_batch(self, exc: BaseException) -> None:
        """Every decoding request fails with ``exc`` (a step that failed, the server closing); the batch empties."""
        if self._batch is not None:
            for req in self._batch.requests():
                self._fail(req, exc)
            self._batch.clear()

    def _step(self) -> None:
        """One batched decode step: the last token of every row, each at its own position."""
        batch = self._batch
        assert batch is not None
        for req in batch.seat():  # cancelled since the last step: they leave before a forward is spent on them
            self._fail(req, RequestCancelledError("cancelled while decoding"))
        batch.settle()
        if not batch.rows:
            return
        t0 = time.perf_counter()
        logits = batch.step(self._lock())
        for rid, req in list(batch.rows.items()):
            self._emit(req, logits[rid])
        batch.settle()
        self._beat = time.monotonic()
        self.stats.decode_seconds += time.perf_counter() - t0
