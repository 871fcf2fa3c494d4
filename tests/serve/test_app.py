"""The routes: OpenAI-compatible chat (plain and streamed), documents, metrics, health, limits and errors.

A tiny random model answers (the text is gibberish; what is checked is the protocol, the
status codes, and that the server returns what ``engine.answer`` would). Request
validation has its own tests (``test_protocol.py``).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from fusionrag.errors import FusionRAGError
from fusionrag.online.state import Request
from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import (
    PASSAGES,
    USER,
    error_of,
    live_server,
    serial,
    sse_events,
    store_factory,
)

# ------------------------------------------------------------------------------- happy paths


def test_chat_completion_matches_engine(app, client):
    body = {"model": "tiny-llama", "messages": USER, "max_tokens": 10, "method": "fusionrag", "ratio": 0.15,
            "retrieval_top_k": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = serial(app, "Who discovered polonium?", 10, method="fusionrag", ratio=0.15, top_k=2)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref.text}
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["completion_tokens"] == len(ref.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > ref.context_tokens
    fr = out["fusionrag"]
    assert fr["method"] == "fusionrag" and fr["kv"] == "plain-first" and fr["chunk_ids"] == ref.chunk_ids
    assert fr["recomputed_tokens"] == ref.recomputed_tokens > 0
    assert {"retrieve", "load", "select", "recompute", "first_token", "total"} <= set(fr["ttft_ms"])
    assert fr["server"]["ttft_ms"] >= 0 and fr["server"]["queue_ms"] >= 0


def test_streaming_sends_openai_chunks_then_done(app, client):
    body = {"messages": USER, "max_tokens": 10, "retrieval_top_k": 2, "method": "fusionrag", "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["fusionrag"]["method"] == "fusionrag"
    usage = chunks[-1]["usage"]
    ref = serial(app, "Who discovered polonium?", 10, top_k=2)
    assert text.strip() == ref.text
    assert usage["completion_tokens"] == len(ref.token_ids)


def test_request_documents_bypass_retrieval(app, client):
    docs = [{"title": "Mars", "text": "Mars has two moons, Phobos and Deimos."}, {"text": "Deimos is smaller."}]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "How many moons has Mars?"}]}],
            "max_tokens": 6, "documents": docs, "method": "cacheblend", "ratio": 0.3}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    fr = r.json()["fusionrag"]
    assert fr["chunk_ids"] == [None, None] and fr["method"] == "cacheblend"
    ref = serial(app, "How many moons has Mars?", 6, chunks=docs, method="cacheblend", ratio=0.3)
    assert r.json()["choices"][0]["message"]["content"] == ref.text


def test_concurrent_requests_share_the_batch(app, client):
    questions = ["Who discovered polonium?", "Capital of France?", "Where was Marie Curie born?",
                 "Which river flows through Paris?"]
    methods = ["fusionrag", "full", "reuse", "cacheblend"]
    sched = app.state.scheduler
    results: dict[int, dict] = {}

    def ask(i: int) -> None:
        results[i] = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": questions[i]}], "max_tokens": 12, "retrieval_top_k": 1 + i % 3,
            "method": methods[i]}).json()

    # Hold the model thread until every request is queued, so they are admitted together
    # rather than one by one as they happen to arrive.
    gate, started = threading.Event(), threading.Event()
    sched.run_task(lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)
    # Decode steps that carried more than one row add more rows than steps.
    shared_before = sched.stats.decode_rows - sched.stats.decode_steps
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sched.queue_length < len(questions) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.queue_length == len(questions)
    finally:
        gate.set()
    for t in threads:
        t.join(60)
    assert sched.stats.decode_rows - sched.stats.decode_steps > shared_before, sched.stats
    assert sched.stats.max_batch_seen >= 2
    for i, q in enumerate(questions):
        ref = serial(app, q, 12, top_k=1 + i % 3, method=methods[i])
        assert results[i]["choices"][0]["message"]["content"] == ref.text


def test_documents_are_added_in_the_background(app, client):
    r = client.post("/v1/documents", json={"documents": [
        {"title": "Zebras", "text": "Zebras are striped horses of the African savanna."}]})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("pending", "running", "ready") and job["documents"] == 1
    deadline = time.monotonic() + 60
    while job["status"] in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.get(f"/v1/documents/{job['id']}").json()
    assert job["status"] == "ready", job
    assert len(job["chunk_ids"]) == 1
    # Visible to retrieval, with fused KV (no fallback to plain KV).
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Zebras are striped horses of the African savanna?"}],
        "max_tokens": 2, "retrieval_top_k": 1})
    fr = r.json()["fusionrag"]
    assert fr["chunk_ids"] == job["chunk_ids"] and fr["fused_fallbacks"] == 0
    # A bare list is accepted too.
    other = client.post("/v1/documents", json=[{"text": "Another passage."}])
    assert other.status_code == 202
    # Removing documents: refused at once (409, naming the job) while a job runs, nothing removed; then
    # gone from the store, and from retrieval.
    store = app.state.scheduler.engine.store
    r = client.delete(f"/v1/documents/{job['id']}")
    if r.status_code == 409:
        assert other.json()["id"] in r.json()["error"]["message"]
        assert set(job["chunk_ids"]) <= set(store.chunk_ids())
    deadline = time.monotonic() + 60
    while client.get(f"/v1/documents/{other.json()['id']}").json()["status"] in ("pending", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = client.delete(f"/v1/documents/{job['id']}")
    assert r.status_code == 200 and r.json()["status"] == "deleted"
    assert not set(job["chunk_ids"]) & set(store.chunk_ids())
    error_of(client.get("/v1/documents/nope"), 404, "not_found")


def test_metrics_parse_as_prometheus_with_vllm_names(client):
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "method": "full"})
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "method": "fusionrag",
                                              "retrieval_top_k": 2})
    client.post("/v1/chat/completions", content=b"{")
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}

    def value(family: str, sample: str, **labels: str) -> float:
        found = [s.value for s in families[family].samples
                 if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
        assert found, (family, sample, labels)
        return sum(found)

    model = {"model_name": "tiny-llama"}
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count", **model) >= 2
    assert value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count", **model) >= 2
    # 3 tokens each (unless a stop token came first): at least one gap between two tokens was observed
    assert value("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count", **model) >= 1
    assert value("vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count", **model) >= 2
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total", **model) > 0
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total", **model) >= 2
    assert value("vllm:num_requests_running", "vllm:num_requests_running", **model) == 0
    assert value("vllm:num_requests_waiting", "vllm:num_requests_waiting", **model) == 0
    assert value("fusionrag_recomputed_tokens", "fusionrag_recomputed_tokens_total", method="fusionrag") > 0
    assert value("fusionrag_reused_tokens", "fusionrag_reused_tokens_total", method="fusionrag") > 0
    assert value("fusionrag_http_requests", "fusionrag_http_requests_total", route="/v1/chat/completions",
                 status="400") >= 1
    assert value("fusionrag_ttft_seconds", "fusionrag_ttft_seconds_count", method="full") >= 1


def test_metrics_are_per_app(app, client, tmp_path):
    """Two apps in one process keep their own registries (no duplicate-name errors, no shared counts)."""
    other = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=2))
    try:
        text = other.state.metrics.render().decode()
        assert 'vllm:generation_tokens_total{model_name="' not in text  # nothing answered there yet
        assert 'vllm:generation_tokens_total{model_name="tiny-llama"}' in app.state.metrics.render().decode()
    finally:
        other.state.scheduler.close()


def test_health_and_models(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == "tiny-llama"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"


# ------------------------------------------------------------------------------- errors


def test_prompt_token_limit_is_400(app, client, monkeypatch):
    monkeypatch.setattr(app.state.scheduler, "max_prompt_tokens", 50)
    error_of(client.post("/v1/chat/completions", json={"messages": USER, "documents": PASSAGES[:2]}), 400,
             "context_length_exceeded")
    error_of(client.post("/v1/chat/completions", json={"messages": USER, "retrieval_top_k": 3}), 400,
             "context_length_exceeded")


def test_full_queue_is_429(app, client, monkeypatch):
    sched = app.state.scheduler
    monkeypatch.setattr(sched, "max_queue", 1)
    gate, started = threading.Event(), threading.Event()
    sched.run_task(lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)
    try:
        waiting = sched.submit(Request.of("Who discovered polonium?", max_new_tokens=2))
        error_of(client.post("/v1/chat/completions", json={"messages": USER}), 429, "queue_full")
    finally:
        gate.set()
    assert waiting.result(60) is not None
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200


def test_api_key(app, client, monkeypatch):
    monkeypatch.setattr(app.state.settings, "api_key", "s3cret")
    error_of(client.post("/v1/chat/completions", json={"messages": USER}), 401, "invalid_api_key")
    error_of(client.post("/v1/chat/completions", json={"messages": USER},
                         headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    assert client.get("/metrics").status_code == 200  # open, as vLLM's: a Prometheus scrape sends no token
    monkeypatch.setattr(app.state.settings, "metrics_need_key", True)
    error_of(client.get("/metrics"), 401)
    assert client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    error_of(client.post("/v1/documents", json=[{"text": "t"}]), 401)
    ok = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                     headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200  # liveness stays open


def test_engine_errors_never_crash_the_server(app, client, monkeypatch):
    engine = app.state.scheduler.engine

    def user_error(*a, **k):
        raise FusionRAGError("the knowledge store is empty")

    monkeypatch.setattr(engine, "plan", user_error)
    err = error_of(client.post("/v1/chat/completions", json={"messages": USER}), 400, "invalid_request")
    assert "empty" in err["message"]

    def bug(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "plan", bug)
    error_of(client.post("/v1/chat/completions", json={"messages": USER}), 500, "internal_error")
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    error_of(r, 500, "internal_error")  # a stream that fails before its first token is a plain JSON error
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200


def test_unknown_route_and_method(client):
    error_of(client.get("/v1/nothing"), 404, "not_found")
    error_of(client.get("/v1/chat/completions"), 405, "method_not_allowed")


# ------------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory) as pair:
        yield pair


def test_openai_client_round_trip(live):
    openai = pytest.importorskip("openai")
    app, base_url = live
    with httpx.Client(trust_env=False) as http:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="test-key", http_client=http, max_retries=0)
        resp = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=10,
                                              extra_body={"method": "fusionrag", "ratio": 0.15, "retrieval_top_k": 2})
        ref = serial(app, "Who discovered polonium?", 10, method="fusionrag", ratio=0.15, top_k=2)
        assert resp.choices[0].message.content == ref.text
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert resp.model_extra["fusionrag"]["recomputed_tokens"] == ref.recomputed_tokens

        stream = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=10, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"method": "fusionrag", "ratio": 0.15, "retrieval_top_k": 2})
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        assert "".join(parts).strip() == ref.text
        assert usage is not None and usage.completion_tokens == len(ref.token_ids)

        with pytest.raises(openai.BadRequestError, match="unknown method"):
            client.chat.completions.create(model="m", messages=USER, extra_body={"method": "nope"})
        bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=USER)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_documents_on_an_unfused_store_fuse_only_the_new_chunks(live):
    app, base_url = live
    headers = {"Authorization": "Bearer test-key"}
    with httpx.Client(base_url=base_url, headers=headers, trust_env=False, timeout=30) as http:
        job = http.post("/v1/documents", json=[{"title": "Zebras", "text": "Zebras are striped horses."},
                                               {"title": "Okapi", "text": "The okapi is a striped giraffid."}]).json()
        deadline = time.monotonic() + 60
        while job["status"] in ("pending", "running") and time.monotonic() < deadline:
            time.sleep(0.05)
            job = http.get(f"/v1/documents/{job['id']}").json()
    assert job["status"] == "ready", job
    assert job["preprocess"]["chunks"] == len(job["chunk_ids"]) == 2
    store = app.state.scheduler.engine.store
    assert store.settings.get("top_n") is None  # the store was not switched to fused mode
    assert all(store.has_kv(c, "fused") for c in job["chunk_ids"])




def test_posted_documents_never_leave_stale_kv_in_the_memory_tier(tmp_path):
    """Regression: after POST /v1/documents re-fused chunks, the memory tier served their old fused KV."""
    from fusionrag.serve.app import create_app

    app = create_app(store_factory(tmp_path / "kb", memory_budget_bytes=64 << 20))
    sched = app.state.scheduler
    sched.wait_ready(120)
    try:
        with TestClient(app) as client:
            store = sched.engine.store
            keys = [(c, "fused") for c in store.chunk_ids()]
            # Every chunk's fused KV read through the engine's tier by real requests.
            r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                                                                "retrieval_top_k": len(keys)})
            assert r.status_code == 200, r.text
            assert sched.engine.stats()["tiers"]["host"].memory_items == len(keys)
            before = {k: store.load_entry(*k).kv.keys.clone() for k in keys}
            near = [{"title": p["title"], "text": p["text"] + " (copy)"} for p in PASSAGES]
            job = client.post("/v1/documents", json={"documents": near}).json()
            deadline = time.monotonic() + 60
            while job["status"] in ("pending", "running") and time.monotonic() < deadline:
                time.sleep(0.05)
                job = client.get(f"/v1/documents/{job['id']}").json()
            assert job["status"] == "ready", job
            changed = [k for k in keys if not torch.equal(store.load_entry(*k).kv.keys, before[k])]
            assert changed, "near-duplicates must change some chunks' neighbour lists"
            served = sched.run_task(lambda: sched.engine.kv_source.get_many(keys)).result(60)
            for key, entry in zip(keys, served, strict=True):
                assert torch.equal(entry.kv.keys, store.load_entry(*key).kv.keys), key
    finally:
        sched.close()
