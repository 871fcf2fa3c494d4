"""The scheduler's front desk: where requests and tasks wait for the model thread, safe from any thread.

:class:`Admission` holds what callers on other threads touch (the event loop, a CLI, a document job): the
queue of admitted requests (bounded: :class:`~fusionrag.errors.QueueFullError` beyond ``max_queue``), the
tasks to run between steps, the prefetch thread that finds a queued request's passages early, and the model
thread's life (start, ready, close) and liveness (``stalled_s`` for ``/health``). What the model thread does
with them is :class:`~fusionrag.online.scheduler.BatchScheduler`'s, which extends it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fusionrag.errors import QueueFullError, SchedulerClosedError
from fusionrag.online.scheduled import Listener, SchedulerStats, Task
from fusionrag.online.state import Request


class Admission:
    """The queue, the tasks and the model thread's life (module doc); ``_run`` is the model thread's body and
    ``_prefetch`` a queued request's early work, both the scheduler's."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = int(max_queue)
        self.engine: Any = None
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

    def _run(self) -> None:
        raise NotImplementedError

    def _prefetch(self, reuse: Any) -> Any:
        raise NotImplementedError

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

    def submit(self, request: Request, listener: Listener | None = None) -> Request:
        """Admit ``request`` (made at its door: :meth:`Request.of` for a question and its fields), the one way in;
        its :class:`~fusionrag.online.request.ReuseRequest` is validated once, at the latest by its prefill.

        ``listener`` receives every :class:`Event` on the model thread (keep it cheap and
        non-blocking, e.g. ``loop.call_soon_threadsafe``); without one, read
        :meth:`Request.events` or :meth:`Request.result`.
        """
        req = request
        if listener is not None:
            req.listen(listener)
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
            if self.engine is not None and req.resolved is None:
                if self._prefetcher is None:
                    self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="fusionrag-prefetch")
                req.resolved = self._prefetcher.submit(self._prefetch, req.reuse)
            self._pending.append(req)
            self._cond.notify_all()
        return req

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
