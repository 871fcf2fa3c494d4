"""Framework integrations (optional extras): a framework's own RAG pipeline, fusionrag's reuse.

Two paths, both ending in a request whose ``documents`` are the retrieved passages:

- **fusionrag retrieves**: ``FusionRAGRetriever`` (one for each framework) asks the server's
  ``POST /v1/retrieve`` for the store's chunks; sent back unchanged, every one of them is a
  stored chunk (found by content hash) and its precomputed KV is reused.
- **the framework retrieves** (its own vector store, splitter, loaders): the documents go as
  passages with their ``source``; the server maps them onto the stored chunks whatever the
  split (:mod:`fusionrag.retrieval.matching`), so a document holding an ingested file reuses
  every chunk of it, and new text is computed once and kept in the prefix cache.

A framework that pastes its context into the prompt (and sends no documents) needs nothing: the server
adds none of its own store's chunks unless a request asks (``retrieval: true``), and the stored chunks
it finds pasted in the prompt reuse their KV where they occur.

- :mod:`fusionrag.integrations.langchain` (``pip install fusionrag[langchain]``)
- :mod:`fusionrag.integrations.llamaindex` (``pip install fusionrag[llamaindex]``)

Both talk to ``fusionrag serve`` through the framework's own OpenAI client; nothing here
imports the engine. The response's ``usage.fusionrag`` says how many passages were reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: Metadata keys naming where a document came from, as the frameworks' loaders write them.
SOURCE_KEYS = ("source", "file_path")


def passage(text: str, metadata: Mapping[str, Any] | None = None) -> dict[str, str]:
    """One ``documents`` entry: the text as retrieved, its title and source from the metadata when there.

    A chunk from ``FusionRAGRetriever`` carries its stored title, so it is found by content
    hash; any other text is matched on the server (its ``source``, a file path, helps).
    """
    meta = metadata or {}
    out = {"title": str(meta.get("title") or ""), "text": text}
    source = next((str(meta[k]) for k in SOURCE_KEYS if meta.get(k)), "")
    if source:
        out["source"] = source[:4096]
    return out


def retrieve(base_url: str, query: str, top_k: int | None = None, api_key: str | None = None,
             timeout: float = 60.0) -> list[dict[str, Any]]:
    """``POST {base_url}/retrieve``: the store's chunks for ``query`` (``chunk_id, title, text, source, score``).

    A one-line :class:`RuntimeError` when the server answers with an error."""
    import httpx

    body: dict[str, Any] = {"query": query}
    if top_k is not None:
        body["top_k"] = int(top_k)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.post(base_url.rstrip("/") + "/retrieve", json=body, headers=headers, timeout=timeout)
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        raise RuntimeError(f"fusionrag retrieve failed ({resp.status_code}): {message}")
    return list(resp.json()["data"])


def chunk_metadata(hit: Mapping[str, Any]) -> dict[str, Any]:
    """A retrieved chunk's metadata as both frameworks keep it (the text is the document's content)."""
    return {k: hit[k] for k in ("chunk_id", "title", "source", "score")}


def fusionrag_fields(method: str | None = None, ratio: float | None = None, **extra: Any) -> dict[str, Any]:
    """fusionrag's request fields (``extra_body``), leaving out what the server should default."""
    fields = {"method": method, "ratio": ratio, **extra}
    return {k: v for k, v in fields.items() if v is not None}


def documents_body(items: Iterable[dict[str, str]], **fields: Any) -> dict[str, Any]:
    """The ``extra_body`` of one request: the passages plus fusionrag's fields."""
    return {**fields, "documents": list(items)}
