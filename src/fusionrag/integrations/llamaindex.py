"""LlamaIndex: a retriever over fusionrag's store, an ``OpenAILike`` LLM, a query engine sending nodes as passages.

::

    from fusionrag.integrations.llamaindex import FusionRAGQueryEngine, FusionRAGRetriever, llm

    url = "http://127.0.0.1:8000/v1"
    engine = FusionRAGQueryEngine(retriever=FusionRAGRetriever(url, top_k=5), llm=llm(url, model="qwen2.5-0.5b"))
    response = engine.query("Who discovered polonium?")
    response.metadata["fusionrag"]["reused_chunks"]   # 5

Any LlamaIndex retriever works too (``index.as_retriever()`` over the same files: the
server maps its nodes onto the stored chunks). LlamaIndex's own query engines format the
nodes into the prompt text; this one sends them as ``documents`` so their KV is reused, and
keeps the nodes as ``source_nodes``.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.llms import ChatMessage
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.openai_like import OpenAILike

from fusionrag.integrations import chunk_metadata, documents_body, fusionrag_fields, passage, retrieve


class FusionRAGRetriever(BaseRetriever):
    """The store's chunks for a query (``POST /v1/retrieve``) as scored nodes whose KV the server has precomputed.

    Node ids are ``fusionrag-chunk-ID``; ``metadata``: ``chunk_id``, ``title``, ``source``, ``score``."""

    def __init__(self, base_url: str, top_k: int | None = None, api_key: str | None = None,
                 timeout: float = 60.0, **kwargs: Any) -> None:
        self.base_url, self.top_k, self.api_key, self.timeout = base_url, top_k, api_key, timeout
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = retrieve(self.base_url, query_bundle.query_str, self.top_k, self.api_key, self.timeout)
        return [NodeWithScore(node=TextNode(id_=f"fusionrag-chunk-{h['chunk_id']}", text=h["text"],
                                            metadata=chunk_metadata(h)), score=h["score"]) for h in hits]


def llm(api_base: str, model: str, api_key: str = "none", retrieval: bool | None = None,
        **kwargs: Any) -> OpenAILike:
    """``OpenAILike`` for a fusionrag server, as a chat model (greedy unless ``temperature`` is given).

    ``model``: a name the server serves (``GET /v1/models``). LlamaIndex's own engines paste their context
    into the prompt: the server adds none of its own chunks unless ``retrieval=True``, and reuses the stored
    chunks it finds pasted."""
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("context_window", 8192)
    if retrieval is not None:
        kwargs["additional_kwargs"] = {**kwargs.get("additional_kwargs", {}),
                                       "extra_body": {"retrieval": bool(retrieval)}}
    return OpenAILike(api_base=api_base, api_key=api_key, model=model, is_chat_model=True, **kwargs)


def to_passages(nodes: list[NodeWithScore]) -> list[dict[str, str]]:
    """Retrieved nodes as fusionrag passages (text without metadata; title and source from the metadata)."""
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
