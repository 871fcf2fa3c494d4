"""LangChain: a ``ChatOpenAI`` pointed at ``fusionrag serve`` and a chain that sends the retriever's documents.

::

    from fusionrag.integrations.langchain import chat_model, rag_chain

    llm = chat_model("http://127.0.0.1:8000/v1", method="fusionrag", ratio=0.15)
    chain = rag_chain(vectorstore.as_retriever(), llm)
    msg = chain.invoke("Who discovered polonium?")
    msg.response_metadata["token_usage"]["fusionrag"]["reused_chunks"]

A thin wrapper, on purpose: ``ChatOpenAI`` already speaks the protocol, and everything a
LangChain user configures on it (streaming, callbacks, retries) keeps working. What it
adds is where the documents go: ``extra_body["documents"]``, not the prompt text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_openai import ChatOpenAI

from fusionrag.integrations import documents_body, fusionrag_fields, passage


def chat_model(base_url: str, model: str = "fusionrag", api_key: str = "none", method: str | None = None,
               ratio: float | None = None, **kwargs: Any) -> ChatOpenAI:
    """``ChatOpenAI`` for a fusionrag server (greedy unless ``temperature`` is given)."""
    kwargs.setdefault("temperature", 0.0)
    return ChatOpenAI(base_url=base_url, api_key=api_key, model=model,
                      extra_body=fusionrag_fields(method, ratio) or None, **kwargs)


def to_passages(docs: Sequence[Document]) -> list[dict[str, str]]:
    """LangChain documents as fusionrag passages (title from ``metadata["title"]``)."""
    return [passage(d.page_content, d.metadata) for d in docs]


def with_documents(llm: ChatOpenAI, docs: Sequence[Document]) -> Runnable:
    """``llm`` bound to answer over ``docs``: they go as the request's passages, reused by their content hash."""
    return llm.bind(extra_body=documents_body(to_passages(docs), **(llm.extra_body or {})))


def rag_chain(retriever: Runnable, llm: ChatOpenAI) -> Runnable:
    """question -> ``retriever`` -> ``llm`` answering over the retrieved documents (invoke or stream)."""

    def route(question: str) -> Runnable:
        docs = retriever.invoke(question)
        return with_documents(llm, docs)

    return RunnableLambda(route, name="fusionrag_rag_chain")
