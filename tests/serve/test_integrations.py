"""LangChain and LlamaIndex end to end: the real framework packages against a live ``fusionrag serve``.

The framework retrieves (its own vector store over the store's passages) and the
integration sends the retrieved documents as passages: the response's ``usage.fusionrag``
must report them reused from the store, and the answer must be what the engine gives for
those passages. Skipped, with the reason, when a framework package is not installed.
"""

from __future__ import annotations

import pytest

from serve_helpers import live_small_server, serial, stored_passages

Q = "Who discovered polonium?"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_small_server(tmp_path_factory) as (app, base):
        yield app, base + "/v1"


def test_langchain_chain_sends_the_retrieved_documents_and_they_are_reused(live):
    pytest.importorskip("langchain_openai",
                        reason="langchain-openai is not installed (pip install fusionrag[langchain])")
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from fusionrag.integrations.langchain import chat_model, rag_chain

    app, url = live
    corpus = stored_passages(app)
    store = InMemoryVectorStore.from_documents([Document(p["text"], metadata={"title": p["title"]}) for p in corpus],
                                               DeterministicFakeEmbedding(size=16))
    retriever = store.as_retriever(search_kwargs={"k": 3})
    llm = chat_model(url, model="tiny-llama", method="fusionrag", ratio=0.2, max_tokens=6, max_retries=0)
    chain = rag_chain(retriever, llm)

    msg = chain.invoke(Q)
    docs = [{"title": d.metadata["title"], "text": d.page_content} for d in retriever.invoke(Q)]
    usage = msg.response_metadata["token_usage"]["fusionrag"]
    assert usage["chunks"] == 3 and usage["reused_chunks"] == 3 and usage["adhoc_chunks"] == 0
    assert usage["method"] == "fusionrag" and usage["kv"] == "plain-first"
    assert msg.content == serial(app, Q, 6, chunks=docs, method="fusionrag", ratio=0.2).text
    streamed = "".join(chunk.content for chunk in chain.stream(Q))
    assert streamed.strip() == msg.content


def test_llamaindex_query_engine_sends_its_nodes_and_they_are_reused(live):
    pytest.importorskip("llama_index.llms.openai_like",
                        reason="llama-index-llms-openai-like is not installed (pip install fusionrag[llamaindex])")
    from llama_index.core import Settings, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    from fusionrag.integrations.llamaindex import FusionRAGQueryEngine, llm

    app, url = live
    corpus = stored_passages(app)
    Settings.embed_model = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex([TextNode(text=p["text"], metadata={"title": p["title"]}) for p in corpus])
    retriever = index.as_retriever(similarity_top_k=2)
    engine = FusionRAGQueryEngine(retriever=retriever, llm=llm(url, model="tiny-llama", max_tokens=6),
                                  method="cacheblend", ratio=0.3)

    response = engine.query(Q)
    usage = response.metadata["fusionrag"]
    assert usage["chunks"] == 2 and usage["reused_chunks"] == 2 and usage["method"] == "cacheblend"
    nodes = [{"title": n.node.metadata["title"], "text": n.node.get_content()} for n in response.source_nodes]
    assert response.response == serial(app, Q, 6, chunks=nodes, method="cacheblend", ratio=0.3).text
