"""What becomes of a request on the model thread once it has logits: its next token picked and sent, or its end.

Apart from the scheduler (:mod:`fusionrag.online.scheduler`), which keeps the queue, the prefills and
the batch: these are the per-request rules every one of them ends in. A token is picked with the
request's own sampling, checked against the stop tokens and strings and its length limit, and sent as
an :class:`~fusionrag.online.scheduled.Event`; a request ends once, ``done`` or ``error``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from fusionrag.errors import RequestCancelledError
from fusionrag.execution.generate import TextStreamer
from fusionrag.online.scheduled import Event, SchedulerStats
from fusionrag.online.state import Request, Status

log = logging.getLogger(__name__)


def fail(req: Request, exc: BaseException, stats: SchedulerStats) -> None:
    """End ``req`` with ``exc`` (cancelled or failed), once."""
    if req.finished:
        return
    req.error = exc
    if isinstance(exc, RequestCancelledError):
        stats.cancelled += 1
        req.status = Status.CANCELLED
    else:
        stats.failed += 1
        req.status = Status.FAILED
    req.emit(Event("error", error=exc))


def finish(engine: Any, req: Request, reason: str, stats: SchedulerStats) -> None:
    """End ``req`` with its answer (``reason``: ``stop`` or ``length``), sending what was held back."""
    req.finish_reason = reason
    # what the streamer (an unfinished character) and the stop matcher (a possible stop string) held back
    tail = req.stop_matcher.push(req.streamer.flush()) if req.streamer is not None else ""
    tail += req.stop_matcher.flush()
    req.emitted += tail
    try:
        engine.finish(req, list(req.token_ids))
    except Exception as exc:
        fail(req, exc, stats)
        return
    stats.completed += 1
    req.emit(Event("done", answer=req, finish_reason=reason, text=tail))


def emit_token(engine: Any, req: Request, logits: torch.Tensor, stop_ids: set[int], stats: SchedulerStats) -> bool:
    """Pick the request's next token from ``logits`` and send it; False once the request has ended."""
    clock = engine.clock() if req.first_token < 0 else None  # picking the first token: TTFT's last stage
    try:
        picked = req.sampler.pick(logits)
    except Exception as exc:  # this request's sampling, not the batch, failed
        log.warning("sampling failed for request %s", req.id, exc_info=True)
        fail(req, exc, stats)
        return False
    if clock is not None:
        req.first_token = picked.token
        req.picked_first(clock.total())
    if picked.token in stop_ids or picked.token in req.sampling.stop_token_ids:
        finish(engine, req, "stop", stats)
        return False
    if req.streamer is None:
        req.streamer = TextStreamer(engine.lm.tokenizer, req.sampling.skip_special_tokens)
    req.token_ids.append(picked.token)
    req.token_times.append(time.perf_counter())
    stats.tokens_generated += 1
    if req.first_token_at is None:
        req.first_token_at = req.token_times[-1]
    text = req.stop_matcher.push(req.streamer.push(picked.token))
    req.emitted += text
    req.emit(Event("token", token=picked.token, text=text, logprob=picked.logprob, top_logprobs=picked.top))
    if req.stop_matcher.stopped or (req.sampler.constraint is not None and req.sampler.constraint.done):
        finish(engine, req, "stop", stats)  # a stop string, or a structured answer that is complete
        return False
    if len(req.token_ids) >= req.max_new_tokens:
        finish(engine, req, "length", stats)
        return False
    req.last_token = picked.token
    return True
