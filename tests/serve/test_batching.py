"""Batched decoding gives exactly the tokens of serial ``engine.answer``, whoever shares the batch.

The store is built by a factory on the scheduler's model thread, as the server does (the
store's SQLite connection belongs to the thread that opened it); serial references are
computed on that same thread with ``run_task``.
"""

from __future__ import annotations

import threading
import time

import pytest
import studies.peers.ape  # noqa: F401  (the plugin registers the study method ape)
import torch

from fusionrag.errors import FusionRAGError, QueueFullError, RequestCancelledError
from fusionrag.models import load_model
from fusionrag.online.engine import Engine
from fusionrag.online.scheduler import BatchScheduler
from fusionrag.online.state import Request

PASSAGES = [
    {"title": "Polonium", "text": "Polonium was discovered by Marie Curie and Pierre Curie in 1898."},
    {"title": "Radium", "text": "Radium was also discovered by the Curies, a few months after polonium."},
    {"title": "Paris", "text": "Paris is the capital of France and hosts the Curie Institute."},
    {"title": "Warsaw", "text": "Warsaw, where Marie Curie was born, is the capital of Poland."},
    {"title": "Uranium", "text": "Uranium rays were studied by Henri Becquerel before the Curies."},
    {"title": "Nobel", "text": "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911."},
    {"title": "Seine", "text": "The Seine flows through Paris before reaching the English Channel at Le Havre."},
    {"title": "Vistula", "text": "The Vistula is the longest river in Poland and flows through Warsaw."},
]
EXTRA = [
    {"title": "Mars", "text": "Mars is the fourth planet from the Sun and has two small moons."},
    {"title": "Moons", "text": "Phobos and Deimos are the two moons of Mars, discovered in 1877."},
]


def store_factory(path):
    """An ``Engine`` over a small fused store, built wherever the returned factory is called."""

    def make() -> Engine:
        from fusionrag.offline import build
        from fusionrag.retrieval.embedder import HashingEmbedder

        lm = load_model("tiny-llama")
        store = build.create_store(path, lm, chunk_tokens=64, embedder=HashingEmbedder())
        build.add_passages(store, lm, PASSAGES)
        build.fuse(store, lm, top_n=2, progress=False)
        return Engine(store, lm)

    return make


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    s = BatchScheduler(store_factory(tmp_path_factory.mktemp("kb") / "kb"), max_batch=8, max_queue=64)
    s.wait_ready(120)
    yield s
    s.close()


def serial(sched: BatchScheduler, question: str, max_new_tokens: int, **kwargs) -> list[int]:
    """The reference: ``engine.answer`` run alone, on the model thread."""
    fut = sched.run_task(lambda: sched.engine.answer(question, max_new_tokens=max_new_tokens, **kwargs))
    return fut.result(60).token_ids


def hold(sched: BatchScheduler) -> threading.Event:
    """Block the model thread until the returned event is set (so requests pile up and batch together)."""
    gate, started = threading.Event(), threading.Event()

    def wait() -> None:
        started.set()
        gate.wait(60)

    sched.run_task(wait)
    assert started.wait(30)
    return gate


REQUESTS = [
    # question, max_new_tokens, engine kwargs: different prompt lengths, methods and stopping points
    ("Who discovered polonium?", 12, {"method": "fusionrag", "ratio": 0.15, "top_k": 2}),
    ("Which river flows through Warsaw and is the longest in Poland?", 9, {"method": "full", "top_k": 4}),
    ("Capital of France?", 3, {"method": "reuse", "top_k": 1}),
    ("When did Marie Curie win the Nobel Prize?", 16, {"method": "cacheblend", "ratio": 0.3, "top_k": 3}),
    ("Who studied uranium rays?", 1, {"method": "fusionrag", "ratio": 0.5, "top_k": 5}),
    ("What did the Curies discover in 1898?", 7, {"method": "fusionrag", "ratio": 0.15, "top_k": 6}),
    # APE rows (a study plugin) read their context through its rule inside the shared batch; ProphetKV is a
    # selection like any
    ("Where did Marie Curie study?", 10, {"method": "ape", "top_k": 3}),
    ("Who was Pierre Curie?", 8, {"method": "prophetkv", "ratio": 0.2, "top_k": 3}),
]


def test_batched_equals_serial_with_mixed_lengths_methods_and_stops(sched):
    before = sched.stats.decode_steps
    gate = hold(sched)
    reqs = [sched.submit(Request.of(q, max_new_tokens=n, **kw)) for q, n, kw in REQUESTS]
    gate.set()
    got = [r.result(60).token_ids for r in reqs]
    want = [serial(sched, q, n, **kw) for q, n, kw in REQUESTS]
    assert got == want
    assert any(len(t) > 2 for t in got)
    for (_, n, _), r in zip(REQUESTS, reqs, strict=True):
        assert len(r.token_ids) <= n and r.finish_reason in ("stop", "length")
    # One forward served several requests: fewer decode forwards than decoded tokens.
    steps = sched.stats.decode_steps - before
    decoded = sum(max(0, len(t) - 1) for t in got)  # the first token comes from the prefill logits
    assert steps < decoded
    assert sched.stats.max_batch_seen >= 4


def test_shared_chunks_in_any_order_are_never_modified(sched):
    """Requests sharing request-supplied passages (in different orders) decode as if alone."""
    a, b, c = EXTRA[0], EXTRA[1], PASSAGES[0]
    cases = [([a, b], "How many moons has Mars?", "fusionrag"), ([b, a], "Who discovered Phobos?", "fusionrag"),
             ([a, b, c], "Mars or polonium?", "cacheblend"), ([c, a], "Polonium and Mars?", "reuse"),
             ([b], "Deimos?", "full")]
    # The serial references also fill the engine's cache of ad-hoc passage KV; snapshot it.
    want = [serial(sched, q, 10, chunks=docs, method=m, ratio=0.2) for docs, q, m in cases]
    adhoc = {k: (v.keys.clone(), v.values.clone()) for k, v in cached_passage_kvs(sched.engine, [a, b]).items()}
    assert len(adhoc) == 2
    gate = hold(sched)
    reqs = [sched.submit(Request.of(q, max_new_tokens=10, chunks=docs, method=m, ratio=0.2)) for docs, q, m in cases]
    gate.set()
    got = [r.result(60) for r in reqs]
    assert [g.token_ids for g in got] == want
    assert got[0].chunk_ids == [None, None]  # request-supplied passages, not in the store
    after = cached_passage_kvs(sched.engine, [a, b])
    for key, (k, v) in adhoc.items():  # shared chunk KV untouched by batched decoding
        assert torch.equal(after[key].keys, k) and torch.equal(after[key].values, v)


def cached_passage_kvs(engine: Engine, passages: list[dict]) -> dict:
    """The KV objects the engine's alternative-path cache holds for these passages (fails if one is missing)."""
    from fusionrag.prompt import passage_hash

    hashes = [passage_hash(p.get("title", ""), p["text"]) for p in passages]
    res = engine.prefix_cache.lookup(engine.prompt.system_hash, hashes, lambda *_: pytest.fail("not cached"))
    return dict(zip(hashes, res.values, strict=True))


def test_requests_join_and_leave_mid_decode(sched):
    """A second wave joins while the first decodes (longer and shorter prompts), then rows leave one by one."""
    wave2_specs = [("Paris river?", 5, {"method": "full", "top_k": 1}),
                   ("Tell me everything about the Curies, radium, polonium and the Nobel prizes.", 14,
                    {"method": "fusionrag", "top_k": 8}),
                   ("Poland?", 8, {"method": "reuse", "top_k": 2})]
    wave2: list = []

    def on_event(ev) -> None:  # runs on the model thread: submit the second wave mid-decode
        if ev.kind == "token" and not wave2 and len(first.token_ids) == 3:
            wave2.extend(sched.submit(Request.of(q, max_new_tokens=n, **kw)) for q, n, kw in wave2_specs)

    first_spec = ("Who discovered polonium?", 20, {"method": "fusionrag", "top_k": 3})
    first = sched.submit(Request.of(first_spec[0], max_new_tokens=first_spec[1], **first_spec[2]), listener=on_event)
    other = sched.submit(Request.of("Capital of Poland?", max_new_tokens=6, method="full", top_k=2))
    first_done = first.result(60)
    got = [first_done.token_ids, other.result(60).token_ids, *(r.result(60).token_ids for r in wave2)]
    want = [serial(sched, first_spec[0], first_spec[1], **first_spec[2]),
            serial(sched, "Capital of Poland?", 6, method="full", top_k=2),
            *(serial(sched, q, n, **kw) for q, n, kw in wave2_specs)]
    assert len(wave2) == 3
    assert got == want


def test_streamed_deltas_join_to_the_answer(sched):
    req = sched.submit(Request.of("Who discovered polonium?", max_new_tokens=12, top_k=2))
    events = list(req.events(timeout=60))
    assert events[-1].kind == "done"
    tokens = [e.token for e in events if e.kind == "token"]
    assert tokens == events[-1].answer.token_ids
    text = "".join(e.text for e in events if e.kind == "token")
    assert text.strip() == events[-1].answer.text


def test_errors_and_cancellation_are_per_request(sched):
    gate = hold(sched)
    bad = sched.submit(Request.of("   ", max_new_tokens=4))  # empty question: the engine refuses it
    unknown = sched.submit(Request.of("q?", max_new_tokens=4, method="nope"))
    good = sched.submit(Request.of("Who discovered polonium?", max_new_tokens=8, top_k=2))
    cancelled = sched.submit(Request.of("Capital of France?", max_new_tokens=8, top_k=2))
    cancelled.cancel()
    gate.set()
    with pytest.raises(FusionRAGError, match="empty"):
        bad.result(60)
    with pytest.raises(FusionRAGError, match="unknown method"):
        unknown.result(60)
    with pytest.raises(RequestCancelledError):
        cancelled.result(60)
    assert good.result(60).token_ids == serial(sched, "Who discovered polonium?", 8, top_k=2)


def test_cancel_while_decoding_frees_the_row(sched):
    cancel_at = {}

    def on_event(ev) -> None:
        if ev.kind == "token" and len(victim.token_ids) == 2 and not cancel_at:
            cancel_at["n"] = 2
            victim.cancel()

    gate = hold(sched)
    victim = sched.submit(Request.of("Who discovered polonium?", max_new_tokens=30, top_k=2), listener=on_event)
    keeper = sched.submit(Request.of("Capital of France?", max_new_tokens=10, top_k=2, method="full"))
    gate.set()
    assert keeper.result(60).token_ids == serial(sched, "Capital of France?", 10, top_k=2, method="full")
    with pytest.raises(RequestCancelledError):
        victim.result(60)
    assert len(victim.token_ids) < 30


def test_full_queue_raises(sched, monkeypatch):
    monkeypatch.setattr(sched, "max_queue", 1)
    gate = hold(sched)
    try:
        first = sched.submit(Request.of("Who discovered polonium?", max_new_tokens=2, top_k=1))
        with pytest.raises(QueueFullError):
            sched.submit(Request.of("Capital of France?", max_new_tokens=2, top_k=1))
    finally:
        gate.set()
    assert first.result(60).token_ids


def test_a_failing_factory_is_reported():
    def boom():
        raise FusionRAGError("no knowledge store here")

    s = BatchScheduler(boom)
    with pytest.raises(FusionRAGError, match="no knowledge store"):
        s.wait_ready(30)
    with pytest.raises(FusionRAGError, match="failed to load"):
        s.submit(Request.of("q?"))
    s.close()


def test_padding_is_compacted_when_a_long_row_dominates(sched):
    """One long prompt among short ones: once padding is most of the batch cache it is re-packed, tokens unchanged."""
    long_doc = [{"title": "Long", "text": " ".join(p["text"] for p in PASSAGES) * 2}]
    specs = [("Summarise everything.", 14, {"method": "full", "chunks": long_doc})]
    specs += [(q, n, {"method": "reuse", "top_k": 1}) for q, n in
              [("Polonium?", 12), ("Paris?", 12), ("Warsaw?", 12), ("Nobel?", 2)]]
    before = sched.stats.compactions
    gate = hold(sched)
    reqs = [sched.submit(Request.of(q, max_new_tokens=n, **kw)) for q, n, kw in specs]
    gate.set()
    got = [r.result(60).token_ids for r in reqs]
    assert got == [serial(sched, q, n, **kw) for q, n, kw in specs]
    assert reqs[0].prompt_tokens > 2 * max(r.prompt_tokens for r in reqs[1:])
    if len(got[-1]) == 2 and all(len(t) > 2 for t in got[:-1]):  # the short row left while the others decoded
        assert sched.stats.compactions > before


def test_queued_requests_are_prefetched_by_the_asynchronous_loader(tmp_path):
    """With a memory tier, a queued request's chunk KVs are read before its prefill, with the same tokens."""
    make_plain = store_factory(tmp_path / "kb")

    def make_tiered() -> Engine:
        engine = make_plain()
        return Engine(engine.store, engine.lm, memory_budget_bytes=64 << 20)

    s = BatchScheduler(make_tiered, max_batch=4, max_queue=16)
    try:
        s.wait_ready(120)
        question = "Which moons does Mars have?"
        gate = hold(s)
        req = s.submit(Request.of(question, max_new_tokens=4, method="fusionrag", top_k=2))
        deadline = time.monotonic() + 30
        while s.engine.stats()["tiers"]["host"].prefetches == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        tokens = req.result(60).token_ids
        stats = s.engine.stats()["tiers"]["host"]
        assert stats.prefetches >= 2 and stats.disk_hits == 0  # every KV came from the loader, none read on demand
        assert tokens == serial(s, question, 4, method="fusionrag", top_k=2)
    finally:
        s.close()


def test_a_sampling_failure_fails_only_its_own_request(sched):
    gate = hold(sched)
    try:
        bad = sched.submit(Request.of("Who discovered polonium?", max_new_tokens=6, top_k=2))
        good = sched.submit(Request.of("Capital of France?", max_new_tokens=6, top_k=2))

        def broken(_logits):
            raise RuntimeError("sampler exploded")

        bad.progress.sampler.pick = broken
    finally:
        gate.set()
    with pytest.raises(RuntimeError, match="sampler exploded"):
        bad.result(60)
    assert good.result(60).token_ids == serial(sched, "Capital of France?", 6, top_k=2)
