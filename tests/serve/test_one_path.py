"""``fusionrag ask``, the Python API and the server answer a request through one scheduler, with identical
tokens: the CLI and ``Engine.answer`` run it inline as a batch of one, the server on its model thread."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fusionrag.cli import main
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.online.engine import Engine
from fusionrag.online.scheduler import BatchScheduler
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample
from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings

QUESTION = "In which city was the discoverer of polonium born?"
N = 8


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("fusionrag.retrieval.embedder.get_embedder", lambda name=None: HashingEmbedder())
    path = tmp_path / "store"
    lm = load_model("tiny-llama")
    store = build.create_store(path, lm, chunk_tokens=4096, embedder=HashingEmbedder(), model_source="tiny-llama")
    passages = {p["title"]: p for ex in load_sample() for p in ex["passages"]}
    build.add_passages(store, lm, list(passages.values()), doc="sample")
    build.fuse(store, lm, top_n=2, progress=False)
    store.close()
    return path


def test_ask_the_python_api_and_the_server_give_the_same_tokens_through_one_scheduler(store_dir, capsys):
    assert main(["ask", QUESTION, "--store", str(store_dir), "--json", "--max-new-tokens", str(N), "--top-k", "2",
                 "--method", "fusionrag", "--ratio", "0.15"]) == 0
    asked = json.loads(capsys.readouterr().out)

    engine = Engine.open(store_dir)
    api = engine.answer(QUESTION, method="fusionrag", ratio=0.15, top_k=2, max_new_tokens=N)
    assert isinstance(engine.scheduler, BatchScheduler) and engine.scheduler.stats.prefills == 1
    assert engine.scheduler.stats.tokens_generated == len(api.token_ids)

    app = create_app(lambda: Engine.open(store_dir), ServerSettings(default_max_tokens=N))
    try:
        app.state.scheduler.wait_ready(120)
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": QUESTION}], "retrieval_top_k": 2, "method": "fusionrag",
                "ratio": 0.15, "max_tokens": N, "temperature": 0, "logprobs": True})
        assert r.status_code == 200, r.text
        body = r.json()
    finally:
        app.state.scheduler.close()
    assert isinstance(app.state.scheduler, BatchScheduler)
    served = [t["token"] for t in body["choices"][0]["logprobs"]["content"]]  # each token's text, in order
    assert api.chunk_ids == asked["chunk_ids"] and api.text == asked["answer"]
    assert len(api.token_ids) == asked["generated_tokens"] == body["usage"]["completion_tokens"] == len(served)
    assert served == [engine.lm.tokenizer.decode([t]) for t in api.token_ids]
    assert body["choices"][0]["message"]["content"] == api.text


def test_one_request_object_from_admission_to_answer(store_dir):
    """The object a door admits is the one the prefetch, the prefill, the decode steps and the answer fill."""
    from fusionrag.online.request import ReuseRequest
    from fusionrag.online.state import Request, Status

    sched = BatchScheduler(Engine.open(store_dir))
    try:
        req = Request(ReuseRequest(QUESTION, "fusionrag", 0.15, top_k=2).validated(), max_new_tokens=4)
        assert req.status == Status.WAITING and req.pre is None and not req.token_ids
        assert sched.submit(req) is req
        events = list(req.events(timeout=120))
        assert events[-1].kind == "done" and events[-1].answer is req and req.result(1) is req
        assert req.status in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH) and req.resolved is not None \
            and req.resolved.done()
        assert req.chunk_ids == req.resolved.result().chunk_ids and req.ttft_ms["total"] > 0
        assert req.token_ids == [ev.token for ev in events if ev.kind == "token"] and req.prompt_tokens > 0
    finally:
        sched.close()
