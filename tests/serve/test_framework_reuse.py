"""Framework reuse end to end: real LangChain and LlamaIndex pipelines against a live loopback server
over a store built from files reuse every stored chunk, by either path: fusionrag's retriever
(``POST /v1/retrieve``) or the framework's own whole-file documents. Plus the routes that make
it possible (``/v1/retrieve``, a store-less server) and vLLM's habits (served names, neutral fields).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fusionrag.serve.app import create_app
from fusionrag.serve.server_thread import ServerThread
from fusionrag.serve.settings import ServerSettings, load_settings
from serve_helpers import error_of

FILES = {
    "velmora.txt": "\n\n".join([
        "The old town of Velmora sits on both banks of the river Ostra, which floods every spring.",
        "Its cathedral was finished in 1412 after ninety years of building and two fires.",
        "The market square holds a clock tower whose bells were cast from melted cannons.",
    ]) + "\n",
    "harbour.md": "# Harbour\n\nThe harbour of Kessa was dredged in 1903 to admit steamships of deep draught.\n\n"
                  "## Lighthouse\n\nIts lighthouse, painted in red and white bands, is visible for twenty miles.\n",
}
Q = "Which river runs through Velmora?"
NO_LANGCHAIN = "langchain-openai is not installed (pip install fusionrag[langchain])"
MODEL = "tiny-llama"


def _engine_factory(root: Path):
    def make():
        from fusionrag.models import load_model
        from fusionrag.offline import build
        from fusionrag.online.engine import Engine
        from fusionrag.retrieval.embedder import HashingEmbedder

        lm = load_model(MODEL)
        store = build.create_store(root / "kb", lm, chunk_tokens=64, embedder=HashingEmbedder(), model_source=MODEL)
        build.ingest(store, lm, sorted(root.glob("docs/*")), progress=False)
        return Engine(store, lm)

    return make


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks")
    (root / "docs").mkdir()
    for name, text in FILES.items():
        (root / "docs" / name).write_text(text, encoding="utf-8")
    app = create_app(_engine_factory(root), ServerSettings(default_max_tokens=4, served_model_name=[MODEL, "rag"]))
    app.state.scheduler.wait_ready(120)
    try:
        with ServerThread(app) as server:
            yield app, server.base_url + "/v1", root / "docs"
    finally:
        app.state.scheduler.close()


def _stored_chunks_of(app, path: Path) -> list[int]:
    sched = app.state.scheduler
    return sched.run_task(lambda: sched.engine.store.chunk_ids_of_docs([str(path.resolve())])).result(30)


def test_retrieve_returns_stored_chunks_with_their_source(live):
    _app, url, docs = live
    hits = httpx.post(url + "/retrieve", json={"query": Q, "top_k": 3}).json()["data"]
    assert len(hits) == 3
    assert {"chunk_id", "title", "text", "source", "score"} <= set(hits[0])
    assert all(h["source"] in {str((docs / n).resolve()) for n in FILES} for h in hits)
    assert hits == sorted(hits, key=lambda h: -h["score"])
    error_of(httpx.post(url + "/retrieve", json={"query": Q, "top_k": 0}), 400)
    error_of(httpx.post(url + "/retrieve", json={"query": Q, "top_k": 999}), 400, "invalid_value")
    error_of(httpx.post(url + "/retrieve", json={"query": ""}), 400)
    error_of(httpx.post(url + "/retrieve", json={"query": Q, "k": 2}), 400, "unsupported_parameter")


def test_langchain_with_the_fusionrag_retriever_reuses_every_chunk(live):
    pytest.importorskip("langchain_openai", reason=NO_LANGCHAIN)
    from fusionrag.integrations.langchain import FusionRAGRetriever, chat_model, rag_chain, sources

    _app, url, _docs = live
    retriever = FusionRAGRetriever(base_url=url, top_k=3)
    found = retriever.invoke(Q)
    assert len(found) == 3 and all(d.metadata["chunk_id"] is not None for d in found)
    chain = rag_chain(retriever, chat_model(url, model=MODEL, method="fusionrag", max_tokens=4, max_retries=0))
    msg = chain.invoke(Q)
    usage = msg.response_metadata["token_usage"]["fusionrag"]
    assert usage["chunks"] == 3 and usage["reused_chunks"] == 3 and usage["adhoc_chunks"] == 0
    cited = sources(msg)
    assert [d.metadata["chunk_id"] for d in cited] == [d.metadata["chunk_id"] for d in found]
    assert all(d.metadata["source"] == found[0].metadata["source"] or d.metadata["source"] for d in cited)


@pytest.mark.parametrize("name", sorted(FILES))
def test_langchain_whole_file_documents_reuse_every_chunk_of_the_file(live, name):
    """A loader's document per file (title none, source the path), as LangChain's TextLoader makes them."""
    pytest.importorskip("langchain_openai", reason=NO_LANGCHAIN)
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from fusionrag.integrations.langchain import chat_model, rag_chain

    app, url, docs = live
    path = docs / name
    loaded = [Document(page_content=path.read_text(encoding="utf-8"), metadata={"source": str(path)})]
    chain = rag_chain(RunnableLambda(lambda _q: loaded),
                      chat_model(url, model="rag", method="fusionrag", max_tokens=4, max_retries=0))
    usage = chain.invoke(Q).response_metadata["token_usage"]["fusionrag"]
    stored = _stored_chunks_of(app, path)
    assert usage["chunks"] == len(stored) == usage["reused_chunks"] and usage["adhoc_chunks"] == 0
    assert [s["chunk_id"] for s in usage["sources"]] == stored


def test_langchain_chain_pasting_its_context_reuses_the_stored_chunks_it_pasted(live):
    """A chain that pastes a file's text into its prompt: no chunk it did not paste is added (no server-side
    retrieval by default), and the stored chunks found in the pasted text reuse their KV."""
    pytest.importorskip("langchain_openai", reason=NO_LANGCHAIN)
    from fusionrag.integrations.langchain import chat_model

    app, url, docs = live
    stored = _stored_chunks_of(app, docs / "velmora.txt")
    for flags in ({}, {"retrieval": False}):
        llm = chat_model(url, model=MODEL, max_tokens=4, max_retries=0, **flags)
        usage = llm.invoke(f"Context: {FILES['velmora.txt']}\n\nQuestion: {Q}").response_metadata["token_usage"]
        found = [s["chunk_id"] for s in usage["fusionrag"]["sources"] if s["chunk_id"] is not None]
        assert found == stored and usage["fusionrag"]["reused_chunks"] == len(stored), flags
    plain = chat_model(url, model=MODEL, max_tokens=4, max_retries=0).invoke(Q).response_metadata["token_usage"]
    assert plain["fusionrag"]["chunks"] == 0  # a question alone gets no chunk it did not ask for


def test_llamaindex_with_the_fusionrag_retriever_reuses_every_chunk(live):
    pytest.importorskip("llama_index.llms.openai_like", reason="llama-index-llms-openai-like is not installed")
    from fusionrag.integrations.llamaindex import FusionRAGQueryEngine, FusionRAGRetriever, llm

    _, url, _ = live
    engine = FusionRAGQueryEngine(retriever=FusionRAGRetriever(url, top_k=2), llm=llm(url, model=MODEL, max_tokens=4),
                                  method="fusionrag")
    response = engine.query(Q)
    usage = response.metadata["fusionrag"]
    assert usage["chunks"] == 2 and usage["reused_chunks"] == 2
    assert [n.node.metadata["chunk_id"] for n in response.source_nodes] == [s["chunk_id"] for s in usage["sources"]]


def test_llamaindex_directory_reader_documents_reuse_every_chunk(live):
    """LlamaIndex's own SimpleDirectoryReader over the ingested folder: each file one document."""
    pytest.importorskip("llama_index.llms.openai_like", reason="llama-index-llms-openai-like is not installed")
    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore

    from fusionrag.integrations.llamaindex import FusionRAGQueryEngine, llm

    app, url, docs = live
    loaded = [d for d in SimpleDirectoryReader(input_files=[str(docs / "velmora.txt")]).load_data()]

    class Whole(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=d, score=1.0) for d in loaded]

    engine = FusionRAGQueryEngine(retriever=Whole(), llm=llm(url, model=MODEL, max_tokens=4), method="fusionrag")
    usage = engine.query(Q).metadata["fusionrag"]
    stored = _stored_chunks_of(app, docs / "velmora.txt")
    assert usage["chunks"] == usage["reused_chunks"] == len(stored)


def test_served_names_and_vllm_habits(live):
    _, url, _ = live
    assert [m["id"] for m in httpx.get(url + "/models").json()["data"]] == [MODEL, "rag"]
    ask = {"messages": [{"role": "user", "content": Q}], "max_tokens": 2}
    err = error_of(httpx.post(url + "/chat/completions", json={**ask, "model": "gpt-4o"}), 404, "model_not_found")
    assert "gpt-4o" in err["message"]
    neutral = {"model": "rag", "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "store": False,
               "logit_bias": {}}
    ok = httpx.post(url + "/chat/completions", json={**ask, **neutral})
    assert ok.status_code == 200, ok.text
    assert ok.json()["model"] == MODEL
    for field, value in [("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"50": 10})]:
        ok = httpx.post(url + "/chat/completions", json={**ask, field: value})  # vLLM's sampling fields work
        assert ok.status_code == 200, ok.text
    for field, value in [("store", True)]:
        err = error_of(httpx.post(url + "/chat/completions", json={**ask, field: value}), 400, "unsupported_parameter")
        assert err["param"] == field
    assert httpx.get(url.removesuffix("/v1") + "/metrics").status_code == 200


def test_a_server_without_a_store_generates_and_refuses_document_routes(tmp_path):
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine

    app = create_app(lambda: Engine(None, load_model(MODEL)), ServerSettings(default_max_tokens=3))
    app.state.scheduler.wait_ready(120)
    try:
        with ServerThread(app) as server:
            base = server.base_url
            r = httpx.post(base + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": Q}], "retrieval": True})
            assert r.status_code == 200, r.text
            reuse = r.json()["usage"]["fusionrag"]
            assert reuse["chunks"] == 0 and "no store" in reuse["note"]
            with_docs = httpx.post(base + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": Q}], "documents": [{"text": FILES["velmora.txt"]}]})
            assert with_docs.json()["usage"]["fusionrag"]["adhoc_chunks"] == 1
            error_of(httpx.post(base + "/v1/retrieve", json={"query": Q}), 409, "no_store")
            error_of(httpx.post(base + "/v1/documents", json=[{"text": "t"}]), 409, "no_store")
            assert httpx.get(base + "/v1/documents").json()["data"] == []
    finally:
        app.state.scheduler.close()


def test_yaml_takes_flag_names_and_settings_fail_before_loading(tmp_path, monkeypatch):
    from fusionrag.errors import FusionRAGError

    cfg = tmp_path / "server.yaml"
    cfg.write_text("max-batch: 3\nmethod: fusionrag\nserved-model-name: [a, b]\nmetrics_need_key: true\n")
    s = load_settings(cfg)
    assert (s.max_batch, s.default_method, s.served_model_name, s.metrics_need_key) == (3, "fusionrag", ["a", "b"],
                                                                                        True)
    monkeypatch.setenv("FUSIONRAG_SERVED_MODEL_NAME", "x,y")
    assert load_settings().served_model_name == ["x", "y"]
    for bad in ({"default_method": "bogus"}, {"default_ratio": 5}, {"max_batch": -1}, {"port": 99999},
                {"memory_budget_mb": -5}):
        with pytest.raises(FusionRAGError, match="invalid server setting"):
            load_settings(**bad)
