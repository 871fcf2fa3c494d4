"""What the server tests share: a tiny store, apps over it, and readers of responses.

Not a test module (pytest collects ``test_*.py`` only); imported by name like ``conftest``.
A tiny random model answers (the text is gibberish; what is checked is the protocol, the
status codes, and that the server returns what ``engine.answer`` would). The engine is
built by a factory on the model thread, as ``fusionrag serve`` does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
from fastapi import FastAPI

from fusionrag.models import load_model
from fusionrag.online.engine import Engine
from fusionrag.serve.app import create_app
from fusionrag.serve.server_thread import ServerThread
from fusionrag.serve.settings import ServerSettings

PASSAGES = [
    {"title": "Polonium", "text": "Polonium was discovered by Marie Curie and Pierre Curie in 1898."},
    {"title": "Paris", "text": "Paris is the capital of France and hosts the Curie Institute."},
    {"title": "Warsaw", "text": "Warsaw, where Marie Curie was born, is the capital of Poland."},
    {"title": "Nobel", "text": "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911."},
    {"title": "Seine", "text": "The Seine flows through Paris before reaching the English Channel."},
]
USER = [{"role": "user", "content": "Who discovered polonium?"}]


def store_factory(path, fuse: bool = True, memory_budget_bytes: int | None = None):
    """Builds the store and its engine when called (on the model thread, which then owns the SQLite connection)."""

    def make() -> Engine:
        from fusionrag.offline import build
        from fusionrag.retrieval.embedder import HashingEmbedder

        lm = load_model("tiny-llama")
        store = build.create_store(path, lm, chunk_tokens=64, embedder=HashingEmbedder())
        build.add_passages(store, lm, PASSAGES)
        if fuse:
            build.fuse(store, lm, top_n=2, progress=False)
        return Engine(store, lm, memory_budget_bytes=memory_budget_bytes)

    return make


def small_limits_app(tmp_path_factory) -> FastAPI:
    """An app over a preprocessed store, with document and top_k limits small enough to hit."""
    settings = ServerSettings(default_max_tokens=8, max_documents=4, max_document_chars=2000, max_top_k=8)
    app = create_app(store_factory(tmp_path_factory.mktemp("kb") / "kb"), settings)
    app.state.scheduler.wait_ready(120)
    return app


@contextlib.contextmanager
def live_server(tmp_path_factory) -> Iterator[tuple[FastAPI, str]]:
    """A real uvicorn server on a free loopback port, with an API key, over a store never preprocessed."""
    app = create_app(store_factory(tmp_path_factory.mktemp("kb-live") / "kb", fuse=False),
                     ServerSettings(api_key="test-key", default_max_tokens=8, preprocess_top_n=2))
    app.state.scheduler.wait_ready(120)
    with ServerThread(app) as server:
        yield app, server.base_url


@contextlib.contextmanager
def live_small_server(tmp_path_factory) -> Iterator[tuple[FastAPI, str]]:
    """:func:`small_limits_app` behind a real uvicorn server on a free loopback port (no API key)."""
    app = small_limits_app(tmp_path_factory)
    try:
        with ServerThread(app) as server:
            yield app, server.base_url
    finally:
        app.state.scheduler.close()


def serial(app, question: str, max_new_tokens: int, **kwargs):
    """What the engine answers on its own (on the model thread), to compare the server's answers with."""
    sched = app.state.scheduler
    return sched.run_task(lambda: sched.engine.answer(question, max_new_tokens=max_new_tokens, **kwargs)).result(60)


def stored_passages(app, ids: list[int] | None = None) -> list[dict]:
    """Chunks of the store (all, or ``ids``) as a framework's retriever over the same corpus returns them."""
    sched = app.state.scheduler

    def read() -> list[dict]:
        store = sched.engine.store
        return [{"title": r.title, "text": r.text} for r in (store.chunk(i) for i in (ids or store.chunk_ids()))]

    return sched.run_task(read).result(30)


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    """The OpenAI-shaped error of ``resp``, after checking its status (and ``code`` if given)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if code is not None:
        assert err["code"] == code
    return err
