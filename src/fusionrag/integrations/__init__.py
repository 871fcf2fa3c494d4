"""Framework integrations (optional extras): hand a framework's retrieved passages to fusionrag.

A RAG framework retrieves passages itself and would paste them into the user message,
where fusionrag cannot tell them from the question and reuses nothing. These adapters send
them as the request's ``documents`` instead, so each passage's KV is reused: its fused KV
when the store holds it (found by content hash), otherwise the prefix cache's plain KV.

- :mod:`fusionrag.integrations.langchain` (``pip install fusionrag[langchain]``)
- :mod:`fusionrag.integrations.llamaindex` (``pip install fusionrag[llamaindex]``)

Both talk to ``fusionrag serve`` through the framework's own OpenAI client; nothing here
imports the engine. The response's ``usage.fusionrag`` says how many passages were reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def passage(text: str, metadata: Mapping[str, Any] | None = None) -> dict[str, str]:
    """One ``documents`` entry: the text as retrieved, the title from the metadata when there is one.

    The title is part of the content hash (``[title] text``), so a passage is found in the
    store only with the title it was ingested with: ``metadata["title"]``, else none.
    """
    title = (metadata or {}).get("title") or ""
    return {"title": str(title), "text": text}


def fusionrag_fields(method: str | None = None, ratio: float | None = None, **extra: Any) -> dict[str, Any]:
    """fusionrag's request fields (``extra_body``), leaving out what the server should default."""
    fields = {"method": method, "ratio": ratio, **extra}
    return {k: v for k, v in fields.items() if v is not None}


def documents_body(items: Iterable[dict[str, str]], **fields: Any) -> dict[str, Any]:
    """The ``extra_body`` of one request: the passages plus fusionrag's fields."""
    return {**fields, "documents": list(items)}
