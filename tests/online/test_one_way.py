"""Issue 48: the scheduler alone moves a request through its states, and its queues say the same; each token is
decoded once; one way in (``submit(Request)``), through which ``Engine.prepare`` runs too."""

from __future__ import annotations

import threading

import pytest

from fusionrag.models import load_model
from fusionrag.online.engine import Engine
from fusionrag.online.scheduler import BatchScheduler
from fusionrag.online.state import MOVES, Request, Status

QUESTIONS = ["Who discovered polonium?", "Capital of France?", "Where was Marie Curie born?",
             "What flows through Paris?", "Name a moon of Mars."]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


def test_the_queues_and_the_statuses_agree_at_every_event(lm):
    """Five requests, two rows: some wait, one prefills, two decode. At every event (on the model thread, between
    two of the scheduler's moves) each request is in the container its status names, and nowhere else."""
    sched = BatchScheduler(Engine(None, lm), max_batch=2, stop_ids=[])
    reqs: list[Request] = []
    seen: list[tuple[str, ...]] = []
    wrong: list[str] = []
    ready = threading.Event()

    def check(_event) -> None:
        ready.wait(10)
        states = sched.states()
        where = {rid: status for status, ids in states.items() for rid in ids}
        for r in reqs:
            expected = where.get(r.id)
            if r.status.finished:
                if expected is not None:
                    wrong.append(f"{r.id} is {r.status} but held as {expected}")
            elif expected != r.status:
                wrong.append(f"{r.id} is {r.status} but held as {expected}")
        seen.append(tuple(sorted(str(r.status) for r in reqs)))

    try:
        sched.wait_ready(60)
        for q in QUESTIONS:
            req = Request.of(q, max_new_tokens=6, chunks=[], method="full")
            reqs.append(req)
            sched.submit(req, listener=check)
        ready.set()
        for r in reqs:
            r.result(120)
    finally:
        sched.close()
    assert not wrong, wrong[:5]
    assert all(r.status == Status.FINISHED_LENGTH for r in reqs)
    statuses = {s for snapshot in seen for s in snapshot}
    assert {"waiting", "decoding", "finished_length"} <= statuses, statuses  # the states were all passed through


def test_a_request_moves_only_forward():
    req = Request.of("q?")
    with pytest.raises(RuntimeError, match="cannot move"):
        req.move(Status.DECODING)  # waiting -> decoding skips its prefill
    req.move(Status.PREFILLING)
    req.move(Status.FINISHED_ERROR)
    with pytest.raises(RuntimeError, match="cannot move"):
        req.move(Status.PREFILLING)  # nothing leaves an end
    assert all(not s.finished for s in MOVES) and all(s.finished for s in Status if s not in MOVES)


def test_each_token_is_decoded_once(lm, monkeypatch):
    """The streamer decodes each token with the few before it, and the answer's text is its text: decoding an
    answer of n tokens reads O(n) ids (it was n(n+1)/2 for the stream plus n for the answer)."""
    engine = Engine(None, lm)
    engine.scheduler.stop_ids = set()
    decoded = []
    real = type(lm.tokenizer).decode

    def counting(self, ids, *args, **kwargs):
        decoded.append(len(ids))
        return real(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(lm.tokenizer), "decode", counting)
    engine.scheduler._load()
    engine.scheduler.stop_ids = set()
    n = 60
    answer = engine.answer("Who discovered polonium?", method="full", chunks=[], max_new_tokens=n)
    assert len(answer.token_ids) == n
    assert sum(decoded) <= 6 * n, (sum(decoded), decoded)  # quadratic would be ~1,900
    monkeypatch.undo()
    assert answer.text == lm.tokenizer.decode(answer.token_ids, skip_special_tokens=True).strip()


def test_the_request_is_what_was_asked_what_was_served_and_what_was_answered(lm):
    """Three objects, each written by one stage: before its prefill a request reads as asked (its method and
    ratio) with nothing served; after it, what was served is one ``Served`` the prefill wrote, which nothing
    else may set through the request, and the answer is the output step's (its first token included)."""
    from fusionrag.online.served import Served

    engine = Engine(None, lm)
    req = Request.of("Who discovered polonium?", max_new_tokens=4, method="full", chunks=[{"text": "Marie Curie."}])
    assert req.served is None and req.method == "full" and req.sources == [] and req.ttft_ms == {}
    assert engine.prepare(req) is req  # the scheduler, inline, for one token
    assert isinstance(req.served, Served) and req.sources == req.served.sources and req.method == "full"
    assert req.first_token == req.answer.first_token >= 0
    assert req.ttft_ms["total"] == pytest.approx(req.served.stages_ms["total"] + req.answer.first_token_ms)
    for name in ("method", "note", "sources", "kv_origins", "pre"):
        with pytest.raises(AttributeError):
            setattr(req, name, None)
    served_fields = set(Served.__dataclass_fields__)
    assert not served_fields & set(vars(req)), served_fields & set(vars(req))  # none kept on the request itself
