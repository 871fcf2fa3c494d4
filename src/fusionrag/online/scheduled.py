"""What the scheduler hands around besides requests: a request's events, its statistics, a task.

A request's events (``token``* then ``done`` or ``error``) reach its listener or its queue
(:class:`~fusionrag.online.state.Request`); tasks run on the model thread between decode steps.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


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
    prefill_pieces: int = 0  # passes prefills ran in (more than prefills: long prompts cut to the step budget)
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
