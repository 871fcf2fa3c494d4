"""LlamaIndex: an ``OpenAILike`` LLM for ``fusionrag serve`` and a query engine that sends its nodes as passages.

::

    from fusionrag.integrations.llamaindex import FusionRAGQueryEngine, llm

    engine = FusionRAGQueryEngine(retriever=index.as_retriever(similarity_top_k=3),
                                  llm=llm("http://127.0.0.1:8000/v1"), method="fusionrag")
    response = engine.query("Who discovered polonium?")
    response.metadata["fusionrag"]["reused_chunks"]

LlamaIndex's own query engines format the nodes into the prompt text; this one sends them
as ``documents`` so their KV is reused, and keeps the nodes as ``source_nodes``.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.llms import ChatMessage
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore
from llama_index.llms.openai_like import OpenAILike

from fusionrag.integrations import documents_body, fusionrag_fields, passage


def llm(api_base: str, model: str = "fusionrag", api_key: str = "none", **kwargs: Any) -> OpenAILike:
    """``OpenAILike`` for a fusionrag server, as a chat model (greedy unless ``temperature`` is given)."""
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("context_window", 8192)
    return OpenAILike(api_base=api_base, api_key=api_key, model=model, is_chat_model=True, **kwargs)


def to_passages(nodes: list[NodeWithScore]) -> list[dict[str, str]]:
    """Retrieved nodes as fusionrag passages (title from the node's ``metadata["title"]``)."""
    return [passage(n.node.get_content(), n.node.metadata) for n in nodes]


def usage_of(raw: Any) -> dict[str, Any]:
    """``usage.fusionrag`` of a raw OpenAI response (an SDK object or a dict)."""
    usage = raw.get("usage") if isinstance(raw, dict) else getattr(raw, "usage", None)
    if usage is None:
        return {}
    if isinstance(usage, dict):
        return usage.get("fusionrag") or {}
    return (getattr(usage, "model_extra", None) or {}).get("fusionrag") or {}


class FusionRAGQueryEngine(CustomQueryEngine):
    """Retrieve with any LlamaIndex retriever, answer with fusionrag over the retrieved nodes."""

    retriever: BaseRetriever
    llm: OpenAILike
    method: str | None = None
    ratio: float | None = None

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        extra = documents_body(to_passages(nodes), **fusionrag_fields(self.method, self.ratio))
        out = self.llm.chat([ChatMessage(role="user", content=query_str)], extra_body=extra)
        return Response(response=str(out.message.content or ""), source_nodes=nodes,
                        metadata={"fusionrag": usage_of(out.raw)})
