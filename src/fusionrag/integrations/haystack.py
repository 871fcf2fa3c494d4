"""Haystack: a retriever over fusionrag's store and a generator that sends a pipeline's documents as passages.

::

    from haystack import Pipeline
    from fusionrag.integrations.haystack import FusionRAGGenerator, FusionRAGRetriever

    url = "http://127.0.0.1:8000/v1"
    pipe = Pipeline()
    pipe.add_component("retriever", FusionRAGRetriever(url, top_k=5))
    pipe.add_component("llm", FusionRAGGenerator(url, model="qwen2.5-0.5b"))
    pipe.connect("retriever.documents", "llm.documents")
    out = pipe.run({"retriever": {"query": q}, "llm": {"query": q}})
    out["llm"]["replies"][0], out["llm"]["meta"][0]["usage"]["fusionrag"]["reused_chunks"]   # 5

Any Haystack retriever can feed ``FusionRAGGenerator`` (its documents are mapped onto the stored
chunks by the server). Haystack's own ``OpenAIChatGenerator`` also works against ``fusionrag serve``
(pass ``generation_kwargs={"extra_body": {"documents": [...]}}``); this component is that request,
built from the pipeline's documents, over httpx (nothing here imports the engine).
"""

from __future__ import annotations

from typing import Any

from haystack import Document, component

from fusionrag.integrations import chunk_metadata, documents_body, fusionrag_fields, passage, retrieve


@component
class FusionRAGRetriever:
    """The store's chunks for a query (``POST /v1/retrieve``), as Documents whose KV the server has precomputed.

    ``meta``: ``chunk_id``, ``title``, ``source`` (the ingested file); ``score``: cosine similarity."""

    def __init__(self, base_url: str, top_k: int | None = None, api_key: str | None = None,
                 timeout: float = 60.0) -> None:
        self.base_url, self.top_k, self.api_key, self.timeout = base_url, top_k, api_key, timeout

    @component.output_types(documents=list[Document])
    def run(self, query: str, top_k: int | None = None) -> dict[str, Any]:
        hits = retrieve(self.base_url, query, top_k if top_k is not None else self.top_k, self.api_key, self.timeout)
        return {"documents": [Document(content=h["text"], meta=chunk_metadata(h), score=h["score"]) for h in hits]}


@component
class FusionRAGGenerator:
    """Answers ``query`` over ``documents`` (sent as the request's passages, so stored chunks reuse their KV).

    ``replies``: the answer; ``meta``: the model, finish reason and ``usage`` (with ``usage["fusionrag"]``:
    reused chunks, method, sources). Without ``documents`` the server searches its store only with
    ``retrieval=True`` (or when started with ``--default-retrieval on``)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, method: str | None = None,
                 ratio: float | None = None, retrieval: bool | None = None, max_tokens: int | None = None,
                 timeout: float = 120.0) -> None:
        self.base_url, self.model, self.api_key, self.timeout = base_url, model, api_key, timeout
        self.method, self.ratio, self.retrieval, self.max_tokens = method, ratio, retrieval, max_tokens

    @component.output_types(replies=list[str], meta=list[dict[str, Any]])
    def run(self, query: str, documents: list[Document] | None = None) -> dict[str, Any]:
        import httpx

        fields = fusionrag_fields(self.method, self.ratio, retrieval=self.retrieval)
        if documents is not None:
            fields = documents_body([passage(d.content or "", d.meta) for d in documents], **fields)
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": query}],
                                "temperature": 0.0, **fields}
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        resp = httpx.post(self.base_url.rstrip("/") + "/chat/completions", json=body, headers=headers,
                          timeout=self.timeout)
        if resp.status_code != 200:  # the server's OpenAI error body names the field and the reason
            raise RuntimeError(f"fusionrag chat completion failed ({resp.status_code}): {resp.text[:300]}")
        data = resp.json()
        choice = data["choices"][0]
        meta = {"model": data.get("model"), "finish_reason": choice.get("finish_reason"),
                "usage": data.get("usage") or {}}
        return {"replies": [choice["message"]["content"]], "meta": [meta]}
