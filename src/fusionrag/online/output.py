"""The output step: a request's next token picked from its logits, turned into text once, its stop rules applied.

The scheduler (:mod:`fusionrag.online.scheduler`) calls it for every row of a decode step and for the
first token (whose logits the prefill made); the scheduler alone then moves the request (decoding on,
finished, failed). A token is picked with the request's own sampling, detokenised incrementally (each
token decoded once: :class:`~fusionrag.execution.generate.TextStreamer`), checked against the stop tokens
and strings, the structured answer's end and the length limit, and sent as a ``token``
:class:`~fusionrag.online.scheduled.Event`; the answer's text is the streamer's, never decoded again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fusionrag.execution.generate import TextStreamer
from fusionrag.models.clock import StageClock
from fusionrag.online.scheduled import Event, SchedulerStats
from fusionrag.online.state import Request


def take_token(req: Request, logits: torch.Tensor, stop_ids: set[int], tokenizer: Any,
               clock: Callable[[], StageClock], stats: SchedulerStats) -> str | None:
    """Pick ``req``'s next token from ``logits`` and send it; the finish reason (``stop`` or ``length``) when this
    token ends the request, else None. A sampling failure raises: it is this request's, not the batch's."""
    run = req.progress
    answer = req.answer
    timing = clock() if answer.first_token < 0 else None  # picking the first token: TTFT's last stage
    picked = run.sampler.pick(logits)
    if timing is not None:
        answer.first_token, answer.first_token_ms = picked.token, timing.total()
    if picked.token in stop_ids or picked.token in req.sampling.stop_token_ids:
        return "stop"
    if run.streamer is None:
        run.streamer = TextStreamer(tokenizer, req.sampling.skip_special_tokens)
    answer.token_ids.append(picked.token)
    answer.token_times.append(time.perf_counter())
    stats.tokens_generated += 1
    if answer.first_token_at is None:
        answer.first_token_at = answer.token_times[-1]
    text = run.stop_matcher.push(run.streamer.push(picked.token))
    answer.emitted += text
    req.emit(Event("token", token=picked.token, text=text, logprob=picked.logprob, top_logprobs=picked.top))
    if run.stop_matcher.stopped or (run.sampler.constraint is not None and run.sampler.constraint.done):
        return "stop"  # a stop string, or a structured answer that is complete
    if len(answer.token_ids) >= req.max_new_tokens:
        return "length"
    run.last_token = picked.token
    return None


def closing_text(req: Request) -> str:
    """What was held back until the end (an unfinished character, a possible stop string), sent with ``done``;
    sets the answer's ``text``: the streamer's, the tokens decoded once."""
    run = req.progress
    tail = run.stop_matcher.push(run.streamer.flush()) if run.streamer is not None else ""
    tail += run.stop_matcher.flush()
    req.answer.emitted += tail
    req.answer.text = run.streamer.text.strip() if run.streamer is not None else ""
    return tail
