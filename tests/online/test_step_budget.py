"""The scheduler's token budget per step: a long prefill arriving runs in pieces between decode steps.

Four streams decode; a long Full Attention prompt arrives. Without a budget its whole prefill
runs between two decode steps (the streams get no token until it ends); with one, it runs in
pieces of the budget and the streams decode between them. Either way every request's tokens are
the ones it gets alone (the pieces equal one pass: ``tests/execution/test_prefill_pieces.py``).
"""

from __future__ import annotations

import threading

import pytest

from fusionrag.models import load_model
from fusionrag.online.engine import Engine
from fusionrag.online.scheduler import MIN_PIECE_TOKENS, BatchScheduler
from fusionrag.online.state import Request

STREAMS = ["Who discovered polonium?", "Where was Marie Curie born?", "What flows through Paris?", "Name a moon."]
LONG = [{"title": f"Passage {i}", "text": f"Passage {i} says the river number {i} runs past the old mill "
         "and the bridge, then turns north toward the hills where the town keeps its records."} for i in range(6)]


def make_engine() -> Engine:
    return Engine(None, load_model("tiny-llama"))


def run(step_tokens: int | None) -> tuple[list[str], dict[str, list[int]], int]:
    """Streams decoding, then the long prompt: the order of token events, each request's tokens, pieces run."""
    sched = BatchScheduler(make_engine, max_batch=8, stop_ids=[], step_tokens=step_tokens)
    sched.wait_ready(120)
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    lock = threading.Lock()
    started = threading.Semaphore(0)

    def listener(tag: str):
        def on(event) -> None:
            with lock:
                if event.kind == "token":
                    order.append(tag)
                    tokens.setdefault(tag, []).append(event.token)
                    if len(tokens[tag]) == 1 and tag != "long":
                        started.release()
        return on

    try:
        reqs = [sched.submit(Request.of(q, max_new_tokens=48, chunks=[], method="full"), listener=listener(f"s{i}"))
                for i, q in enumerate(STREAMS)]
        for _ in STREAMS:
            assert started.acquire(timeout=60)
        with lock:
            order.append("arrived")
        pieces = sched.stats.prefill_pieces
        reqs.append(sched.submit(Request.of("Which river runs past the mill?", max_new_tokens=4, chunks=LONG,
                                            method="full"), listener=listener("long")))
        for r in reqs:
            r.result(120)  # finished (a TimeoutError if not)
        return order, tokens, sched.stats.prefill_pieces - pieces
    finally:
        sched.close()


def alone(question: str, chunks: list[dict], n: int) -> list[int]:
    """The request run alone: a batch of one, as ``Engine.answer`` runs it (no stop token, as above)."""
    inline = BatchScheduler(make_engine(), stop_ids=[], autostart=False)
    events = inline.run_inline(Request.of(question, n, method="full", chunks=chunks))
    return [e.token for e in events if e.kind == "token"]


def _between(order: list[str]) -> int:
    """Stream tokens after the long prompt arrived and before its first token."""
    tail = order[order.index("arrived"):]
    return sum(1 for tag in tail[:tail.index("long")] if tag.startswith("s"))


@pytest.mark.slow
def test_a_long_prefill_runs_in_pieces_between_decode_steps():
    whole_order, whole_tokens, whole_pieces = run(None)
    cut_order, cut_tokens, cut_pieces = run(MIN_PIECE_TOKENS)
    assert whole_pieces == 1 and _between(whole_order) <= len(STREAMS)  # at most the step already under way
    assert cut_pieces >= 4  # ~500 tokens in pieces of at most 64, less the rows decoding
    assert _between(cut_order) >= len(STREAMS) * (cut_pieces - 1)  # every stream decoded between the pieces
    assert cut_tokens == whole_tokens  # the same tokens, budget or not
    assert cut_tokens["long"] == alone("Which river runs past the mill?", LONG, 4)
