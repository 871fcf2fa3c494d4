"""LangChain: a retriever over fusionrag's store, a ``ChatOpenAI`` for ``fusionrag serve``, a RAG chain.

::

    from fusionrag.integrations.langchain import FusionRAGRetriever, chat_model, rag_chain, sources

    url = "http://127.0.0.1:8000/v1"
    chain = rag_chain(FusionRAGRetriever(base_url=url, top_k=5), chat_model(url, model="qwen2.5-0.5b"))
    msg = chain.invoke("Who discovered polonium?")
    msg.response_metadata["token_usage"]["fusionrag"]["reused_chunks"]   # 5: every chunk's KV reused
    sources(msg)                                                           # the chunks, as Documents

Any other retriever works too (a vector store over the same files: its documents are mapped
onto the stored chunks by the server). A thin wrapper, on purpose: ``ChatOpenAI`` already
speaks the protocol, and everything a LangChain user configures on it (streaming,
callbacks, retries) keeps working. What it adds is where the documents go:
``extra_body["documents"]``, not the prompt text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_openai import ChatOpenAI

from fusionrag.integrations import chunk_metadata, documents_body, fusionrag_fields, passage, retrieve


class FusionRAGRetriever(BaseRetriever):
    """The store's chunks for a query (``POST /v1/retrieve``), as Documents whose KV the server has precomputed.

    ``metadata``: ``chunk_id``, ``title``, ``source`` (the ingested file), ``score`` (cosine similarity).
    """

    base_url: str
    top_k: int | None = None
    api_key: str | None = None
    timeout: float = 60.0

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        hits = retrieve(self.base_url, query, self.top_k, self.api_key, self.timeout)
        return [Document(page_content=h["text"], metadata=chunk_metadata(h)) for h in hits]


def chat_model(base_url: str, model: str, api_key: str = "none", method: str | None = None,
               ratio: float | None = None, retrieval: bool | None = None, **kwargs: Any) -> ChatOpenAI:
    """``ChatOpenAI`` for a fusionrag server (greedy unless ``temperature`` is given).

    ``model``: a name the server serves (``GET /v1/models``); ``retrieval=True`` to have the server search
    its store for a question alone (a server does not unless asked or started with ``--default-retrieval
    on``). A chain that pastes its context needs nothing: the stored chunks in it are found and reused."""
    kwargs.setdefault("temperature", 0.0)
    return ChatOpenAI(base_url=base_url, api_key=api_key, model=model,
                      extra_body=fusionrag_fields(method, ratio, retrieval=retrieval) or None, **kwargs)


def to_passages(docs: Sequence[Document]) -> list[dict[str, str]]:
    """LangChain documents as fusionrag passages (title and source from the metadata)."""
    return [passage(d.page_content, d.metadata) for d in docs]


def with_documents(llm: ChatOpenAI, docs: Sequence[Document]) -> Runnable:
    """``llm`` bound to answer over ``docs``: they go as the request's passages (``[]``: none, no retrieval)."""
    return llm.bind(extra_body=documents_body(to_passages(docs), **(llm.extra_body or {})))


def rag_chain(retriever: Runnable, llm: ChatOpenAI) -> Runnable:
    """question -> ``retriever`` -> ``llm`` answering over the retrieved documents (invoke or stream)."""

    def route(question: str) -> Runnable:
        docs = retriever.invoke(question)
        return with_documents(llm, docs)

    return RunnableLambda(route, name="fusionrag_rag_chain")


def sources(message: BaseMessage) -> list[Document]:
    """The chunks an answer used (``usage.fusionrag.sources``), as Documents without text (to cite them)."""
    usage = (message.response_metadata.get("token_usage") or {}).get("fusionrag") or {}
    return [Document(page_content="", metadata=dict(s)) for s in usage.get("sources", [])]
