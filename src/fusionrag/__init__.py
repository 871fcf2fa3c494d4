"""fusionrag: fast RAG prefill by reusing precomputed, similarity-fused chunk KV caches.

Import cost matters for the CLI, so the heavy objects are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "KnowledgeStore", "load_model"]

if TYPE_CHECKING:
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from fusionrag.online.engine import Engine

        return Engine
    if name == "KnowledgeStore":
        from fusionrag.retrieval.knowledge import KnowledgeStore

        return KnowledgeStore
    if name == "load_model":
        from fusionrag.models import load_model

        return load_model
    raise AttributeError(name)
