"""The HTTP server: OpenAI-compatible chat (plain and streamed), documents, metrics, limits and errors.

A tiny random model answers (the text is gibberish; what is checked is the protocol, the
status codes, and that the server returns what ``engine.answer`` would). The engine is
built by a factory on the model thread, as ``fusionrag serve`` does.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from fusionrag.errors import FusionRAGError
from fusionrag.models import load_model
from fusionrag.online.engine import Engine
from fusionrag.serve.app import ServerSettings, create_app
from fusionrag.serve.loadtest import ServerThread, check_loopback, parse_method, run_load_test

PASSAGES = [
    {"title": "Polonium", "text": "Polonium was discovered by Marie Curie and Pierre Curie in 1898."},
    {"title": "Paris", "text": "Paris is the capital of France and hosts the Curie Institute."},
    {"title": "Warsaw", "text": "Warsaw, where Marie Curie was born, is the capital of Poland."},
    {"title": "Nobel", "text": "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911."},
    {"title": "Seine", "text": "The Seine flows through Paris before reaching the English Channel."},
]
USER = [{"role": "user", "content": "Who discovered polonium?"}]


def store_factory(path, fuse: bool = True):
    def make() -> Engine:
        from fusionrag.retrieval.embedder import HashingEmbedder
        from fusionrag.retrieval.knowledge import KnowledgeStore

        store = KnowledgeStore.create(path, load_model("tiny-llama"), chunk_tokens=64, embedder=HashingEmbedder())
        store.add_passages(PASSAGES)
        if fuse:
            store.preprocess(top_n=2, progress=False)
        return Engine(store)

    return make


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    settings = ServerSettings(default_max_tokens=8, max_documents=4, max_document_chars=2000, max_top_k=8)
    app = create_app(store_factory(tmp_path_factory.mktemp("kb") / "kb"), settings)
    app.state.scheduler.wait_ready(120)
    return app


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def serial(app, question: str, max_new_tokens: int, **kwargs):
    sched = app.state.scheduler
    return sched.run_task(lambda: sched.engine.answer(question, max_new_tokens=max_new_tokens, **kwargs)).result(60)


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if code is not None:
        assert err["code"] == code
    return err


# ------------------------------------------------------------------------------- happy paths


def test_chat_completion_matches_engine(app, client):
    body = {"model": "x", "messages": [{"role": "system", "content": "ignored"}, *USER], "max_tokens": 10,
            "method": "fusionrag", "ratio": 0.15, "top_k": 2}
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
    assert fr["method"] == "fusionrag" and fr["kv"] == "fused" and fr["chunk_ids"] == ref.chunk_ids
    assert fr["recomputed_tokens"] == ref.recomputed_tokens > 0
    assert {"retrieve", "load", "select", "recompute", "first_token", "total"} <= set(fr["ttft_ms"])
    assert fr["server"]["ttft_ms"] >= 0 and fr["server"]["queue_ms"] >= 0


def test_streaming_sends_openai_chunks_then_done(app, client):
    body = {"messages": USER, "max_tokens": 10, "top_k": 2, "stream": True, "stream_options": {"include_usage": True}}
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
    results: dict[int, dict] = {}

    def ask(i: int) -> None:
        results[i] = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": questions[i]}], "max_tokens": 12, "top_k": 1 + i % 3,
            "method": ["fusionrag", "full", "reuse", "cacheblend"][i]}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, q in enumerate(questions):
        ref = serial(app, q, 12, top_k=1 + i % 3, method=["fusionrag", "full", "reuse", "cacheblend"][i])
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
        "max_tokens": 2, "top_k": 1})
    fr = r.json()["fusionrag"]
    assert fr["chunk_ids"] == job["chunk_ids"] and fr["fused_fallbacks"] == 0
    # A bare list is accepted too.
    assert client.post("/v1/documents", json=[{"text": "Another passage."}]).status_code == 202
    # Removing documents: gone from the store, and from retrieval.
    store = app.state.scheduler.engine.store
    r = client.delete(f"/v1/documents/{job['id']}")
    assert r.status_code == 200 and r.json()["status"] == "deleted"
    assert not set(job["chunk_ids"]) & set(store.chunk_ids())
    error_of(client.get("/v1/documents/nope"), 404, "not_found")


def test_metrics_prometheus_text(client):
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "method": "full"})
    client.post("/v1/chat/completions", content=b"{")
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? -?[0-9.e+Inf-]+$')
    names = set()
    for line in r.text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        assert sample.match(line), line
        names.add(line.split("{")[0].split(" ")[0])
    text = r.text
    assert 'fusionrag_ttft_seconds_bucket{method="full",le="+Inf"}' in text
    assert "# TYPE fusionrag_ttft_seconds histogram" in text
    assert 'fusionrag_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'fusionrag_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert {"fusionrag_queue_length", "fusionrag_active_requests", "fusionrag_decode_steps_total"} <= names


def test_health_and_models(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == "tiny-llama"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("content", "code"), [(b"{not json", "invalid_json"), (b"", "invalid_json"),
                                               (b"\xff\xfe", "invalid_json"), (b"[" * 200_000, "invalid_json")])
def test_malformed_json_is_400(client, content, code):
    error_of(client.post("/v1/chat/completions", content=content,
                         headers={"content-type": "application/json"}), 400, code)


@pytest.mark.parametrize(("body", "code"), [
    ({"messages": USER, "method": "nope"}, "unknown_method"),
    ({"messages": USER, "ratio": 1.5}, "invalid_ratio"),
    ({"messages": USER, "ratio": "a lot"}, "invalid_ratio"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty_question"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "invalid_value"),
    ({"messages": []}, "invalid_value"),
    ({"messages": "hello"}, "invalid_value"),
    ({"messages": USER, "max_tokens": 0}, "invalid_value"),
    ({"messages": USER, "max_tokens": 10**9}, "invalid_value"),
    ({"messages": USER, "top_k": 0}, "invalid_value"),
    ({"messages": USER, "kv": "warm"}, "invalid_value"),
    ({"messages": USER, "n": 3}, "invalid_value"),
    ({"messages": USER, "stop": ["\n"]}, "unsupported"),
    ({"messages": USER, "documents": "text"}, "invalid_value"),
    ({"messages": USER, "documents": [{"title": "no text"}]}, "invalid_value"),
    ([1, 2, 3], None),
])
def test_invalid_requests_are_400(client, body, code):
    error_of(client.post("/v1/chat/completions", json=body), 400, code)


def test_document_limits_are_413(client):
    many = [{"text": f"passage {i}"} for i in range(5)]
    error_of(client.post("/v1/chat/completions", json={"messages": USER, "documents": many}), 413,
             "too_many_documents")
    error_of(client.post("/v1/documents", json=many), 413, "too_many_documents")
    error_of(client.post("/v1/documents", json=[{"text": "x" * 2001}]), 413, "document_too_large")
    error_of(client.post("/v1/documents", json={"documents": []}), 400)


def test_oversize_body_is_413(app, client, monkeypatch):
    monkeypatch.setattr(app.state.settings, "max_body_bytes", 200)
    big = {"messages": [{"role": "user", "content": "x" * 500}]}
    error_of(client.post("/v1/chat/completions", json=big), 413, "body_too_large")

    def chunks():  # no Content-Length: refused while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 100
        yield b'"}]}'

    error_of(client.post("/v1/chat/completions", content=chunks()), 413, "body_too_large")


def test_prompt_token_limit_is_400(app, client, monkeypatch):
    monkeypatch.setattr(app.state.scheduler, "max_prompt_tokens", 50)
    error_of(client.post("/v1/chat/completions", json={"messages": USER, "documents": PASSAGES[:2]}), 400,
             "context_length_exceeded")
    error_of(client.post("/v1/chat/completions", json={"messages": USER, "top_k": 3}), 400,
             "context_length_exceeded")


def test_full_queue_is_429(app, client, monkeypatch):
    sched = app.state.scheduler
    monkeypatch.setattr(sched, "max_queue", 1)
    gate, started = threading.Event(), threading.Event()
    sched.run_task(lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)
    try:
        waiting = sched.submit("Who discovered polonium?", max_new_tokens=2)
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
    error_of(client.get("/metrics"), 401)
    error_of(client.post("/v1/documents", json=[{"text": "t"}]), 401)
    ok = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                     headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200  # liveness stays open


def test_engine_errors_never_crash_the_server(app, client, monkeypatch):
    engine = app.state.scheduler.engine

    def user_error(*a, **k):
        raise FusionRAGError("the knowledge store is empty")

    monkeypatch.setattr(engine, "prepare", user_error)
    err = error_of(client.post("/v1/chat/completions", json={"messages": USER}), 400, "invalid_request")
    assert "empty" in err["message"]

    def bug(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "prepare", bug)
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
    """A real uvicorn server on a free loopback port, with an API key, over a store never preprocessed."""
    app = create_app(store_factory(tmp_path_factory.mktemp("kb-live") / "kb", fuse=False),
                     ServerSettings(api_key="test-key", default_max_tokens=8, preprocess_top_n=2))
    app.state.scheduler.wait_ready(120)
    with ServerThread(app) as server:
        yield app, server.base_url


def test_openai_client_round_trip(live):
    openai = pytest.importorskip("openai")
    app, base_url = live
    with httpx.Client(trust_env=False) as http:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="test-key", http_client=http, max_retries=0)
        resp = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=10,
                                              extra_body={"method": "fusionrag", "ratio": 0.15, "top_k": 2})
        ref = serial(app, "Who discovered polonium?", 10, method="fusionrag", ratio=0.15, top_k=2)
        assert resp.choices[0].message.content == ref.text
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert resp.model_extra["fusionrag"]["recomputed_tokens"] == ref.recomputed_tokens

        stream = client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=10, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"method": "fusionrag", "ratio": 0.15, "top_k": 2})
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


def test_load_test_reports_ttft_and_throughput(live, tmp_path):
    _, base_url = live
    report = run_load_test(base_url, ["Who discovered polonium?", {"question": "Capital of France?",
                                                                      "documents": PASSAGES[1:3]}],
                           rates=[20.0, 40.0], methods=["full", "fusionrag:0.15"], n_requests=3, duration_s=5,
                           out_dir=tmp_path, max_tokens=4, api_key="test-key", timeout_s=60, warmup=1)
    assert len(report["cells"]) == 4
    for cell in report["cells"]:
        assert cell["ok"] == cell["sent"] == 3, cell
        assert 0 < cell["ttft_ms_p50"] <= cell["ttft_ms_p95"]
        assert cell["throughput_rps"] > 0 and cell["throughput_tok_s"] > 0
    assert json.loads((tmp_path / "loadtest.json").read_text())["cells"] == report["cells"]
    assert "TTFT p50" in (tmp_path / "loadtest.md").read_text()
    assert (tmp_path / "loadtest.png").stat().st_size > 1000


def test_load_test_stays_on_loopback():
    with pytest.raises(FusionRAGError, match="loopback"):
        check_loopback("http://example.com:8000")
    check_loopback("http://127.0.0.1:8000")
    assert parse_method("cacheblend:0.15").ratio == 0.15 and parse_method("full").ratio == 1.0
    with pytest.raises(FusionRAGError):
        parse_method("nope")


def test_metrics_include_kv_tiers_when_the_engine_has_them():
    from types import SimpleNamespace

    from fusionrag.kvcache.prefix_cache import AlternativePathCache
    from fusionrag.kvcache.tiers import TierStats
    from fusionrag.serve.app import Metrics
    from fusionrag.serve.batching import SchedulerStats

    engine = SimpleNamespace(tier_stats=lambda: {"host": TierStats(memory_hits=3, disk_hits=1, memory_bytes=4096)},
                             adhoc_entries=1, prefix_cache=AlternativePathCache())
    engine.prefix_cache.lookup("S", ["a", "b"], lambda *_: SimpleNamespace(nbytes=10))
    engine.prefix_cache.lookup("S", ["b", "a"], lambda *_: SimpleNamespace(nbytes=10))
    sched = SimpleNamespace(queue_length=2, active=1, stats=SchedulerStats(), engine=engine)
    text = Metrics().render(sched, {"ready": 1})
    assert 'fusionrag_kv_tier_hits_total{tier="host",source="memory"} 3' in text
    assert 'fusionrag_kv_tier_hits_total{tier="host",source="disk"} 1' in text
    assert 'fusionrag_kv_tier_bytes{tier="host"} 4096' in text
    assert "fusionrag_queue_length 2" in text and "fusionrag_adhoc_kv_entries 1" in text
    assert 'fusionrag_document_jobs{status="ready"} 1' in text
    assert 'fusionrag_prefix_cache_lookups_total{result="computed"} 2' in text
    assert 'fusionrag_prefix_cache_lookups_total{result="alt_path_hit"} 1' in text  # "a" after "b"
    assert 'fusionrag_prefix_cache_lookups_total{result="prefix_hit"} 1' in text  # "b" first
