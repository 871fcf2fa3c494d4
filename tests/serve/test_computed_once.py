"""Each thing computed once per request: one validation, one retrieval (or passage matching), one question
tokenisation, whether the request comes through the server (prefetch, length check, prefill) or ``ask``'s
Python API. Before: a chat request retrieved up to three times and tokenized its question twice."""

from __future__ import annotations

import collections

import pytest
from fastapi.testclient import TestClient

from fusionrag.online.request import ReuseRequest
from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import PASSAGES, store_factory


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A served engine whose retrieval, matching, question tokenisation and validation are counted."""
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=4, max_prompt_tokens=4000))
    app.state.scheduler.wait_ready(120)
    app.state.scheduler.run_task(lambda: None).result(60)  # after the start's own store task (it writes)
    engine = app.state.scheduler.engine
    calls: collections.Counter[str] = collections.Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine.store, "search_scored", counting("retrieve", engine.store.search_scored))
    prompt_type = type(engine.prompt)  # a frozen dataclass: its method is counted on the class
    monkeypatch.setattr(prompt_type, "question_token_ids", counting("tokenize", prompt_type.question_token_ids))
    monkeypatch.setattr(ReuseRequest, "fields_validated", counting("validate", ReuseRequest.fields_validated))
    import fusionrag.online.prefill_engine as engine_module

    monkeypatch.setattr(engine_module, "match_passages", counting("match", engine_module.match_passages))
    yield app, engine, calls
    app.state.scheduler.close()


def test_a_chat_request_is_validated_retrieved_and_tokenized_once(counted):
    app, _, calls = counted
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Who found polonium?"}],
                                                      "retrieval_top_k": 2})
        assert r.status_code == 200, r.text
        assert calls == {"validate": 1, "retrieve": 1, "tokenize": 1}
        calls.clear()
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Capital?"}],
                                                      "documents": PASSAGES[:2]})
        assert r.status_code == 200, r.text
        assert calls == {"validate": 1, "match": 1, "tokenize": 1}


def test_a_request_s_texts_are_checked_once(counted, monkeypatch):
    """Issue 48: the Unicode check ran three times per chat request (the body, each document again, the
    question again when validated); the empty-question check twice. Now once each: the body's texts at the door
    (``read_json``), the question's emptiness where the request is validated."""
    import fusionrag.online.request as request_module
    import fusionrag.serve.bodies as bodies_module

    app, _, calls = counted
    checked: collections.Counter[str] = collections.Counter()
    real = bodies_module.is_valid_text

    def counting(text: str) -> bool:
        checked[text] += 1
        return real(text)

    monkeypatch.setattr(bodies_module, "is_valid_text", counting)
    monkeypatch.setattr(request_module, "is_valid_text", counting)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Capital?"}],
                                                      "documents": PASSAGES[:2]})
        assert r.status_code == 200, r.text
        assert checked["Capital?"] == 1 and checked[PASSAGES[0]["text"]] == 1 and calls["validate"] == 1
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "  "}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "empty_question", r.text
        r = client.post("/v1/completions", json={"prompt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800?"}]}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text


def test_ask_is_validated_retrieved_and_tokenized_once(counted):
    _, engine, calls = counted
    req = ReuseRequest("Who found polonium?", top_k=2).validated()
    with engine.lock:
        answer = engine.answer(req, max_new_tokens=2)
    assert answer.chunk_ids and calls == {"validate": 1, "retrieve": 1, "tokenize": 1}


def test_passages_found_before_another_process_changed_the_store_are_found_again(counted):
    """The prefetch's result is the request's only while the store is as it was when it was found."""
    _, engine, calls = counted
    req = ReuseRequest("Who found polonium?", top_k=2).validated()
    resolved = engine.resolve(req)
    resolved.generation = -1  # as if found before another writer's change
    with engine.lock:
        engine.prepare(req, resolved=resolved)
    assert calls["retrieve"] == 2


def test_a_prompt_far_over_the_limit_is_refused_before_any_matching(counted, monkeypatch):
    """Issue 47: a 0.5 MB prompt was matched against the store for 30 s on the model thread before its 400. Its
    texts are tokenised once and it is refused, with nothing matched or retrieved."""
    import fusionrag.online.prefill_engine as engine_module

    app, _, calls = counted
    monkeypatch.setattr(engine_module, "locate", lambda *a, **k: calls.update(["find"]) or None)
    app.state.scheduler.max_prompt_tokens = 400
    pasted = "Context:\n" + " ".join(p["text"] for p in PASSAGES) * 40 + "\n\nQuestion: who found polonium?"
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": pasted}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "texts alone" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Capital?"}],
                                                      "documents": [{"title": f"T{i}", "text": f"note {i} " * 30}
                                                                    for i in range(20)]})
        assert r.status_code == 400 and "texts alone" in r.json()["error"]["message"]
    assert not calls["match"] and not calls["retrieve"] and not calls["find"]
